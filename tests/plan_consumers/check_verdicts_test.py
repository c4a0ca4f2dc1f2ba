#!/usr/bin/env python3
"""`memplan check` agrees with DeepSpeed on the values DeepSpeed refuses or breaks on at start-up.

    check_verdicts_test.py --memplan BUILD/tools/memplan

Runs in the modern environment (MEMPLAN_MODERN_PYTHON, DeepSpeed 0.19). A ZeRO-3 config with
parameters and optimizer on NVMe for Llama-2-7B on 8 GPUs, which both accept, is changed one value
at a time (negative buckets and thresholds, reduce_bucket_size 0, non-integers, aio queue_depth 0,
blocks not a multiple of 4096, too few or too small swap buffers, a sub_group_size too large for
the swap buffers, an offload ratio outside [0, 1], keys DeepSpeed 0.19 removed or added, comments,
and values both accept). DeepSpeed's verdict is
its own: deepspeed.runtime.config.DeepSpeedConfig (the pydantic models) and the start-up asserts
that need no GPU, restated from its source in consumers_test.startup_problems with the model's
real tensor shapes. memplan's verdict is `memplan check --format json`'s "ok". They must agree on
every case; a refused case must also name the key that was changed (as the finding's path or
among its "keys"), and enough
cases must be refused that the test can fail. Exit 77 (skip) without DeepSpeed.
"""
import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import consumers_test  # noqa: E402  (the start-up asserts, the inventory)

MODEL, GPU, GPUS = "llama-2-7b", "a100-80", 8

BASE = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "sub_group_size": 100000000,
        "stage3_max_reuse_distance": 0,
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 5,
                          "buffer_size": 200000000},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4},
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
            "single_submit": False, "overlap_events": True},
}

Z, OP, OO = "zero_optimization", "zero_optimization.offload_param", \
    "zero_optimization.offload_optimizer"
CASES = [
    (f"{Z}.reduce_bucket_size", -1), (f"{Z}.reduce_bucket_size", 0),
    (f"{Z}.reduce_bucket_size", 5e8), (f"{Z}.reduce_bucket_size", 5.5),
    (f"{Z}.allgather_bucket_size", -1), (f"{Z}.allgather_bucket_size", 0),
    (f"{Z}.stage3_prefetch_bucket_size", -5), (f"{Z}.stage3_param_persistence_threshold", -1),
    (f"{Z}.stage3_max_live_parameters", -1), (f"{Z}.stage3_max_reuse_distance", -1),
    (f"{Z}.stage3_model_persistence_threshold", -1), (f"{Z}.zero_hpz_partition_size", -1),
    (f"{Z}.sub_group_size", -1), (f"{Z}.sub_group_size", 2000000000),
    (f"{Z}.sub_group_size", 50000000),
    (f"{OP}.buffer_count", -1), (f"{OP}.buffer_count", 0), (f"{OP}.buffer_size", -1),
    (f"{OP}.buffer_size", 1000000), (f"{OP}.buffer_size", 0), (f"{OP}.max_in_cpu", -1),
    (f"{OP}.buffer_count", 8),
    (f"{OO}.buffer_count", -1), (f"{OO}.buffer_count", 0), (f"{OO}.ratio", 1.5),
    (f"{OO}.ratio", -0.1), (f"{OO}.ratio", 0.5),
    ("aio.queue_depth", 0), ("aio.queue_depth", -1), ("aio.queue_depth", 32),
    ("aio.block_size", 1000), ("aio.block_size", 0), ("aio.block_size", 6144),
    ("aio.block_size", 8192), ("aio.intra_op_parallelism", 0), ("aio.intra_op_parallelism", 2),
    # Keys (Note [DeepSpeed's keys] in planner/check.cc): a top-level comment, which DeepSpeed
    # ignores, and one in a pydantic section, which it refuses; keys only 0.19 reads; keys 0.19
    # removed and refuses; 16-bit master weights.
    ("_comment", "supported models: ..."), (f"{Z}._comment", "x"), ("bf16.junk", 1),
    ("tensor_parallel", {"autotp_size": 2}), ("comms_logger", {"enabled": False}),
    ("gradient_allreduce_op", "mean"), (f"{OO}.super_offload", False),
    ("elasticity", {"enabled": False}), ("amp", {"enabled": False}), ("sparse_gradients", False),
    ("curriculum_learning", {"enabled": False}), (f"{Z}.mics_shard_size", 8),
    (f"{Z}.zeropp_loco_param", {"err_beta": 0.8, "reset_T": 1024}),
    ("bf16.bf16_master_weights_and_grads", True), ("bf16.bf16_optimizer_states", True),
    # The batch's data-parallel world (Note [The data-parallel world of the batch]): Ulysses'
    # sequence_parallel_size divides it, AutoTP does not; a change of several keys is
    # "a+b" = [value of a, value of b].
    ("sequence_parallel_size", 2), ("sequence_parallel_size", 3),
    ("sequence_parallel_size+train_batch_size", [2, 4]),
    ("sequence_parallel_size+train_batch_size", [8, 1]),
    ("tensor_parallel+train_batch_size", [{"autotp_size": 2}, 4]),
]


def changed(paths, values):
    config = copy.deepcopy(BASE)
    if "+" not in paths:
        values = [values]
    for path, value in zip(paths.split("+"), values):
        node = config
        *parents, key = path.split(".")
        for p in parents:
            node = node[p]
        node[key] = value
    return config


def deepspeed_verdict(config, tensors):
    """DeepSpeed's problems with `config`: its config classes, then its start-up asserts."""
    from deepspeed.runtime.config import DeepSpeedConfig
    problems = []
    try:
        DeepSpeedConfig(copy.deepcopy(config))
    except Exception as e:  # noqa: BLE001
        problems.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
    if not problems:
        problems += consumers_test.startup_problems(config, tensors, GPUS, GPUS, None)
    return problems


def memplan_verdict(memplan, config, tmp):
    path = os.path.join(tmp, "ds.json")
    with open(path, "w") as f:
        json.dump(config, f)
    r = subprocess.run([memplan, "check", path, "--model", MODEL, "--gpu", GPU, "--gpus",
                        str(GPUS), "--format", "json"], capture_output=True, text=True)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"memplan check exited {r.returncode}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--memplan", required=True)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed.comm as ds_comm
    except Exception as e:  # noqa: BLE001
        print(f"skipped: cannot import deepspeed: {e!r}")
        return 77
    ds_comm.get_rank = lambda *a, **k: 0
    ds_comm.get_world_size = lambda *a, **k: GPUS
    tensors = consumers_test.inventory(args.memplan, MODEL)
    bad, refused = 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for path, value in [("", None)] + CASES:
            config = changed(path, value) if path else BASE
            ds = deepspeed_verdict(config, tensors)
            mp = memplan_verdict(args.memplan, config, tmp)
            paths = [p["path"] for p in mp["problems"]]
            keys = paths + [k for p in mp["problems"] for k in p.get("keys", [])]
            name = f"{path or 'base'} = {json.dumps(value)}"
            ok = (not ds) == mp["ok"] and (not ds or any(p in keys for p in path.split("+")))
            refused += bool(ds)
            if not path and ds:
                ok = False  # the base config must be one DeepSpeed accepts
            print(("ok   " if ok else "FAIL ") + f"{name}: DeepSpeed "
                  + ("refuses (" + "; ".join(ds) + ")" if ds else "accepts")
                  + ", memplan " + ("accepts" if mp["ok"] else "refuses " + ", ".join(paths)))
            bad += not ok
    print(f"{len(CASES) + 1} configs, {refused} refused by DeepSpeed, {bad} disagreements")
    return 1 if bad or refused < 20 else 0


if __name__ == "__main__":
    sys.exit(main())
