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
