#!/usr/bin/env python3
"""Inference oracle: `memplan estimate --inference` against Accelerate and Transformers 5.

For each config.json given (causal LMs of every family, real-shaped; models deeper than
--max-layers are cut to that many layers, `layer_types` with them, in a copy that both sides
read), it

  1. builds the model in fp32 on PyTorch's meta device (no memory) and sizes it with
     accelerate.utils.calculate_maximum_sizes, then divides as `accelerate estimate-memory` does
     (float16 /2, int8 /4, int4 /8): memplan's weights rows must equal these, rounded up;
  2. runs a forward of --batch x --context tokens on the meta device with use_cache=True and adds
     up the bytes of every tensor the returned DynamicCache holds: memplan's kv_cache.bytes (with
     --kv-dtype float32, the model's dtype here) must equal it. The default context is longer than
     the 4096-token sliding windows, so windowed layers are capped as Transformers caps them.

Runs in the modern environment (scripts/python-env.sh --modern); exits 1 on any mismatch, 2 on a
usage or environment error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from oracle_common import die as common_die


def die(message):
    common_die("inference-oracle", message)


try:
    import torch
    import transformers
    from accelerate.utils import calculate_maximum_sizes
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
except ImportError as error:
    die(f"cannot import torch/transformers/accelerate ({error}); run scripts/python-env.sh --modern")

transformers.logging.set_verbosity_error()
DIVISORS = {"float32": 1, "float16/bfloat16": 2, "int8": 4, "int4": 8}


def cut(data, max_layers):
    """The config with at most max_layers decoder layers (and its per-layer lists cut alike)."""
    data = dict(data)
    for field in ("num_hidden_layers", "n_layer", "num_layers"):
        if field in data and data[field] > max_layers:
            data[field] = max_layers
            for per_layer in ("layer_types",):
                if isinstance(data.get(per_layer), list):
                    data[per_layer] = data[per_layer][:max_layers]
    return data


def truth(data, batch, context):
    config = CONFIG_MAPPING[data["model_type"]].from_dict(dict(data))
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        total, (largest, _) = calculate_maximum_sizes(model)
        ids = torch.zeros(batch, context, dtype=torch.long)
        cache = model(input_ids=ids, use_cache=True).past_key_values
    kv = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                kv += tensor.numel() * tensor.element_size()
    return int(total), int(largest), kv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memplan", required=True)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--context", type=int, default=4100)
    parser.add_argument("--max-layers", type=int, default=8)
    parser.add_argument("configs", nargs="+")
    args = parser.parse_args()
    print(f"inference-oracle: transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{len(args.configs)} configs, batch {args.batch} x context {args.context}")
    started = time.monotonic()
    failed = 0
    with tempfile.TemporaryDirectory() as scratch:
        for path in args.configs:
            label = os.path.basename(path)
            with open(path, encoding="utf-8") as file:
                data = cut(json.load(file), args.max_layers)
            variant = os.path.join(scratch, label)
            with open(variant, "w", encoding="utf-8") as file:
                json.dump(data, file)
            total, largest, kv = truth(data, args.batch, args.context)
            result = subprocess.run(
                [args.memplan, "estimate", "--model", variant, "--inference", "--batch",
                 str(args.batch), "--context", str(args.context), "--kv-dtype", "float32",
                 "--format", "json"], capture_output=True, text=True, timeout=120, check=False)
            if result.returncode != 0:
                print(f"FAIL  {label}: memplan exit {result.returncode}: {result.stderr.strip()[:300]}")
                failed += 1
                continue
            inference = json.loads(result.stdout)["inference"]
            problems = []
            rows = {row["dtype"]: row for row in inference["weights"]}
            for dtype, divisor in DIVISORS.items():
                want = (-(-total // divisor), -(-largest // divisor))
                got = (rows[dtype]["total_bytes"], rows[dtype]["largest_layer_bytes"])
                if got != want:
                    problems.append(f"weights {dtype}: memplan {got}, accelerate {want}")
            mine = (inference.get("kv_cache") or {}).get("bytes")
            if mine != kv:
                problems.append(f"kv cache: memplan {mine}, transformers {kv}")
            if problems:
                failed += 1
                print(f"FAIL  {label}:")
                for problem in problems:
                    print(f"        {problem}")
            else:
                print(f"PASS  {label}: weights {total:,} B fp32, largest {largest:,} B, "
                      f"kv cache {kv:,} B ({inference['kv_cache']['kind']})")
    print(f"inference-oracle: {time.monotonic() - started:.1f}s; {len(args.configs) - failed} "
          f"passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
