#!/usr/bin/env python3
"""DeepSpeed's own ZeRO-3 NVMe offload, measured on its CPU accelerator, next to memplan's columns.

    MEMPLAN_MODERN_VENV=/work/venvs/modern  # or: bash scripts/python-env.sh --modern
    $VENV/bin/python bench/deepspeed_nvme_truth.py --memplan build/tools/memplan \
        [--layers 8 --hidden 512 --vocab 8192 --seq 128 --batch 2] [--nvme-dir DIR] [--json OUT]

Trains a small GPT-2 (Transformers, random weights, nothing downloaded) for two steps with
DeepSpeed 0.19 ZeRO-3, bf16, offload_param and offload_optimizer on NVMe (its async_io op is built
on first use and cached in TORCH_EXTENSIONS_DIR; libaio-dev is needed), on DeepSpeed's CPU
accelerator in one process (no GPU). It measures
  nvme:   the bytes of the swap files DeepSpeed leaves under nvme_path after a step;
  pinned: locked host memory (VmLck): the swap buffers DeepSpeed allocates with mlock;
  host:   resident memory (VmRSS) growth over the run's start, per phase;
and asks `memplan estimate` for the same setup (`--format json`). On the CPU accelerator the
"GPU" tensors (gathered parameters, activations, the reduce bucket) are host memory too, so host
growth is compared with memplan's CPU column plus its GPU allocated bytes (no CUDA context).
Prints a table and, with --json, writes the measurement in the format of
tests/accuracy/deepspeed_nvme.json (which tests/deepspeed_nvme_truth_test checks memplan against
without DeepSpeed).
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def tree_bytes(path):
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(dirpath, name))
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--memplan", default=os.path.join(ROOT, "build/tools/memplan"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--sub-group", type=int, default=100_000_000)
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--json", default=None, help="write the measurement here")
    args = ap.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    import torch
    import deepspeed
    import transformers

    config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": args.hidden,
        "n_layer": args.layers, "n_head": args.heads, "n_positions": max(args.seq, 128),
        "vocab_size": args.vocab, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
    }
    workdir = tempfile.mkdtemp(prefix="memplan-ds-nvme.")
    nvme = args.nvme_dir or os.path.join(workdir, "nvme")
    os.makedirs(nvme, exist_ok=True)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": args.sub_group,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True,
                              "buffer_count": 5, "buffer_size": 100_000_000},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True,
                                  "buffer_count": 4},
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1},
    }
    config_path = os.path.join(workdir, "config.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    ds_path = os.path.join(workdir, "ds_config.json")
    with open(ds_path, "w") as f:
        json.dump(ds_config, f)

    # zero.Init patches torch's tensor constructors; modules that Transformers imports lazily
    # while building the model (torch._dynamo among them) must be imported before it.
    import torch._dynamo  # noqa: F401
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    try:
        import transformers.integrations.flash_attention  # noqa: F401
    except ImportError:
        pass
    deepspeed.init_distributed(dist_backend="gloo")
    phases = {"start": (status_kib("VmRSS"), status_kib("VmLck"))}
    cfg = transformers.GPT2Config(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
    with deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=torch.bfloat16):
        model = transformers.GPT2LMHeadModel(cfg)
    params = sum(p.ds_numel for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config)
    gc.collect()
    phases["initialized"] = (status_kib("VmRSS"), status_kib("VmLck"))
    for step in range(2):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))
        loss = engine(input_ids=ids, labels=ids).loss
        phases[f"forward{step}"] = (status_kib("VmRSS"), status_kib("VmLck"))
        engine.backward(loss)
        phases[f"backward{step}"] = (status_kib("VmRSS"), status_kib("VmLck"))
        engine.step()
        phases[f"step{step}"] = (status_kib("VmRSS"), status_kib("VmLck"))
    nvme_bytes = tree_bytes(nvme)
    swap_files = {}
    for dirpath, _, files in os.walk(nvme):
        rel = os.path.relpath(dirpath, nvme)
        swap_files[rel] = sum(os.path.getsize(os.path.join(dirpath, n)) for n in files)

    flags = ["--model", config_path, "--deepspeed", ds_path, "--seq-len", str(args.seq),
             "--gpus", "1", "--cuda-context-mib", "0"]
    run = subprocess.run([args.memplan, "estimate", *flags, "--format", "json"],
                         capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit("memplan: " + run.stderr.strip())
    j = json.loads(run.stdout)
    allocated = max(p["gpu_allocated_bytes"] for p in j["phases"])
    start_rss, start_lck = phases["start"]
    peak_rss = max(v[0] for v in phases.values())
    peak_lck = max(v[1] for v in phases.values())
    measured = {
        "params": params,
        "nvme_bytes": nvme_bytes,
        "pinned_bytes": (peak_lck - start_lck) * 1024,
        "host_growth_bytes": (peak_rss - start_rss) * 1024,
        "phases_kib": phases,
        "swap_dirs": swap_files,
    }
    predicted = {"nvme_bytes": j["peak"]["nvme_bytes"], "pinned_bytes": j["peak"]["pinned_bytes"],
                 "cpu_bytes": j["peak"]["cpu_bytes"], "gpu_allocated_bytes": allocated,
                 "host_bytes": j["peak"]["cpu_bytes"] + allocated}
    result = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "config": config,
              "ds_config": {k: v for k, v in ds_config.items()}, "seq_len": args.seq,
              "memplan_flags": flags, "measured": measured, "predicted": predicted}
    result["ds_config"]["zero_optimization"]["offload_param"]["nvme_path"] = "NVME"
    result["ds_config"]["zero_optimization"]["offload_optimizer"]["nvme_path"] = "NVME"
    print(f"model: {params:,} parameters; DeepSpeed {deepspeed.__version__}, torch {torch.__version__}")
    print(f"{'column':12} {'measured':>14} {'memplan':>14} {'error':>8}")
    for name, m, p in [("nvme", nvme_bytes, predicted["nvme_bytes"]),
                       ("pinned", measured["pinned_bytes"], predicted["pinned_bytes"]),
                       ("host", measured["host_growth_bytes"], predicted["host_bytes"])]:
        err = f"{p / m - 1:+8.1%}" if m else "       -"
        print(f"{name:12} {m:14,} {p:14,} {err}")
    print("swap files:", json.dumps(swap_files))
    print("phases (VmRSS, VmLck KiB):", json.dumps(phases))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
