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
     the 4096-token sliding windows, so windowed layers are capped as Transformers caps them. An
     encoder-decoder model (T5) reads --encoder-context tokens and its decoder --context: the
     EncoderDecoderCache holds both (self-attention and cross-attention), and memplan gets the
     same --encoder-context;
  3. counts the weights bitsandbytes would quantize in 4 bits (Transformers' own rule:
     replace_with_bnb_linear's nn.Linear / Conv1D modules outside get_keys_to_not_convert, matched
     as should_convert_module matches): memplan's nf4 row must quantize exactly those parameters.
     bitsandbytes itself is not installed; its bytes per weight follow its documented layout.

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
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForSeq2SeqLM
except ImportError as error:
    die(f"cannot import torch/transformers/accelerate ({error}); run scripts/python-env.sh --modern")

transformers.logging.set_verbosity_error()
DIVISORS = {"float32": 1, "float16/bfloat16": 2, "int8": 4, "int4": 8}


def cut(data, max_layers):
    """The config with at most max_layers decoder layers (and its per-layer lists cut alike)."""
    data = dict(data)
    for field in ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers"):
        if field in data and data[field] > max_layers:
            data[field] = max_layers
            for per_layer in ("layer_types", "attention_layers"):
                if isinstance(data.get(per_layer), list):
                    data[per_layer] = data[per_layer][:max_layers]
            if isinstance(data.get("attention_types"), list):
                # GPT-Neo's [[["global", "local"], 12]] expands to one type per layer.
                kinds = [k for kinds, repeat in data["attention_types"] for _ in range(repeat)
                         for k in kinds]
                data["attention_types"] = [[[k], 1] for k in kinds[:max_layers]]
    return data


def truth(data, batch, context, encoder_context):
    config = CONFIG_MAPPING[data["model_type"]].from_dict(dict(data))
    config.dtype = torch.float32
    seq2seq = getattr(config, "is_encoder_decoder", False)
    with torch.device("meta"):
        if seq2seq:
            model = AutoModelForSeq2SeqLM.from_config(config, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        total, (largest, _) = calculate_maximum_sizes(model)
        bnb = bnb_quantized(model)
        ids = torch.zeros(batch, encoder_context if seq2seq else context, dtype=torch.long)
        if seq2seq:
            decoder_ids = torch.zeros(batch, context, dtype=torch.long)
            cache = model(input_ids=ids, decoder_input_ids=decoder_ids,
                          use_cache=True).past_key_values
            caches = [cache.self_attention_cache, cache.cross_attention_cache]
        else:
            caches = [model(input_ids=ids, use_cache=True).past_key_values]
    kv = 0
    for part in caches:
        for layer in part.layers:
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if tensor is not None:
                    kv += tensor.numel() * tensor.element_size()
    return int(total), int(largest), kv, bnb


def bnb_quantized(model):
    """Parameters Transformers' bitsandbytes integration stores in 4 bits."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module
    keep = get_keys_to_not_convert(model)
    return sum(module.weight.numel() for name, module in model.named_modules()
               if should_convert_module(name, keep)
               and (isinstance(module, Conv1D) or type(module) is nn.Linear))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memplan", required=True)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--context", type=int, default=4100)
    parser.add_argument("--max-layers", type=int, default=8)
    parser.add_argument("--encoder-context", type=int, default=1500,
                        help="encoder tokens of encoder-decoder models")
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
            total, largest, kv, bnb = truth(data, args.batch, args.context, args.encoder_context)
            result = subprocess.run(
                [args.memplan, "estimate", "--model", variant, "--inference", "--batch",
                 str(args.batch), "--context", str(args.context), "--kv-dtype", "float32",
                 "--encoder-context", str(args.encoder_context), "--format", "json"],
                capture_output=True, text=True, timeout=120, check=False)
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
            nf4 = rows.get("nf4", {}).get("quantized_params")
            if nf4 != bnb:
                problems.append(f"nf4: memplan quantizes {nf4} parameters, bitsandbytes {bnb}")
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
                      f"nf4 {bnb:,} params, kv cache {kv:,} B ({inference['kv_cache']['kind']})")
    print(f"inference-oracle: {time.monotonic() - started:.1f}s; {len(args.configs) - failed} "
          f"passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
