"""The small model, batches and loss that the offload() training tests share (test_training.py,
test_defaults.py): a five-layer MLP regression, reproducible from its seeds."""
import torch
from torch import nn


def mlp(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32),
                         nn.Linear(32, 4))


def data(steps, batch=8, scale=1.0, seed=2):
    """`steps` batches of (input, target); `scale` multiplies the targets (larger targets give
    larger gradients, so that clipping bites)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 16, generator=g), scale * torch.randn(batch, 4, generator=g))
            for _ in range(steps)]


def loss_of(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)
