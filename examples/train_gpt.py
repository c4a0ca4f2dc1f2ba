#!/usr/bin/env python3
"""Train a small GPT with its parameters and AdamW states offloaded to an NVMe directory.

    PYTHONPATH=build/python python3 examples/train_gpt.py --nvme /mnt/nvme/gpt --steps 50
    PYTHONPATH=build/python torchrun --nproc_per_node 2 examples/train_gpt.py --nvme /mnt/nvme/gpt

The model's parameters and optimizer states live in memplan's engine (on NVMe under --nvme, read
through a small pinned budget); each module's parameters are fetched just before it runs and
released after. With --compare the same model is also trained with plain torch.optim.AdamW and
the largest loss difference is printed (and checked against --tolerance).

Under torchrun every rank holds half (a 1/N shard) of every parameter and of the AdamW states
(ZeRO-3 over torch.distributed: gloo on CPU, NCCL on CUDA), trains on its slice of each batch
(--batch is the global batch), and the losses printed are the global batch's mean; --compare
then trains the reference on the whole global batch in each process.
"""
import argparse
import copy
import json
import math
import os
import sys

import torch
from torch import nn
import torch.nn.functional as F

import memplan.torch


class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=512, hidden=256, layers=6, heads=8, seq=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, tokens):
        x = self.tok(tokens[:, :-1]) + self.pos(torch.arange(tokens.shape[1] - 1,
                                                             device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batches(steps, batch, seq, vocab, seed=0):
    """Learnable sequences: each token is the previous one plus 5 (mod vocab), from random starts."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        yield (start + 5 * torch.arange(seq).unsqueeze(0)) % vocab


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nvme", required=True, help="directory for the engine's swap files")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--pinned-budget", type=int, default=8 << 20, help="bytes of pinned memory")
    p.add_argument("--compare", action="store_true", help="also train with torch.optim.AdamW")
    p.add_argument("--tolerance", type=float, default=1e-5)
    p.add_argument("--json", help="write losses and engine statistics here")
    p.add_argument("--device", default="cpu",
                   help="where torch computes: cpu (the engine's host runtime) or cuda[:N] (its "
                        "CUDA runtime, on that GPU)")
    args = p.parse_args(argv)

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), 0
    if world > 1:  # launched by torchrun: data parallel, one shard of everything per rank
        import torch.distributed as dist
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        rank = dist.get_rank()
        if args.device.startswith("cuda"):
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(torch.device(args.device))
        if args.batch % world != 0:
            p.error(f"--batch {args.batch} is not a multiple of the {world} ranks")
    local = args.batch // world
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(hidden=args.hidden, layers=args.layers, seq=args.seq).to(device)
    reference = copy.deepcopy(model) if args.compare else None
    n_params = sum(p.numel() for p in model.parameters())
    trainer = memplan.torch.offload(
        model, args.nvme, lr=args.lr, weight_decay=0.01, pinned_budget_bytes=args.pinned_budget,
        sub_group_elements=128 << 10, param_buffer_bytes=512 << 10, direct=False,
        device=device if device.type == "cuda" else None)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"GPT: {args.layers} layers, hidden {args.hidden}, {n_params:,} parameters; params + "
        f"AdamW states {16 * n_params / 2**20:.1f} MiB, pinned budget "
        f"{args.pinned_budget / 2**20:.1f} MiB" + (f"; {world} ranks" if world > 1 else ""))
    losses = []
    for step, tokens in enumerate(batches(args.steps, args.batch, args.seq + 1, 512)):
        loss = model(tokens[rank * local:(rank + 1) * local].to(device))
        loss.backward()
        trainer.step()
        value = loss.detach()
        if world > 1:
            dist.all_reduce(value)
            value = value / world
        losses.append(value.item())
        if step % 10 == 0 or step == args.steps - 1:
            say(f"step {step:3d}  loss {losses[-1]:.6f}")
    stats = trainer.stats()
    trainer.close()
    say("engine:", json.dumps({k: stats[k] for k in ("steps", "d2h_bytes",
                                 "optimizer_read_bytes", "optimizer_write_bytes",
                                 "pinned_bytes")}),
          json.dumps({k: stats["param"][k] for k in ("nvme_read_bytes", "prefetch_hits",
                                                     "stall_s", "peak_live_bytes")}))
    result = {"losses": losses, "stats": stats, "parameters": n_params}
    status = 0
    if reference is not None:
        optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.01)
        ref_losses = []
        for tokens in batches(args.steps, args.batch, args.seq + 1, 512):
            optimizer.zero_grad()
            loss = reference(tokens.to(device))
            loss.backward()
            optimizer.step()
            ref_losses.append(loss.item())
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        say(f"torch.optim.AdamW: final loss {ref_losses[-1]:.6f}; max |loss difference| over "
              f"{args.steps} steps: {diff:.3g} (tolerance {args.tolerance:g})")
        result.update(reference_losses=ref_losses, max_abs_diff=diff)
        status = 0 if diff <= args.tolerance else 1
    if args.json and rank == 0:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f)
    if world > 1:
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
