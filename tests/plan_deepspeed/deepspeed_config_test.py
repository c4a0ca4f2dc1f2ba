#!/usr/bin/env python3
"""Loads every DeepSpeed config `memplan plan --emit-deepspeed` writes with DeepSpeed's own parser.

For each scenario below, every plan that fits (--plan-index 1..N) is emitted and handed to
deepspeed.runtime.config.DeepSpeedConfig, the class deepspeed.initialize() builds from a config:
it runs the batch arithmetic, the pydantic models of zero_optimization and the offload blocks
(which refuse unknown keys), the precision and activation checkpointing sections. The test fails
on any exception, on any warning DeepSpeed logs while parsing, on a top-level key DeepSpeed does
not define, and on an aio key DeepSpeed does not read. Also checked: the Hugging Face Trainer form
(--for-hf-trainer) loads once "auto" values are filled the way the Trainer fills them.

DeepSpeed reads the world size from torch.distributed; no process group exists here, so the
parser is given the scenario's GPU count through deepspeed.comm's get_world_size.

Usage: deepspeed_config_test.py --memplan BUILD/tools/memplan
"""
import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile

# The Trainer's "auto" filling, the DeepSpeed log capture and the world size are the ones the
# modern-environment test uses on the same configs (tests/plan_consumers/consumers_test.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "plan_consumers"))
from consumers_test import Capture, fill_auto, world_size  # noqa: E402

SCENARIOS = [
    ["--model", "llama-2-7b", "--gpu", "rtx4090", "--cpu-mem", "64GiB", "--nvme-path",
     "/local_nvme", "--nvme-capacity", "2TiB", "--global-batch", "16", "--seq-len", "2048"],
    ["--model", "llama-2-7b", "--gpu", "a100-80", "--gpus", "8", "--cpu-mem", "1TiB",
     "--nvme-path", "/local_nvme", "--nvme-capacity", "4TiB", "--global-batch", "64",
     "--seq-len", "2048"],
    ["--model", "llama-2-70b", "--gpu", "a100-80", "--gpus", "8", "--cpu-mem", "1TiB",
     "--nvme-path", "/local_nvme", "--nvme-capacity", "8TiB", "--global-batch", "64",
     "--seq-len", "4096"],
    ["--model", "bert-large-uncased", "--gpu", "v100-16", "--gpus", "4", "--cpu-mem", "256GiB",
     "--global-batch", "256", "--seq-len", "512"],
    ["--model", "llama-2-7b", "--gpu", "h100-80", "--gpus", "8", "--nodes", "2",
     "--global-batch", "128", "--seq-len", "4096", "--optimizer", "lion"],
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--memplan", required=True)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        import deepspeed.comm as ds_comm
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.runtime import constants as ds_constants
        from deepspeed.runtime.swap_tensor import constants as aio_constants
    except Exception as e:  # noqa: BLE001
        print(f"cannot import deepspeed: {e!r}", file=sys.stderr)
        return 1
    top_level = {v for k, v in vars(ds_constants).items() if k.isupper() and isinstance(v, str)}
    top_level |= {"zero_optimization", "aio", "activation_checkpointing", "optimizer", "bf16",
                  "fp16", "zero_allow_untested_optimizer"}
    aio_keys = {v for k, v in vars(aio_constants).items()
                if k.startswith("AIO_") and not k.endswith("_DEFAULT") and isinstance(v, str)
                and k != "AIO_FORMAT"}
    capture = Capture()
    logging.getLogger("DeepSpeed").addHandler(capture)
    print(f"deepspeed {deepspeed.__version__}")

    failures = 0
    loaded = 0
    with tempfile.TemporaryDirectory() as tmp:
        for n, scenario in enumerate(SCENARIOS):
            world = world_size(scenario)
            ds_comm.get_rank = lambda *a, **k: 0
            ds_comm.get_world_size = lambda *a, _w=world, **k: _w
            listing = subprocess.run([args.memplan, "plan", *scenario, "--format", "json",
                                      "--top", "100"], capture_output=True, text=True)
            if listing.returncode != 0:
                print(f"FAIL plan {' '.join(scenario)}: {listing.stderr.strip()}")
                failures += 1
                continue
            plans = json.loads(listing.stdout)["plans"]
            for index in range(1, len(plans) + 1):
                for hf in (False, True):
                    path = os.path.join(tmp, f"ds_{n}_{index}_{int(hf)}.json")
                    cmd = [args.memplan, "plan", *scenario, "--plan-index", str(index),
                           "--emit-deepspeed", path] + (["--for-hf-trainer"] if hf else [])
                    run = subprocess.run(cmd, capture_output=True, text=True)
                    name = f"{scenario[1]} x{world} plan {index} ({plans[index - 1]['family']})" + \
                        (" hf" if hf else "")
                    if run.returncode != 0:
                        print(f"FAIL {name}: emit: {run.stderr.strip()}")
                        failures += 1
                        continue
                    if not os.path.exists(path):
                        # DeepSpeed removed MiCS (0.19): hybrid plans are FSDP's only, and the
                        # CLI says why it wrote no DeepSpeed file.
                        if "hybrid" in plans[index - 1]["family"] and "not written" in run.stdout:
                            print(f"ok   {name}: not written (hybrid sharding)")
                        else:
                            print(f"FAIL {name}: not written: {run.stdout.strip()}")
                            failures += 1
                        continue
                    with open(path) as f:
                        config = json.load(f)
                    if hf:
                        config = fill_auto(config, world)
                    problems = [f"top-level key '{k}' unknown to DeepSpeed" for k in config
                                if k not in top_level]
                    problems += [f"aio key '{k}' unknown to DeepSpeed" for k in
                                 config.get("aio", {}) if k not in aio_keys]
                    capture.records.clear()
                    try:
                        parsed = DeepSpeedConfig(config)
                        if parsed.zero_optimization_stage != config["zero_optimization"]["stage"]:
                            problems.append("stage not read back")
                        if parsed.train_batch_size != config["train_batch_size"]:
                            problems.append("train_batch_size not read back")
                    except Exception as e:  # noqa: BLE001
                        problems.append(f"{type(e).__name__}: {e}")
                    problems += [f"warning: {w}" for w in capture.records]
                    loaded += 1
                    if problems:
                        failures += 1
                        print(f"FAIL {name}: " + "; ".join(problems))
                    else:
                        print(f"ok   {name}")
    print(f"{loaded - failures} passed, {failures} failed")
    return 1 if failures or loaded == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
