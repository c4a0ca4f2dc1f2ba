#!/usr/bin/env python3
"""`memplan check` agrees with Accelerate on the Accelerate config files it refuses.

    accelerate_verdicts_test.py --memplan BUILD/tools/memplan

Runs in the modern environment (MEMPLAN_MODERN_PYTHON, Accelerate 1.x). Two configs both accept,
one FSDP and one DeepSpeed for 8 GPUs, are changed one value at a time. Accelerate's verdict is
its own code, the path `accelerate launch` and then each rank take: the loader
(load_config_from_file), the launcher (_validate_launch_command and the environment it exports),
then the plugin the script builds from that environment (FullyShardedDataParallelPlugin() or
DeepSpeedPlugin()). memplan's verdict is `memplan check --format json`'s "ok".

A case Accelerate refuses must be refused by memplan, naming the changed key (as the finding's
path or among its "keys"); a case both should accept must be accepted. The rest are what
Accelerate takes without a word but does not do (marked SILENT): memplan must refuse them, and
the test shows the silence in Accelerate's own state: the key reaches no environment variable, or
the plugin ends with a strategy other than the one written. Exit 77 (skip) without Accelerate.
"""
import argparse
import contextlib
import copy
import io
import json
import logging
import os
import subprocess
import sys
import tempfile

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from consumers_test import gpu_rank  # noqa: E402  (a CUDA device 0 for the FSDP plugin)

GPUS = 8

FSDP = {
    "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "FSDP",
    "downcast_bf16": "no", "machine_rank": 0, "main_training_function": "main",
    "mixed_precision": "bf16", "num_machines": 1, "num_processes": GPUS, "rdzv_backend": "static",
    "same_network": True, "use_cpu": False,
    "fsdp_config": {
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_offload_params": False, "fsdp_sharding_strategy": "SHARD_GRAD_OP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_sync_module_states": True,
        "fsdp_use_orig_params": True, "fsdp_version": 1,
        "fsdp_activation_checkpointing": False,
    },
}
DEEPSPEED = {
    "compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
    "mixed_precision": "bf16", "num_machines": 1, "num_processes": GPUS,
    "deepspeed_config": {"zero_stage": 3, "offload_optimizer_device": "cpu",
                         "offload_param_device": "none", "gradient_accumulation_steps": 4,
                         "gradient_clipping": 1.0, "zero3_init_flag": True},
}
V2 = {"fsdp_config.fsdp_version": 2, "fsdp_config.fsdp_sharding_strategy": None,
      "fsdp_config.fsdp_reshard_after_forward": True, "fsdp_config.fsdp_use_orig_params": None,
      "fsdp_config.fsdp_sync_module_states": None}
F = "fsdp_config."
D = "deepspeed_config."
# (base, {dotted key: value, None deletes, "@null" is null}, expected: "refuse" | "accept" |
# "silent")
CASES = [
    (FSDP, {"learning_rate": 1e-4}, "refuse"),
    (FSDP, {"ipex_config": {"ipex": True}}, "refuse"),
    (FSDP, {"distributed_type": "multi_gpu"}, "refuse"),
    (FSDP, {"mixed_precision": False}, "refuse"),  # an unquoted `no`
    (FSDP, {"mixed_precision": "bfloat16"}, "refuse"),
    (FSDP, {"mixed_precision": "BF16"}, "accept"),
    (FSDP, {"mixed_precision": "@null", "dynamo_config": {"dynamo_backend": "NO"}}, "accept"),
    (FSDP, {"num_processes": None}, "refuse"),
    (FSDP, {"dynamo_config": {"dynamo_backend": "INDUCTR"}}, "refuse"),
    (FSDP, {"dynamo_config": {"dynamo_backend": False}}, "refuse"),
    (FSDP, {"dynamo_config": {"dynamo_backend": "inductor"}}, "accept"),
    (FSDP, {F + "fsdp_version": 3}, "refuse"),
    (FSDP, {F + "fsdp_sharding_strategy": "FULL"}, "refuse"),
    (FSDP, {F + "fsdp_sharding_strategy": 3}, "accept"),
    (FSDP, {F + "sharding_strategy": "NO_SHARD", F + "fsdp_sharding_strategy": None}, "accept"),
    (FSDP, {F + "fsdp_backward_prefetch": "PRE"}, "refuse"),
    (FSDP, {F + "fsdp_state_dict_type": "FULL"}, "refuse"),
    (FSDP, {F + "fsdp_auto_wrap_policy": "LAYER_WRAP"}, "refuse"),
    (FSDP, {F + "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", F + "fsdp_min_num_params": "1e8"},
     "refuse"),
    (FSDP, {F + "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", F + "fsdp_min_num_params": 100000000},
     "accept"),
    (FSDP, {F + "fsdp_offload_params": "maybe"}, "refuse"),
    (FSDP, {F + "fsdp_offload_params": "yes"}, "accept"),
    (FSDP, {F + "fsdp_sync_module_states": False}, "refuse"),
    (FSDP, {F + "fsdp_sync_module_states": False, F + "fsdp_cpu_ram_efficient_loading": False},
     "accept"),
    (FSDP, {F + "fsdp_activation_checkpointing_offload": True}, "refuse"),
    (FSDP, {**V2}, "accept"),
    (FSDP, {**V2, F + "fsdp_reshard_after_forward": "FULL_SHARD"}, "refuse"),
    (FSDP, {**V2, F + "fsdp_state_dict_type": "LOCAL_STATE_DICT"}, "refuse"),
    (FSDP, {**V2, F + "fsdp_activation_checkpointing": True,
            F + "fsdp_activation_checkpointing_offload": True}, "accept"),
    # Taken without a word, not done.
    (FSDP, {F + "fsdp_sharding_strategy": None, F + "fsdp_reshard_after_forward": "SHARD_GRAD_OP"},
     "silent"),
    (FSDP, {**V2, F + "fsdp_sharding_strategy": "SHARD_GRAD_OP"}, "silent"),
    (FSDP, {F + "fsdp_activaton_checkpointing": True}, "silent"),
    (FSDP, {F + "fsdp_auto_wrap_policy": None}, "silent"),
    (FSDP, {**V2, "num_processes": 2, "parallelism_config": {"dp_shard_size": 2}}, "silent"),
    (DEEPSPEED, {}, "accept"),
    (DEEPSPEED, {"mixed_precision": None, D + "deepspeed_config_file": "@ds",
                 D + "zero_stage": None, D + "offload_optimizer_device": None,
                 D + "offload_param_device": None, D + "gradient_accumulation_steps": None,
                 D + "gradient_clipping": None}, "accept"),
    (DEEPSPEED, {"mixed_precision": None, D + "deepspeed_config_file": "@ds",
                 D + "offload_optimizer_device": None, D + "offload_param_device": None,
                 D + "gradient_accumulation_steps": None, D + "gradient_clipping": None},
     "refuse"),  # zero_stage beside the file
    (DEEPSPEED, {D + "deepspeed_config_file": "@ds", D + "zero_stage": None,
                 D + "offload_optimizer_device": None, D + "offload_param_device": None,
                 D + "gradient_accumulation_steps": None, D + "gradient_clipping": None},
     "refuse"),  # mixed_precision beside the file
    (DEEPSPEED, {D + "zero_stgae": 2}, "silent"),
]

DS_FILE = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}


def changed(base, changes, ds_file):
    config = copy.deepcopy(base)
    for dotted, value in changes.items():
        node = config
        *parents, key = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(key, None)
        else:  # "@ds": the DeepSpeed config file's path; "@null": YAML's null
            node[key] = ds_file if value == "@ds" else None if value == "@null" else value
    return config


def accelerate_verdict(path):
    """(problems, plugin, env): Accelerate's errors loading, launching and building the plugin."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser, _validate_launch_command
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    saved = dict(os.environ)
    plugin, env = None, {}
    try:
        load_config_from_file(path)
        args = launch_command_parser().parse_args(["--config_file", path, "train.py"])
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args, defaults, mp_from_config = _validate_launch_command(args)
            if args.use_deepspeed:
                fields = list(defaults.deepspeed_config.keys()) if defaults else []
                if mp_from_config:
                    fields.append("mixed_precision")
                args.deepspeed_fields_from_accelerate_config = ",".join(fields)
                _, env = prepare_deepspeed_cmd_env(args)
            else:
                env = prepare_multi_gpu_env(args)
            os.environ.update({k: v for k, v in env.items()
                               if k.startswith(("ACCELERATE_", "FSDP_"))})
            if args.use_deepspeed:
                plugin = DeepSpeedPlugin()
            elif args.use_fsdp:
                with gpu_rank():
                    plugin = FullyShardedDataParallelPlugin()
        return [], plugin, env
    except Exception as e:  # noqa: BLE001
        return [f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"], plugin, env
    finally:
        os.environ.clear()
        os.environ.update(saved)


def silence_shown(changes, plugin, env):
    """Accelerate's own state shows it did not do what the changed key asks."""
    for dotted, value in changes.items():
        key = dotted.split(".")[-1]
        if dotted == F + "fsdp_reshard_after_forward" and value == "SHARD_GRAD_OP":
            got = plugin.sharding_strategy or plugin.reshard_after_forward
            return getattr(got, "name", str(got)) != "SHARD_GRAD_OP"
        if dotted == F + "fsdp_sharding_strategy" and value == "SHARD_GRAD_OP":
            return plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
        if dotted == F + "fsdp_auto_wrap_policy" and value is None:
            return plugin.auto_wrap_policy is None or "NO_WRAP" in str(plugin.auto_wrap_policy)
        if dotted == "parallelism_config":  # unprefixed keys: their variables keep defaults
            return all(env.get("PARALLELISM_CONFIG_" + k.upper()) != str(v)
                       for k, v in value.items())
    # A key no environment variable carries.
    keys = [d.split(".")[-1] for d, v in changes.items() if v is not None]
    wanted = [k.upper().replace("FSDP_", "") for k in keys]
    return not any(w in name for w in wanted for name in env)


def memplan_verdict(memplan, path):
    r = subprocess.run([memplan, "check", path, "--gpus", str(GPUS), "--format", "json"],
                       capture_output=True, text=True)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"memplan check exited {r.returncode}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--memplan", required=True)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import accelerate
        import accelerate.utils  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"skipped: cannot import accelerate: {e!r}")
        return 77
    logging.disable(logging.WARNING)
    print(f"accelerate {accelerate.__version__}")
    bad = refused = silent = 0
    with tempfile.TemporaryDirectory() as tmp:
        ds_file = os.path.join(tmp, "ds_config.json")
        with open(ds_file, "w") as f:
            json.dump(DS_FILE, f)
        for n, (base, changes, expected) in enumerate(CASES):
            config = changed(base, changes, ds_file)
            path = os.path.join(tmp, f"case{n}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(config, f)
            problems, plugin, env = accelerate_verdict(path)
            mp = memplan_verdict(args.memplan, path)
            paths = [p["path"] for p in mp["problems"]]
            keys = paths + [k for p in mp["problems"] for k in p.get("keys", [])]
            named = not changes or any(k == c or k.startswith(c + ".")
                                       for c in changes for k in keys)
            if expected == "silent":
                ok = not problems and not mp["ok"] and named and silence_shown(changes, plugin, env)
                silent += 1
            elif expected == "refuse":
                ok = bool(problems) and not mp["ok"] and named
                refused += bool(problems)
            else:
                ok = not problems and mp["ok"]
            name = f"{base['distributed_type']} {json.dumps(changes)}"
            print(("ok   " if ok else "FAIL ") + f"{name}: Accelerate "
                  + ("refuses (" + "; ".join(problems) + ")" if problems else "accepts")
                  + ", memplan " + ("accepts" if mp["ok"] else "refuses " + ", ".join(paths))
                  + (" [silent]" if expected == "silent" else ""))
            bad += not ok
    print(f"{len(CASES)} configs, {refused} refused by Accelerate, {silent} taken silently, "
          f"{bad} disagreements")
    return 1 if bad or refused < 15 else 0


if __name__ == "__main__":
    sys.exit(main())
