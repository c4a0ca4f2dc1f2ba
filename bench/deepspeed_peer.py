"""What bench/vs_deepspeed.py and bench/train_vs_deepspeed.py share: DeepSpeed's own ops, built
once, and the bookkeeping of interleaved, repeated measurements on a shared machine.

DeepSpeed's `async_io` and `cpu_adam` ops are JIT-compiled by DeepSpeed's op builders on first use
(CPU accelerator; needs torch's headers, which PyPI's torch ships, and libaio-dev, which
scripts/setup.sh installs) into TORCH_EXTENSIONS_DIR, by default build/torch_extensions: a few
minutes the first time, then a load. Import this module before torch or deepspeed: it sets the
CPU accelerator and the extensions directory when the environment does not.
"""
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, "build", "torch_extensions"))


def load_op(name):
    """DeepSpeed's op `name` ("async_io" or "cpu_adam"), building it when needed."""
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
    builder = {"async_io": AsyncIOBuilder, "cpu_adam": CPUAdamBuilder}[name]()
    start = time.perf_counter()
    print(f"deepspeed: loading the {name} op (TORCH_EXTENSIONS_DIR="
          f"{os.environ['TORCH_EXTENSIONS_DIR']}; the first build takes minutes)",
          file=sys.stderr, flush=True)
    op = builder.load(verbose=False)
    print(f"deepspeed: {name} ready after {time.perf_counter() - start:.1f} s", file=sys.stderr,
          flush=True)
    return op


def zero_infinity_config(nvme_path, largest, micro_batch, lr, weight_decay, overrides=None,
                         defaults=False):
    """DeepSpeed's ZeRO-Infinity configuration of the benches: ZeRO-3 with parameters and AdamW
    on NVMe under `nvme_path`, for a model whose largest parameter has `largest` elements.

    With `defaults`, only what a user must write (stage, devices, path; pinned buffers as
    DeepSpeed's own examples set them) and whatever DeepSpeed would refuse otherwise (a parameter
    buffer that holds the largest parameter); everything else is DeepSpeed's default. Without, the
    benches' settings: aio queue depth 16 (DeepSpeed's default is 8), the rest spelt out at
    DeepSpeed's default values. `overrides` (a dict) is merged into zero_optimization."""
    param = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True}
    if not defaults or largest > int(1e8):
        param.update(buffer_count=5, buffer_size=max(int(1e8), largest))
    config = {
        "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay,
                                                  "betas": [0.9, 0.999], "eps": 1e-8}},
        "zero_optimization": {
            "stage": 3, "offload_param": param,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True}},
        "steps_per_print": 1 << 30}
    if not defaults:
        config["aio"] = {"block_size": 1 << 20, "queue_depth": 16, "intra_op_parallelism": 1,
                         "single_submit": False, "overlap_events": True}
    config["zero_optimization"].update(overrides or {})
    return config


def single_rank_environment():
    """The environment of a one-process DeepSpeed job (gloo, world size 1), on a port of its own."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29500 + os.getpid() % 1000))


def load_average():
    """The 1-minute load average, the number the report quotes next to each figure."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def uptime_line():
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return f"load average {load_average():.2f}"


def median(values):
    return statistics.median(values) if values else float("nan")


def versions():
    import torch
    import deepspeed
    import memplan
    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "memplan": memplan.__version__, "python": sys.version.split()[0]}
