#!/usr/bin/env python3
"""Regenerates the CPU optimizer fixtures in this folder from PyTorch.

Run with the project's virtual environment (Debian's python3-torch, 1.13):
    .venv/bin/python offload/testdata/make_adam_fixtures.py

Gradients and initial parameters are not stored: both sides draw them from the same splitmix64
stream (see Draw below and DrawFloats in offload/cpu_optimizer_test.cc), as fp32 values that are
exact (a 24-bit integer times a power of two), so only the final states are stored, ~4 KiB per
array. optimizer_fixtures.json lists the cases; <case>.bin holds float32 little-endian arrays
back to back in the order the case's "arrays" field names them.

Adam, AdamW (also amsgrad) and SGD come from torch.optim (foreach=False, the single-tensor
path whose operation order the C++ kernels reproduce). Lion is not in torch 1.13, so its reference
is lucidrains/lion-pytorch's update written out here with torch fp32 tensor operations.
"""
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SIZE = 1003  # odd, so every vector kernel runs a scalar tail
STEPS = 100
MASK64 = (1 << 64) - 1


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def draw(seed, count, exponent):
    """count floats (k - 2^23) * 2^exponent, k the top 24 bits of successive splitmix64 outputs."""
    state = seed
    out = np.empty(count, dtype=np.float32)
    for i in range(count):
        state, z = splitmix64(state)
        out[i] = np.float32((z >> 40) - (1 << 23)) * np.float32(2.0 ** exponent)
    return out


def initial_params(seed):
    return draw(seed, SIZE, -23)  # in [-1, 1)


def grad_for_step(seed, step):
    # Magnitudes vary by step (powers of two, so still exact) to exercise v's dynamics.
    return draw(seed * 1000003 + step, SIZE, -24 - (step % 4))  # |g| < 2^-(step % 4) / 2


def run_torch(optimizer_class, options, seed, state_names):
    p = torch.nn.Parameter(torch.from_numpy(initial_params(seed)).clone())
    optimizer = optimizer_class([p], **options)
    for step in range(1, STEPS + 1):
        p.grad = torch.from_numpy(grad_for_step(seed, step))
        optimizer.step()
    state = optimizer.state[p]
    arrays = {"params": p.detach().numpy().copy()}
    for name in state_names:
        arrays[name] = state[name].numpy().copy()
    return arrays


def run_lion(options, seed):
    lr, (beta1, beta2), wd = options["lr"], options["betas"], options["weight_decay"]
    p = torch.from_numpy(initial_params(seed)).clone()
    exp_avg = torch.zeros_like(p)
    for step in range(1, STEPS + 1):
        grad = torch.from_numpy(grad_for_step(seed, step))
        p.mul_(1 - lr * wd)
        update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()
        p.add_(update, alpha=-lr)
        exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
    return {"params": p.numpy().copy(), "exp_avg": exp_avg.numpy().copy()}


CASES = [
    # name, optimizer, torch options, seed
    ("adamw", "adamw", dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01), 1),
    ("adamw_amsgrad", "adamw",
     dict(lr=2e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=True), 2),
    ("adam_l2", "adam", dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01), 3),
    ("sgd_momentum", "sgd", dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-4), 4),
    ("sgd_nesterov", "sgd", dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3), 5),
    ("lion", "lion", dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1), 6),
]


def main():
    torch.set_num_threads(1)
    manifest = {"size": SIZE, "steps": STEPS, "torch_version": torch.__version__, "cases": []}
    for name, kind, options, seed in CASES:
        if kind == "adamw":
            arrays = run_torch(
                torch.optim.AdamW, dict(options, foreach=False), seed,
                ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if options.get("amsgrad") else []))
        elif kind == "adam":
            arrays = run_torch(torch.optim.Adam, dict(options, foreach=False), seed,
                               ["exp_avg", "exp_avg_sq"])
        elif kind == "sgd":
            arrays = run_torch(torch.optim.SGD, dict(options, foreach=False), seed,
                               ["momentum_buffer"])
        else:
            arrays = run_lion(options, seed)
        with open(os.path.join(HERE, name + ".bin"), "wb") as out:
            for array in arrays.values():
                out.write(array.astype("<f4").tobytes())
        json_options = {k: (list(v) if isinstance(v, tuple) else v) for k, v in options.items()}
        manifest["cases"].append({"name": name, "optimizer": kind, "seed": seed,
                                  "options": json_options, "arrays": list(arrays)})
    with open(os.path.join(HERE, "optimizer_fixtures.json"), "w") as out:
        json.dump(manifest, out, indent=1)
        out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
