#!/usr/bin/env python3
"""DeepSpeed's own ZeRO-3 NVMe offload, measured on its CPU accelerator, next to memplan's columns.

Measure (needs DeepSpeed >= 0.19 on PyPI torch: the modern venv; libaio-dev; minutes per model):

    TORCH_EXTENSIONS_DIR=/work/.torch_extensions $MEMPLAN_MODERN_VENV/bin/python \\
        bench/deepspeed_nvme_truth.py --memplan build/tools/memplan \\
        [--preset tiny|gpt2|gpt2-medium | --layers 8 --hidden 512 --vocab 8192] [--seq 128] \\
        [--batch 2] [--nvme-dir DIR] [--record tests/accuracy/deepspeed_nvme.json]

Check a recorded measurement against memplan (Python standard library only, no DeepSpeed; this
is tests/deepspeed_nvme_truth_test):

    python3 bench/deepspeed_nvme_truth.py --memplan build/tools/memplan \\
        --check tests/accuracy/deepspeed_nvme.json

A measurement trains a GPT-2 (Transformers, random weights, nothing downloaded) for two steps
with ZeRO-3, bf16, offload_param and offload_optimizer on NVMe, on DeepSpeed's CPU accelerator
in one process (async_io and cpu_adam are built on first use and cached in
TORCH_EXTENSIONS_DIR). It measures
  nvme:   the bytes of the swap files DeepSpeed leaves under nvme_path;
  pinned: locked host memory (VmLck) growth: the swap buffers DeepSpeed's aio handle allocates
          with mlock. On the CPU accelerator get_accelerator().pin_memory() is a no-op, so the
          16-bit gradient partition buffer, which a CUDA machine pins, is not locked here; the
          comparison takes memplan's swap-buffer items only and prints the full pinned column;
  host:   resident memory (VmRSS) growth over the start (after imports and op loading), per
          phase, with glibc's mmap threshold fixed so that freed tensors leave RSS. On the CPU
          accelerator the "GPU" tensors (gathered parameters, activations, the reduce bucket) are
          host memory too, so it is compared with the largest per-phase sum of memplan's CPU
          bytes and GPU allocated bytes (no CUDA context). The reduce bucket is set to 10M
          elements so that it is written (and resident) in full.
and asks `memplan estimate` for the same setup (--format json). Acceptance (issue 14): NVMe
within 2%, pinned and host within 10%.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = {  # GPT-2 shapes: (layers, hidden, heads, vocab)
    "tiny": (8, 512, 8, 8192),           # 29.5M parameters
    "gpt2": (12, 768, 12, 50257),        # 124M
    "gpt2-medium": (24, 1024, 16, 50257),  # 355M
}
TOLERANCE = {"nvme": 0.02, "pinned": 0.10, "host": 0.10}
SWAP_BUFFER_ITEMS = ("nvme_param_swap_buffers", "nvme_optimizer_swap_buffers")


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


def model_config(layers, hidden, heads, vocab, seq):
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": hidden,
            "n_layer": layers, "n_head": heads, "n_positions": max(seq, 128), "vocab_size": vocab,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def ds_config(batch, sub_group, nvme):
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": sub_group,
            "reduce_bucket_size": 10_000_000,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True,
                              "buffer_count": 5, "buffer_size": 100_000_000},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True,
                                  "buffer_count": 4},
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1},
    }


def predict(memplan, config, dsc, seq):
    """memplan's columns for the setup, comparable with what the CPU accelerator shows."""
    with tempfile.TemporaryDirectory(prefix="memplan-ds-check.") as tmp:
        config_path = os.path.join(tmp, "config.json")
        ds_path = os.path.join(tmp, "ds_config.json")
        with open(config_path, "w") as f:
            json.dump(config, f)
        with open(ds_path, "w") as f:
            json.dump(dsc, f)
        flags = ["--model", config_path, "--deepspeed", ds_path, "--seq-len", str(seq),
                 "--gpus", "1", "--cuda-context-mib", "0"]
        run = subprocess.run([memplan, "estimate", *flags, "--format", "json"],
                             capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit("memplan: " + run.stderr.strip())
    j = json.loads(run.stdout)
    swap_pinned = sum(i["pinned_bytes"] for i in j["breakdown"] if i["item"] in SWAP_BUFFER_ITEMS)
    host = max(p["cpu_bytes"] + p["gpu_allocated_bytes"] for p in j["phases"])
    return {"nvme_bytes": j["peak"]["nvme_bytes"], "pinned_bytes": swap_pinned,
            "pinned_column_bytes": j["peak"]["pinned_bytes"], "cpu_bytes": j["peak"]["cpu_bytes"],
            "host_bytes": host}


def compare(measured, predicted):
    """[(column, measured, predicted, error, ok)]"""
    rows = []
    for name, m, p in [("nvme", measured["nvme_bytes"], predicted["nvme_bytes"]),
                       ("pinned", measured["pinned_bytes"], predicted["pinned_bytes"]),
                       ("host", measured["host_growth_bytes"], predicted["host_bytes"])]:
        err = p / m - 1 if m else float("inf")
        rows.append((name, m, p, err, abs(err) <= TOLERANCE[name]))
    return rows


def print_rows(title, rows):
    print(title)
    print(f"  {'column':8} {'measured':>15} {'memplan':>15} {'error':>8}  limit")
    for name, m, p, err, ok in rows:
        print(f"  {name:8} {m:15,} {p:15,} {err:+8.2%}  {TOLERANCE[name]:.0%} "
              f"{'ok' if ok else 'FAIL'}")


def check(memplan, path):
    with open(path) as f:
        doc = json.load(f)
    failures = 0
    for run in doc["runs"]:
        predicted = predict(memplan, run["config"], run["ds_config"], run["seq_len"])
        rows = compare(run["measured"], predicted)
        print_rows(f"{run['name']}: {run['measured']['params']:,} parameters, DeepSpeed "
                   f"{run['deepspeed']}, torch {run['torch']}", rows)
        failures += sum(1 for r in rows if not r[4])
    return 1 if failures else 0


def measure(args):
    # glibc keeps freed heap memory resident and raises its mmap threshold after large frees;
    # a fixed threshold makes every large tensor an mmap that leaves RSS when freed.
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    for key, value in {"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29517", "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    import torch
    import deepspeed
    import transformers
    from deepspeed.accelerator import get_accelerator

    layers, hidden, heads, vocab = PRESETS[args.preset] if args.preset else (
        args.layers, args.hidden, args.heads, args.vocab)
    config = model_config(layers, hidden, heads, vocab, args.seq)
    workdir = tempfile.mkdtemp(prefix="memplan-ds-nvme.")
    nvme = args.nvme_dir or os.path.join(workdir, "nvme")
    os.makedirs(nvme, exist_ok=True)
    dsc = ds_config(args.batch, args.sub_group, nvme)

    # zero.Init patches torch's tensor constructors; modules that Transformers imports lazily
    # while building the model (torch._dynamo among them) must be imported before it.
    import torch._dynamo  # noqa: F401
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    try:
        import transformers.integrations.flash_attention  # noqa: F401
    except ImportError:
        pass
    deepspeed.init_distributed(dist_backend="gloo")
    for op in ("AsyncIOBuilder", "CPUAdamBuilder"):  # load (or build) the ops before the start
        get_accelerator().create_op_builder(op).load(verbose=False)
    gc.collect()
    phases = {"start": (status_kib("VmRSS"), status_kib("VmLck"))}
    cfg = transformers.GPT2Config(**{k: v for k, v in config.items()
                                     if k not in ("model_type", "architectures")})
    with deepspeed.zero.Init(config_dict_or_path=dsc, dtype=torch.bfloat16):
        model = transformers.GPT2LMHeadModel(cfg)
    params = sum(p.ds_numel for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=dsc)
    gc.collect()
    phases["initialized"] = (status_kib("VmRSS"), status_kib("VmLck"))
    for step in range(2):
        ids = torch.randint(0, vocab, (args.batch, args.seq))
        loss = engine(input_ids=ids, labels=ids).loss
        phases[f"forward{step}"] = (status_kib("VmRSS"), status_kib("VmLck"))
        engine.backward(loss)
        phases[f"backward{step}"] = (status_kib("VmRSS"), status_kib("VmLck"))
        engine.step()
        phases[f"step{step}"] = (status_kib("VmRSS"), status_kib("VmLck"))
    swap_files = {}
    for dirpath, _, files in os.walk(nvme):
        for name in files:
            swap_files[os.path.relpath(os.path.join(dirpath, name), nvme)] = os.path.getsize(
                os.path.join(dirpath, name))
    start_rss, start_lck = phases["start"]
    measured = {
        "params": params,
        "nvme_bytes": tree_bytes(nvme),
        "pinned_bytes": (max(v[1] for v in phases.values()) - start_lck) * 1024,
        "host_growth_bytes": (max(v[0] for v in phases.values()) - start_rss) * 1024,
        "phases_kib": phases,
        "swap_files": swap_files,
    }
    record_dsc = json.loads(json.dumps(dsc))
    for key in ("offload_param", "offload_optimizer"):
        record_dsc["zero_optimization"][key]["nvme_path"] = "NVME"
    run = {"name": args.preset or f"gpt2-{layers}x{hidden}", "deepspeed": deepspeed.__version__,
           "torch": torch.__version__, "transformers": transformers.__version__,
           "config": config, "ds_config": record_dsc, "seq_len": args.seq, "measured": measured}
    predicted = predict(args.memplan, config, record_dsc, args.seq)
    print_rows(f"{run['name']}: {params:,} parameters; DeepSpeed {deepspeed.__version__}, "
               f"torch {torch.__version__}", compare(measured, predicted))
    print(f"  memplan's full pinned column (a CUDA machine pins the gradient buffer too): "
          f"{predicted['pinned_column_bytes']:,}")
    print("  phases (VmRSS, VmLck KiB):", json.dumps(phases))
    if args.record:
        doc = {"about": "DeepSpeed ZeRO-3 NVMe offload measured on its CPU accelerator by "
                        "bench/deepspeed_nvme_truth.py (see its docstring); checked against "
                        "memplan by tests/deepspeed_nvme_truth_test", "runs": []}
        if os.path.exists(args.record):
            with open(args.record) as f:
                doc = json.load(f)
        doc["runs"] = [r for r in doc["runs"] if r["name"] != run["name"]] + [run]
        with open(args.record, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--memplan", default=os.path.join(ROOT, "build/tools/memplan"))
    ap.add_argument("--check", metavar="RECORDS", help="compare recorded runs with memplan")
    ap.add_argument("--preset", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--sub-group", type=int, default=100_000_000)
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--record", default=None, help="add the run to this records file")
    args = ap.parse_args()
    if args.check:
        return check(args.memplan, args.check)
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
