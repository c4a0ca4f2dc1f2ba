#!/usr/bin/env python3
"""Every file `memplan plan` emits, through the tool that consumes it, in today's versions.

    consumers_test.py --memplan BUILD/tools/memplan [--consumer all|deepspeed|accelerate|fsdp|trainer]

Runs in the modern environment (MEMPLAN_MODERN_PYTHON: PyPI torch 2, DeepSpeed 0.19,
Accelerate 1.x, Transformers 5). For each scenario below, every plan that fits (--plan-index
1..N) is emitted once with all emitters, and the consumer's own code loads it:

deepspeed   deepspeed.runtime.config.DeepSpeedConfig (pydantic models, batch arithmetic, removed
            keys), no warning while parsing, and the start-up asserts DeepSpeed makes in
            deepspeed.initialize() that need no GPU, restated from its source with the model's
            real tensor shapes (memplan inventory): partitioned_param_swapper.get_buffer (a swap
            buffer holds the largest parameter partition), optimizer_utils.
            _initialize_from_swapped_fp16_params (with parameters and optimizer on NVMe the
            parameter buffers hold the largest optimizer sub-group, as stage3._create_fp16_sub_groups
            forms them), partitioned_param_swapper.swap_in ('Not enough buffers': a parameter
            keeps its swap buffer while it stays gathered, and the coordinator keeps every
            parameter whose next use lies within stage3_max_reuse_distance elements of the trace;
            prefetching from NVMe only takes free buffers), aio (libaio io_setup needs a
            queue depth >= 1; O_DIRECT needs 4096-byte blocks), and pinned buffers within the
            pinned budget the plan assumed.
accelerate  the YAML through accelerate.commands.config.config_args.load_config_from_file, the
            launcher's _validate_launch_command and environment (prepare_deepspeed_cmd_env /
            prepare_multi_gpu_env), then the plugin the training script builds from that
            environment (DeepSpeedPlugin() or FullyShardedDataParallelPlugin()): where Accelerate
            refuses a DeepSpeed config file combined with accelerate-side settings.
fsdp        "accelerate": FullyShardedDataParallelPlugin(**args); "fully_shard": torch FSDP2's
            keyword names bound to torch.distributed.fsdp.fully_shard's signature, with
            MixedPrecisionPolicy and the offload policy built from them.
trainer     "training_arguments": transformers.TrainingArguments(**args).

Accelerate's FSDP plugin asks the CUDA runtime for the current device when sync_module_states is
on; this machine has no GPU, so the check stands in a device 0 (what every rank of a GPU job has).
Fails on any exception or refused check, listing each. Exit 77 (skip) when a consumer's package
is missing. One process for all consumers (the imports cost more than the checks).
"""
import argparse
import concurrent.futures
import contextlib
import io
import json
import logging
import math
import os
import subprocess
import sys
import tempfile

SCENARIOS = [
    ["--model", "llama-2-7b", "--gpu", "rtx4090", "--cpu-mem", "64GiB", "--nvme-path",
     "/local_nvme", "--nvme-capacity", "2TiB", "--global-batch", "16", "--seq-len", "2048"],
    ["--model", "llama-2-7b", "--gpu", "a100-80", "--gpus", "8", "--cpu-mem", "1TiB",
     "--nvme-path", "/local_nvme", "--nvme-capacity", "4TiB", "--global-batch", "64",
     "--seq-len", "2048"],
    ["--model", "llama-2-70b", "--gpu", "a100-80", "--gpus", "8", "--nodes", "2", "--cpu-mem",
     "1TiB", "--nvme-path", "/local_nvme", "--nvme-capacity", "8TiB", "--global-batch", "64",
     "--seq-len", "4096"],
    ["--model", "mixtral-8x7b", "--gpu", "rtx4090", "--cpu-mem", "128GiB", "--nvme-path",
     "/local_nvme", "--nvme-capacity", "4TiB", "--memlock", "64GiB", "--global-batch", "8",
     "--seq-len", "1024"],
    ["--model", "bert-large-uncased", "--gpu", "v100-16", "--gpus", "4", "--cpu-mem", "256GiB",
     "--global-batch", "256", "--seq-len", "512"],
    ["--model", "llama-2-7b", "--gpu", "h100-80", "--gpus", "8", "--nodes", "4",
     "--global-batch", "256", "--seq-len", "4096", "--optimizer", "lion"],
    ["--model", "llama-2-7b", "--gpu", "a100-40", "--cpu-mem", "128GiB", "--global-batch", "16",
     "--seq-len", "1024", "--lora-rank", "16"],
]


def flag(args, name, default):
    return args[args.index(name) + 1] if name in args else default


def world_size(args):
    return int(flag(args, "--gpus", 1)) * int(flag(args, "--nodes", 1))


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


class Emitted:
    """One plan's files."""

    def __init__(self, scenario, index, family, directory, ok, error):
        self.scenario, self.index, self.family = scenario, index, family
        self.directory, self.ok, self.error = directory, ok, error

    def path(self, name):
        return os.path.join(self.directory, name)

    def name(self):
        return f"{self.scenario[1]} x{world_size(self.scenario)} plan {self.index} ({self.family})"


def emit_one(memplan, scenario, index, d):
    """One plan's files: every emitter, the FSDP form of the Accelerate file, the Trainer form."""
    os.makedirs(d)
    files = ["--emit-deepspeed", os.path.join(d, "ds.json"), "--emit-accelerate",
             os.path.join(d, "accelerate.yaml"), "--emit-fsdp", os.path.join(d, "fsdp.json"),
             "--emit-trainer", os.path.join(d, "trainer.json")]
    r = run([memplan, "plan", *scenario, "--plan-index", str(index), *files])
    run([memplan, "plan", *scenario, "--plan-index", str(index), "--emit-accelerate",
         os.path.join(d, "accelerate_fsdp.yaml"), "--accelerate-plugin", "fsdp"])
    run([memplan, "plan", *scenario, "--plan-index", str(index), "--emit-deepspeed",
         os.path.join(d, "ds_hf.json"), "--for-hf-trainer"])
    return r


def emit_all(memplan, tmp):
    """Every plan of every scenario, each emitted once with all emitters (two at a time)."""
    out, jobs = [], []
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for n, scenario in enumerate(SCENARIOS):
            listing = run([memplan, "plan", *scenario, "--format", "json", "--top", "100"])
            if listing.returncode != 0:
                out.append(Emitted(scenario, 0, "?", tmp, False, listing.stderr.strip()))
                continue
            plans = json.loads(listing.stdout)["plans"]
            for index in range(1, len(plans) + 1):
                # " #" and ": " in the path: the YAML must quote it to keep it one string.
                d = os.path.join(tmp, f"s{n}p{index} #x: y")
                jobs.append((scenario, index, plans[index - 1]["family"], d,
                             pool.submit(emit_one, memplan, scenario, index, d)))
        for scenario, index, family, d, job in jobs:
            r = job.result()
            out.append(Emitted(scenario, index, family, d, r.returncode == 0, r.stderr.strip()))
    return out


# --- DeepSpeed ----------------------------------------------------------------------------------

class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def inventory(memplan, model, cache={}):
    if model not in cache:
        r = run([memplan, "inventory", "--model", model, "--format", "json"])
        cache[model] = json.loads(r.stdout)["tensors"]
    return cache[model]


def fill_auto(config, world, hidden=4096):
    """What the Hugging Face Trainer's HfTrainerDeepSpeedConfig does for the keys we emit."""
    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                node[k] = walk(v, path + [k])
        elif node == "auto":
            key = path[-1]
            return {"train_batch_size": 8 * world, "train_micro_batch_size_per_gpu": 8,
                    "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "enabled": True,
                    "lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                    "reduce_bucket_size": hidden * hidden,
                    "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                    "stage3_param_persistence_threshold": 10 * hidden}[key]
        return node
    return walk(config, [])


def startup_problems(config, tensors, world, gpus_per_node, pinned_budget):
    """DeepSpeed's start-up asserts that need no GPU, from its source (0.19)."""
    problems = []
    z = config.get("zero_optimization", {})
    aio = config.get("aio", {})
    block = aio.get("block_size", 1048576)
    depth = aio.get("queue_depth", 8)
    threads = aio.get("intra_op_parallelism", 1)
    if "aio" in config:
        if depth < 1:
            problems.append(f"aio.queue_depth {depth}: libaio's io_setup needs >= 1")
        if block < 4096 or block % 4096:
            problems.append(f"aio.block_size {block}: O_DIRECT needs a multiple of 4096")
        if threads < 1:
            # No I/O thread, and the swappers divide by their alignment (1024 x threads).
            problems.append(f"aio.intra_op_parallelism {threads} < 1")
            return problems
    op = z.get("offload_param") or {}
    oo = z.get("offload_optimizer") or {}
    if op.get("device") != "nvme" and oo.get("device") != "nvme":
        return problems
    threshold = z.get("stage3_param_persistence_threshold", 100000)
    # ds_tensor numel per rank: ceil(numel / world) (partition_parameters._partition_param).
    numels = [t["numel"] for t in tensors if not t["tied_to"]]
    parts = [math.ceil(n / world) for n in numels]
    elem = 2 if (config.get("bf16", {}).get("enabled") or config.get("fp16", {}).get("enabled")) else 4
    min_aio_bytes = max(1 << 20, block)
    align = 1024 * threads // elem  # partitioned_param_swapper: AIO_ALIGNED_BYTES x threads

    def aligned(n):
        return n + (align - n % align) % align
    pinned = 0
    if op.get("device") == "nvme":
        size = op.get("buffer_size", 100000000)
        count = op.get("buffer_count", 5)
        swappable = [p for n, p in zip(numels, parts) if n > threshold and p * elem >= min_aio_bytes]
        largest = max(swappable) if swappable else 0
        if largest > size:
            problems.append(f"offload_param.buffer_size {size} < the largest parameter partition "
                            f"{largest} (partitioned_param_swapper.get_buffer asserts)")
        # A gathered parameter keeps its swap buffer until it is released, and
        # partitioned_param_coordinator.__params_to_release keeps each parameter whose next use
        # lies within stage3_max_reuse_distance elements of the trace (counting every parameter
        # traversed); the current module's parameters are swapped in together on top.
        # __prefetch_nvme_param_partitions takes only free buffers. So the buffers held at once
        # are at most the swappable tensors of one reuse window plus one module's.
        reuse = z.get("stage3_max_reuse_distance", 1000000000)
        live = [t for t in tensors if not t["tied_to"]]
        flags = [t["numel"] > threshold and p * elem >= min_aio_bytes for t, p in zip(live, parts)]
        window, lo, span, held = 0, 0, 0, 0
        for hi, t in enumerate(live):
            span += t["numel"]
            window += flags[hi]
            while span > reuse and lo <= hi:
                span -= live[lo]["numel"]
                window -= flags[lo]
                lo += 1
            held = max(held, window)
        by_module = {}
        for t, f in zip(live, flags):
            if f:
                by_module[t["module"]] = by_module.get(t["module"], 0) + 1
        need = held + max(by_module.values() or [0])
        if count < need:
            problems.append(f"offload_param.buffer_count {count} < {need}: the swappable tensors "
                            f"of a {reuse}-element reuse window and one module stay gathered "
                            "(partitioned_param_swapper.swap_in: 'Not enough buffers')")
        pinned += count * aligned(size) * elem
        if oo.get("device") == "nvme":
            # stage3._create_fp16_sub_groups: partitions accumulate until sub_group_size.
            sub_group_size = z.get("sub_group_size", 1000000000)
            groups, current = [], 0
            for p in parts:
                current += p
                if current >= sub_group_size:
                    groups.append(current)
                    current = 0
            if current:
                groups.append(current)
            largest_group = aligned(max(groups))
            if aligned(size) < largest_group:
                problems.append(
                    f"offload_param.buffer_size {size} < the largest optimizer sub-group "
                    f"{largest_group} (optimizer_utils._initialize_from_swapped_fp16_params: "
                    "'numel of fp16 buffers ... is too small for initializing fp32 params')")
    if oo.get("device") == "nvme":
        if oo.get("buffer_count", 4) < 1:
            problems.append("offload_optimizer.buffer_count 0: no swap buffer to read a sub-group "
                            "into (partitioned_optimizer_swapper asserts pinned_buffers)")
        sub_group_size = z.get("sub_group_size", 1000000000)
        total = sum(parts)
        pinned += oo.get("buffer_count", 4) * aligned(min(sub_group_size + max(parts), total)) * 4
    if pinned_budget and pinned > pinned_budget:
        problems.append(f"{pinned / 2**30:.1f} GiB of pinned swap buffers per process beyond the "
                        f"{pinned_budget / 2**30:.1f} GiB budget")
    return problems


def check_deepspeed(memplan, emitted):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        import deepspeed.comm as ds_comm
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.runtime import constants as ds_constants
        from deepspeed.runtime.swap_tensor import constants as aio_constants
    except Exception as e:  # noqa: BLE001
        print(f"skipped: cannot import deepspeed: {e!r}")
        return None
    print(f"deepspeed {deepspeed.__version__}")
    top_level = {v for k, v in vars(ds_constants).items() if k.isupper() and isinstance(v, str)}
    top_level |= {"zero_optimization", "aio", "activation_checkpointing", "optimizer", "bf16",
                  "fp16", "zero_allow_untested_optimizer"}
    aio_keys = {v for k, v in vars(aio_constants).items()
                if k.startswith("AIO_") and not k.endswith("_DEFAULT") and isinstance(v, str)
                and k != "AIO_FORMAT"}
    capture = Capture()
    logging.getLogger("DeepSpeed").addHandler(capture)
    results = []
    for e in emitted:
        world = world_size(e.scenario)
        ds_comm.get_rank = lambda *a, **k: 0
        ds_comm.get_world_size = lambda *a, _w=world, **k: _w
        for name in ("ds.json", "ds_hf.json"):
            problems = []
            if not os.path.exists(e.path(name)):
                # DeepSpeed cannot shard within a node since it removed MiCS: the CLI declines.
                if "hybrid" not in e.family:
                    results.append((e.name() + f" {name}", ["not written"]))
                continue
            with open(e.path(name)) as f:
                config = json.load(f)
            if name == "ds_hf.json":
                config = fill_auto(config, world)
            problems += [f"top-level key '{k}' unknown to DeepSpeed" for k in config
                         if k not in top_level]
            problems += [f"aio key '{k}' unknown to DeepSpeed" for k in config.get("aio", {})
                         if k not in aio_keys]
            capture.records.clear()
            try:
                parsed = DeepSpeedConfig(config)
                if parsed.zero_optimization_stage != config["zero_optimization"]["stage"]:
                    problems.append("stage not read back")
                if parsed.train_batch_size != config["train_batch_size"]:
                    problems.append("train_batch_size not read back")
            except Exception as ex:  # noqa: BLE001
                problems.append(f"{type(ex).__name__}: {ex}")
            problems += [f"warning: {w}" for w in capture.records]
            if name == "ds.json":
                memlock = flag(e.scenario, "--memlock", None)
                budget = None
                if memlock:
                    budget = int(memlock[:-3]) << 30
                problems += startup_problems(config, inventory(memplan, e.scenario[1]), world,
                                             int(flag(e.scenario, "--gpus", 1)), budget)
                # memplan's own checker must pass what memplan emits (it restates the same asserts
                # and predicts the fit), where the file says all the fit depends on: not for LoRA
                # or 8-bit AdamW, which live in the training script, not the DeepSpeed file.
                cluster = [a for n in ("--model", "--gpu", "--gpus", "--nodes", "--cpu-mem",
                                       "--memlock", "--seq-len")
                           if n in e.scenario for a in (n, flag(e.scenario, n, None))]
                script_only = "--lora-rank" in e.scenario or "8-bit" in e.family
                r = run([memplan, "check", e.path(name), *cluster])
                if r.returncode != 0 and not script_only:
                    problems.append("memplan check: " + (r.stdout + r.stderr).strip())
            results.append((e.name() + f" {name}", problems))
    return results


# --- Accelerate ---------------------------------------------------------------------------------

@contextlib.contextmanager
def gpu_rank():
    """CUDA device 0, for the plugin code that asks for the current device (see the top)."""
    import torch
    import accelerate.utils.dataclasses as dataclasses
    saved = dataclasses.is_cuda_available, torch.cuda.current_device
    dataclasses.is_cuda_available = lambda: True
    torch.cuda.current_device = lambda: 0
    try:
        yield
    finally:
        dataclasses.is_cuda_available, torch.cuda.current_device = saved


def plan_strategy(e):
    """The FSDP sharding strategy of `e`'s plan, from its fsdp.json; None without one."""
    path = e.path("fsdp.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["sharding_strategy"]


def check_accelerate(emitted):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import accelerate
        from accelerate.commands.config.config_args import load_config_from_file
        from accelerate.commands.launch import launch_command_parser, _validate_launch_command
        from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
        from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    except Exception as e:  # noqa: BLE001
        print(f"skipped: cannot import accelerate: {e!r}")
        return None
    print(f"accelerate {accelerate.__version__}")
    results = []
    saved = dict(os.environ)
    for e in emitted:
        for name in ("accelerate.yaml", "accelerate_fsdp.yaml"):
            path = e.path(name)
            if not os.path.exists(path):
                # Not applicable, and the CLI said so: FSDP cannot offload to NVMe, DeepSpeed
                # cannot shard within a node.
                expected = "NVMe" in e.family if name == "accelerate_fsdp.yaml" else "hybrid" in e.family
                if not expected:
                    results.append((e.name() + f" {name}", ["not written"]))
                continue
            problems = []
            try:
                load_config_from_file(path)
                args = launch_command_parser().parse_args(["--config_file", path, "train.py"])
                with contextlib.redirect_stdout(io.StringIO()), \
                        contextlib.redirect_stderr(io.StringIO()):
                    args, defaults, mp_from_config = _validate_launch_command(args)
                if args.use_deepspeed:
                    fields = list(defaults.deepspeed_config.keys()) if defaults else []
                    if mp_from_config:
                        fields.append("mixed_precision")
                    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
                    _, env = prepare_deepspeed_cmd_env(args)
                elif args.use_fsdp:
                    env = prepare_multi_gpu_env(args)
                else:
                    env = prepare_multi_gpu_env(args)
                os.environ.update({k: v for k, v in env.items()
                                   if k.startswith(("ACCELERATE_", "FSDP_"))})
                if args.use_deepspeed:
                    DeepSpeedPlugin()
                elif args.use_fsdp:
                    with gpu_rank():
                        plugin = FullyShardedDataParallelPlugin()
                    # The strategy the plan's FSDP arguments name is the one Accelerate runs
                    # (a strategy written as fsdp_reshard_after_forward alone ran FULL_SHARD).
                    got = plugin.sharding_strategy or plugin.reshard_after_forward
                    want = plan_strategy(e)
                    if want and getattr(got, "name", got) != want:
                        problems.append(f"accelerate launch runs {got}, the plan {want}")
                else:
                    problems.append(f"distributed_type is neither DEEPSPEED nor FSDP")
            except Exception as ex:  # noqa: BLE001
                problems.append(f"{type(ex).__name__}: {str(ex).splitlines()[0]}")
            finally:
                os.environ.clear()
                os.environ.update(saved)
            results.append((e.name() + f" {name}", problems))
    return results


# --- FSDP ---------------------------------------------------------------------------------------

def check_fsdp(emitted):
    try:
        import inspect
        import torch
        from torch.distributed.fsdp import (fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy,
                                            OffloadPolicy)
        from accelerate.utils import FullyShardedDataParallelPlugin
    except Exception as e:  # noqa: BLE001
        print(f"skipped: cannot import torch FSDP2 / accelerate: {e!r}")
        return None
    print(f"torch {torch.__version__}")
    signature = inspect.signature(fully_shard)
    results = []
    for e in emitted:
        path = e.path("fsdp.json")
        if not os.path.exists(path):
            if "NVMe" not in e.family:
                results.append((e.name() + " fsdp.json", ["not written"]))
            continue
        problems = []
        with open(path) as f:
            j = json.load(f)
        try:
            with gpu_rank():
                plugin = FullyShardedDataParallelPlugin(**j["accelerate"])
            # The strategy FSDP1 gets (the Accelerator passes sharding_strategy or
            # reshard_after_forward) must be the plan's.
            got = plugin.sharding_strategy or plugin.reshard_after_forward
            if getattr(got, "name", got) != j["sharding_strategy"]:
                problems.append(f"Accelerate runs {got}, the plan {j['sharding_strategy']}")
        except Exception as ex:  # noqa: BLE001
            problems.append(f"FullyShardedDataParallelPlugin: {type(ex).__name__}: {ex}")
        try:
            kwargs = dict(j["fully_shard"])
            mp = kwargs.pop("mp_policy")
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                **{k: getattr(torch, v) for k, v in mp.items()})
            kwargs["offload_policy"] = {"CPUOffloadPolicy": CPUOffloadPolicy,
                                        "OffloadPolicy": OffloadPolicy}[kwargs["offload_policy"]]()
            if "mesh" in kwargs:
                kwargs["mesh"] = None  # a DeviceMesh needs a process group; its shape is checked
                shape = j["fully_shard"]["mesh"]["shape"]
                if shape[0] * shape[1] != world_size(e.scenario):
                    problems.append(f"mesh {shape} does not cover the {world_size(e.scenario)} GPUs")
            if "hybrid" in e.family:
                nodes, gpus = int(flag(e.scenario, "--nodes", 1)), int(flag(e.scenario, "--gpus", 1))
                if j["accelerate"]["sharding_strategy"] != "HYBRID_SHARD" or \
                        j["fully_shard"]["mesh"]["shape"] != [nodes, gpus]:
                    problems.append("a hybrid plan is not HYBRID_SHARD over (nodes, GPUs per node)")
            signature.bind(torch.nn.Linear(2, 2), **kwargs)
        except Exception as ex:  # noqa: BLE001
            problems.append(f"fully_shard: {type(ex).__name__}: {ex}")
        results.append((e.name() + " fsdp.json", problems))
    return results


# --- Trainer ------------------------------------------------------------------------------------

def check_trainer(emitted):
    try:
        import transformers
        from transformers import TrainingArguments
    except Exception as e:  # noqa: BLE001
        print(f"skipped: cannot import transformers: {e!r}")
        return None
    print(f"transformers {transformers.__version__}")
    results = []
    with tempfile.TemporaryDirectory() as out:
        for e in emitted:
            problems = []
            with open(e.path("trainer.json")) as f:
                j = json.load(f)
            args = dict(j["training_arguments"])
            args.pop("deepspeed", None)  # needs an initialised accelerator; DeepSpeed is checked
            # A CPU-only machine: precision flags are checked for their names, not the hardware.
            bf16, fp16 = args.pop("bf16", False), args.pop("fp16", False)
            try:
                TrainingArguments(output_dir=out, use_cpu=True, **args)
                if not isinstance(bf16, bool) or not isinstance(fp16, bool):
                    problems.append("bf16 / fp16 must be booleans")
            except Exception as ex:  # noqa: BLE001
                problems.append(f"TrainingArguments: {type(ex).__name__}: {ex}")
            if j["model"]["attn_implementation"] not in ("sdpa", "eager", "flash_attention_2"):
                problems.append(f"attn_implementation {j['model']['attn_implementation']}")
            results.append((e.name() + " trainer.json", problems))
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--memplan", required=True)
    parser.add_argument("--consumer", default="all",
                        choices=["all", "deepspeed", "accelerate", "fsdp", "trainer"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        emitted = emit_all(args.memplan, tmp)
        failures = [e for e in emitted if not e.ok]
        for e in failures:
            print(f"FAIL {e.name()}: emit: {e.error}")
        ok = [e for e in emitted if e.ok]
        checks = {"deepspeed": lambda: check_deepspeed(args.memplan, ok),
                  "accelerate": lambda: check_accelerate(ok),
                  "fsdp": lambda: check_fsdp(ok),
                  "trainer": lambda: check_trainer(ok)}
        names = list(checks) if args.consumer == "all" else [args.consumer]
        results, skipped = [], []
        for name in names:
            r = checks[name]()
            if r is None:
                skipped.append(name)
            else:
                results += r
        if skipped and not results:
            return 77
        bad = 0
        for name, problems in results:
            if problems:
                bad += 1
                print(f"FAIL {name}: " + "; ".join(problems))
        print(f"{len(emitted)} plans emitted; {len(results) - bad} files passed, "
              f"{bad + len(failures)} failed" + (f"; skipped: {skipped}" if skipped else ""))
        return 1 if bad or failures or skipped or not results else 0


if __name__ == "__main__":
    sys.exit(main())
