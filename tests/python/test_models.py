"""memplan.torch on the models people fine-tune (issue 19): LoRA adapters training on a frozen base
that streams from NVMe, and Transformers causal LMs (Llama, GPT-2, Qwen2 shapes, random init, no
download), each against plain PyTorch."""
import os
import tempfile
import unittest

import torch
from torch import nn
import torch.nn.functional as F

import memplan.torch


class LoraLinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update, as PEFT's LoRA (B starts at zero)."""

    def __init__(self, features, rank=4, alpha=8):
        super().__init__()
        self.base = nn.Linear(features, features)
        self.base.requires_grad_(False)
        self.lora_A = nn.Linear(features, rank, bias=False)
        self.lora_B = nn.Linear(rank, features, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


class LoraModel(nn.Module):
    def __init__(self, vocab=256, hidden=384, layers=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.embed.requires_grad_(False)
        self.layers = nn.ModuleList(LoraLinear(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.requires_grad_(False)

    def forward(self, tokens):
        x = self.embed(tokens[:, :-1])
        for layer in self.layers:
            x = x + F.gelu(layer(x))
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def token_batches(steps, batch=4, seq=17, vocab=256, seed=5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        out.append((start + 3 * torch.arange(seq).unsqueeze(0)) % vocab)
    return out


def reference_losses(model, batches, loss_of, lr):
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.01)
    losses = []
    for tokens in batches:
        optimizer.zero_grad()
        loss = loss_of(model, tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


class LoraTest(unittest.TestCase):
    def test_adapters_train_on_a_frozen_base_streamed_from_nvme(self):
        steps, lr = 8, 1e-2
        torch.manual_seed(0)
        model = LoraModel()
        torch.manual_seed(0)
        ref = LoraModel()
        base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        base_bytes = 4 * sum(p.numel() for p in base.values())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        batches = token_batches(steps)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = memplan.torch.offload(
                model, os.path.join(tmp, "swap"), lr=lr, weight_decay=0.01,
                pinned_budget_bytes=1 << 20, sub_group_elements=8 << 10,
                param_buffer_bytes=128 << 10, direct=False)
            start = trainer.stats()
            losses = []
            for tokens in batches:
                loss = model(tokens)
                loss.backward()
                trainer.step()
                losses.append(loss.item())
            stats = trainer.stats()
            trainer.close()
        ref_losses = reference_losses(ref, batches, lambda m, t: m(t), lr)
        # The engine's AdamW rounds as torch's: the same losses, to the bit.
        self.assertEqual(losses, ref_losses)
        self.assertLess(losses[-1], losses[0] - 0.5, "the adapters learned nothing")
        # The base is 4x the pinned memory, held on NVMe only, read every step, never written.
        self.assertGreaterEqual(base_bytes, 4 * stats["pinned_bytes"])
        self.assertLessEqual(stats["pinned_bytes"], 1 << 20)
        self.assertEqual(stats["frozen_elements"], base_bytes // 4)
        self.assertEqual(stats["optimizer_elements"], trainable)
        read = stats["param"]["nvme_read_bytes"] - start["param"]["nvme_read_bytes"]
        self.assertGreaterEqual(read, steps * base_bytes)
        written = stats["param"]["nvme_write_bytes"] - start["param"]["nvme_write_bytes"]
        self.assertEqual(written, steps * 4 * trainable)  # the adapters' write-back only
        # No optimizer state for the base: the optimizer store moves 16 B per adapter element.
        self.assertLessEqual(stats["optimizer_write_bytes"], steps * 16 * (trainable + (8 << 10)))
        # close() gives the base back unchanged and the adapters as trained.
        for name, p in model.named_parameters():
            if name in base:
                self.assertTrue(torch.equal(p.detach(), base[name]), name)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            self.assertTrue(torch.equal(p.detach(), q.detach()), name)

    def test_every_parameter_frozen_is_refused(self):
        model = nn.Linear(4, 4)
        model.requires_grad_(False)
        with self.assertRaisesRegex(ValueError, "frozen"):
            memplan.torch.offload(model)


if __name__ == "__main__":
    unittest.main()
