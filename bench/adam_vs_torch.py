#!/usr/bin/env python3
"""memplan's CPU AdamW against torch.optim.AdamW and against the memory roofline, in one run.

    .venv/bin/python bench/adam_vs_torch.py --memplan build/tools/memplan [--params 50000000]
        [--threads N] [--param-dtype fp32|bf16|fp16] [--seconds 3] [--json]

Measures, on the same machine with the same thread count:
  1. memplan's CPU AdamW step (`memplan bench adam --format json`);
  2. torch.optim.AdamW(foreach=True) on the same number of fp32 params (torch.set_num_threads),
     split into tensors of --tensor-size elements, as a model's parameters are;
  3. a STREAM triad a = b + s * c, compiled (`memplan bench adam --triad`: same threads, as much
     memory as the Adam arrays): the memory bandwidth an element-wise optimizer step can hope for.
     It counts 24 bytes per fp64 element (read b and c, write a), as STREAM does; the write of a
     also reads its line first (write-allocate), so the memory really moves 32 bytes per element.
     The torch triad (one fused torch.add, same threads) is printed beside it for reference.
Prints params/s of both optimizers, their ratio, and memplan's bytes/s (28 per fp32 param: read p,
g, m, v; write p, m, v; +2 with a 16-bit copy) as a fraction of the triad's. A benchmark, not a test:
the figures move with the machine's load.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch


def run_memplan(args):
    command = [args.memplan, "bench", "adam", "--params", str(args.params), "--threads",
               str(args.threads), "--param-dtype", args.param_dtype, "--seconds",
               str(args.seconds), "--triad", "--format", "json"]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit("memplan bench adam failed (%d): %s" % (done.returncode, done.stderr.strip()))
    return json.loads(done.stdout)


def timed_steps(step, seconds, min_steps=3):
    step()  # warm-up: allocation, page faults, lazily created optimizer state
    steps, start = 0, time.perf_counter()
    while True:
        step()
        steps += 1
        elapsed = time.perf_counter() - start
        if steps >= min_steps and elapsed >= seconds:
            return steps, elapsed


def run_torch_adamw(args):
    generator = torch.Generator().manual_seed(0)
    sizes = [args.tensor_size] * (args.params // args.tensor_size)
    if args.params % args.tensor_size:
        sizes.append(args.params % args.tensor_size)
    params = [torch.nn.Parameter(torch.rand(n, generator=generator) - 0.5) for n in sizes]
    for p in params:
        p.grad = torch.rand(p.shape, generator=generator) - 0.5
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
    with torch.no_grad():
        steps, elapsed = timed_steps(optimizer.step, args.seconds)
    del optimizer, params
    return {"params_per_s": args.params * steps / elapsed, "steps": steps, "seconds": elapsed}


def run_triad(args):
    n = args.triad_elements
    a = torch.empty(n, dtype=torch.float64)
    b = torch.full((n,), 1.0, dtype=torch.float64)
    c = torch.full((n,), 2.0, dtype=torch.float64)
    a.zero_()
    best = 0.0
    for _ in range(args.triad_repeats):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        elapsed = time.perf_counter() - start
        best = max(best, 24.0 * n / elapsed)  # STREAM reports the best of its repeats
    return {"bytes_per_s": best, "elements": n}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memplan", default="build/tools/memplan", help="the memplan binary")
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--param-dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per optimizer")
    parser.add_argument("--tensor-size", type=int, default=4_000_000,
                        help="elements per torch parameter tensor")
    parser.add_argument("--triad-elements", type=int, default=50_000_000)
    parser.add_argument("--triad-repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    memplan = run_memplan(args)
    torch_adamw = run_torch_adamw(args)
    triad = run_triad(args)
    report = {
        "params": args.params,
        "threads": args.threads,
        "torch_version": torch.__version__,
        "memplan": memplan,
        "torch_adamw_foreach": torch_adamw,
        "triad": memplan["triad"],
        "torch_triad": triad,
        "speedup_vs_torch": memplan["params_per_s"] / torch_adamw["params_per_s"],
        "fraction_of_triad": memplan["bytes_per_s"] / memplan["triad"]["best_bytes_per_s"],
        "fraction_of_triad_write_allocate":
            memplan["bytes_per_s"] / (memplan["triad"]["best_bytes_per_s"] * 32 / 24),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("params %d, threads %d, torch %s" % (args.params, args.threads, torch.__version__))
    print("memplan CPU AdamW (%s, %s): %8.3f G params/s  %7.2f GB/s" % (
        memplan["isa"], memplan["param_dtype"], memplan["params_per_s"] / 1e9,
        memplan["bytes_per_s"] / 1e9))
    print("torch AdamW foreach         : %8.3f G params/s" % (torch_adamw["params_per_s"] / 1e9))
    print("STREAM triad (compiled)     :                    %7.2f GB/s  (%.2f with write-allocate)" % (
        memplan["triad"]["best_bytes_per_s"] / 1e9,
        memplan["triad"]["best_bytes_per_s"] * 32 / 24 / 1e9))
    print("STREAM triad (torch, fp64)  :                    %7.2f GB/s" % (
        triad["bytes_per_s"] / 1e9))
    print("memplan / torch             : %8.2f x   (acceptance >= 3)" % report["speedup_vs_torch"])
    print("memplan / triad bandwidth   : %8.1f %%   (acceptance >= 70; %.1f %% of the "
          "write-allocate traffic)" % (100 * report["fraction_of_triad"],
                                       100 * report["fraction_of_triad_write_allocate"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
