#!/usr/bin/env python3
"""Every launch file `memplan plan --emit-launch` writes, through bash and its launcher's own parser.

    launch_test.py --memplan BUILD/tools/memplan

Runs in the modern environment (MEMPLAN_MODERN_PYTHON: PyPI torch 2, DeepSpeed 0.19, Accelerate).
For one- and two-node plans, each launcher (slurm, torchrun, deepspeed, accelerate) is emitted with
the DeepSpeed and Accelerate configs into a directory whose name holds a space, a quote and a $,
and with script arguments that need quoting. Each file must:

  - pass `bash -n`;
  - run under bash with the launcher (and srun, scontrol) replaced by a function that records its
    arguments: so the arguments checked are exactly those bash would pass after its quoting and
    expansion, with the variables a node sets (NODE_RANK, MASTER_ADDR; SLURM_* for sbatch);
  - be accepted by the launcher's own argument parser: torch.distributed.run's get_args_parser and
    config_from_args (torchrun), deepspeed.launcher.runner.parse_args (deepspeed), accelerate
    launch's launch_command_parser and _validate_launch_command with the emitted config
    (accelerate), with the node and GPU counts of the plan and the training script with its
    arguments intact (under accelerate launch without a --deepspeed_config of its own: the
    Accelerate config names the DeepSpeed one, and an HfArgumentParser script would refuse it);
  - for slurm, carry #SBATCH --nodes, --ntasks, --gres=gpu:N of the plan.

A DeepSpeed launch of a hybrid-sharded plan is not written (DeepSpeed 0.19 has no MiCS) and must
say so. Exit 77 (skip) when a launcher's package is missing.
"""
import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile

SCENARIOS = [
    # (flags, nodes, gpus per node)
    (["--model", "llama-2-7b", "--gpu", "a100-80", "--gpus", "8", "--cpu-mem", "1TiB",
      "--cpu-cores", "64", "--global-batch", "64", "--seq-len", "2048"], 1, 8),
    (["--model", "llama-2-7b", "--gpu", "h100-80", "--gpus", "8", "--nodes", "2", "--cpu-mem",
      "1TiB", "--global-batch", "128", "--seq-len", "4096", "--zero-stage", "3",
      "--sharding", "full"], 2, 8),
]
LAUNCHERS = ["slurm", "torchrun", "deepspeed", "accelerate"]
SCRIPT_ARGS = ["--output_dir", "out dir/it's $HOME", "--flag"]

# The launchers as functions that record their arguments, NUL-separated, and return.
STUBS = r'''
record() { printf '%s\0' "$@" > "$ARGS_OUT"; }
torchrun() { record torchrun "$@"; }
deepspeed() { record deepspeed "$@"; }
accelerate() { record accelerate "$@"; }
scontrol() { echo node-a; }
srun() { while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done; "$@"; }
export -f record torchrun deepspeed accelerate scontrol srun
'''


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def recorded_args(path, env_extra, out):
    env = dict(os.environ, ARGS_OUT=out, NODE_RANK="1", MASTER_ADDR="10.0.0.1",
               SLURM_JOB_NODELIST="node-[a-b]", SLURM_NNODES="2", SLURM_JOB_ID="42",
               SLURM_NODEID="0", **env_extra)
    r = run(["bash", "-c", STUBS + '\nsource "$1"', "stub", path], env=env)
    if r.returncode != 0:
        raise RuntimeError(f"running {path} with stub launchers: {r.stderr.strip()}")
    with open(out, "rb") as f:
        return [a.decode() for a in f.read().split(b"\0")[:-1]]


def check_script_args(user_args, ds_path):
    """ds_path None: the script gets no DeepSpeed config argument (under accelerate launch the
    Accelerate config carries it; an HfArgumentParser script would refuse the flag)."""
    want = SCRIPT_ARGS + (["--deepspeed_config", ds_path] if ds_path is not None else [])
    if list(user_args) != want:
        raise AssertionError(f"training script arguments {list(user_args)} != {want}")


def check_torchrun(argv, nodes, gpus, ds_path):
    from torch.distributed.run import config_from_args, get_args_parser
    assert argv[0] == "torchrun", argv
    args = get_args_parser().parse_args(argv[1:])
    config, cmd, cmd_args = config_from_args(args)
    assert (config.min_nodes, config.max_nodes) == (nodes, nodes), (config.min_nodes, nodes)
    assert config.nproc_per_node == gpus, config.nproc_per_node
    assert args.training_script == "train.py", args.training_script
    check_script_args(args.training_script_args, ds_path)


def check_deepspeed(argv, nodes, gpus, ds_path):
    from deepspeed.launcher.runner import parse_args
    assert argv[0] == "deepspeed", argv
    args = parse_args(argv[1:])
    assert args.num_gpus == gpus, args.num_gpus
    assert args.num_nodes == (nodes if nodes > 1 else -1), args.num_nodes
    if nodes > 1:
        assert args.hostfile == "hostfile", args.hostfile
    assert args.user_script == "train.py", args.user_script
    check_script_args(args.user_args, ds_path)


def check_accelerate(argv, nodes, gpus, ds_path, yaml_path):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    assert argv[:2] == ["accelerate", "launch"], argv
    args = launch_command_parser().parse_args(argv[2:])
    assert args.config_file == yaml_path, args.config_file
    if nodes > 1:
        assert args.main_process_ip in ("10.0.0.1", "node-a"), args.main_process_ip
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        args, _, _ = _validate_launch_command(args)
    assert args.num_machines == nodes, args.num_machines
    assert args.num_processes == nodes * gpus, args.num_processes
    assert args.training_script == "train.py", args.training_script
    check_script_args(args.training_script_args, None)
    import yaml
    with open(yaml_path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    named = config.get("deepspeed_config", {}).get("deepspeed_config_file")
    assert named == ds_path, (named, ds_path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--memplan", required=True)
    opts = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's config_from_args warns otherwise
    try:
        import accelerate  # noqa: F401
        import deepspeed.launcher.runner  # noqa: F401
        import torch.distributed.run  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"skipped: a launcher's package is missing: {e!r}")
        return 77
    failures, checked = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for flags, nodes, gpus in SCENARIOS:
            for launcher in LAUNCHERS:
                d = os.path.join(tmp, f"{launcher} {nodes}n it's $X")
                os.makedirs(d)
                ds = os.path.join(d, "ds config.json")
                yaml = os.path.join(d, "accelerate.yaml")
                path = os.path.join(d, f"launch-{launcher}.sh")
                extra = [f"--launch-arg={a}" for a in SCRIPT_ARGS]
                r = run([opts.memplan, "plan", *flags, "--emit-deepspeed", ds,
                         "--emit-accelerate", yaml, "--emit-launch", launcher, path, *extra])
                name = f"{launcher} on {nodes} node(s)"
                if r.returncode != 0 or not os.path.exists(path):
                    failures.append(f"{name}: not written: {r.stderr.strip() or r.stdout[-300:]}")
                    continue
                text = open(path).read()
                syntax = run(["bash", "-n", path])
                if syntax.returncode != 0:
                    failures.append(f"{name}: bash -n: {syntax.stderr.strip()}")
                    continue
                try:
                    argv = recorded_args(path, {}, os.path.join(d, "args"))
                    if launcher == "slurm":
                        for directive in (f"--nodes={nodes}", f"--ntasks={nodes}",
                                          "--ntasks-per-node=1", f"--gres=gpu:{gpus}"):
                            if not re.search(rf"^#SBATCH {re.escape(directive)}$", text, re.M):
                                raise AssertionError(f"no '#SBATCH {directive}'")
                        if not text.startswith("#!"):
                            raise AssertionError("sbatch needs a #! first line")
                        # With an Accelerate config, srun starts accelerate launch.
                        check_accelerate(argv, nodes, gpus, ds, yaml)
                    elif launcher == "torchrun":
                        check_torchrun(argv, nodes, gpus, ds)
                    elif launcher == "deepspeed":
                        check_deepspeed(argv, nodes, gpus, ds)
                    else:
                        check_accelerate(argv, nodes, gpus, ds, yaml)
                    checked += 1
                    print(f"ok   {name}: {' '.join(argv[:6])} ...")
                except Exception as e:  # noqa: BLE001
                    failures.append(f"{name}: {type(e).__name__}: {e}")
        # sbatch with torchrun inside (a DeepSpeed config is emitted, no Accelerate one).
        d = os.path.join(tmp, "slurm torchrun")
        os.makedirs(d)
        ds, path = os.path.join(d, "ds.json"), os.path.join(d, "job.sbatch")
        flags, nodes, gpus = SCENARIOS[1]
        r = run([opts.memplan, "plan", *flags, "--emit-deepspeed", ds, "--emit-launch", "slurm",
                 path, *[f"--launch-arg={a}" for a in SCRIPT_ARGS]])
        try:
            assert r.returncode == 0, r.stderr
            assert run(["bash", "-n", path]).returncode == 0
            argv = recorded_args(path, {}, os.path.join(d, "args"))
            check_torchrun(argv, nodes, gpus, ds)
            assert "--rdzv-endpoint=node-a:29500" in argv, argv
            checked += 1
            print("ok   slurm with torchrun")
        except Exception as e:  # noqa: BLE001
            failures.append(f"slurm with torchrun: {type(e).__name__}: {e}")
        # A hybrid-sharded plan: no DeepSpeed launch, and the report says why.
        path = os.path.join(tmp, "hybrid.sh")
        r = run([opts.memplan, "plan", "--model", "llama-2-7b", "--gpu", "a100-80", "--gpus", "8",
                 "--nodes", "2", "--global-batch", "64", "--seq-len", "2048", "--zero-stage", "3",
                 "--sharding", "hybrid", "--emit-launch", "deepspeed", path])
        if r.returncode != 0 or os.path.exists(path) or "not written" not in r.stdout:
            failures.append(f"hybrid plan with a DeepSpeed launch: rc {r.returncode}, file "
                            f"{'written' if os.path.exists(path) else 'absent'}: {r.stdout[-200:]}")
        # A failed run writes nothing: an Accelerate launch without its config.
        path = os.path.join(tmp, "nothing.sh")
        ds = os.path.join(tmp, "nothing.json")
        r = run([opts.memplan, "plan", *SCENARIOS[0][0], "--emit-deepspeed", ds,
                 "--emit-launch", "accelerate", path])
        if r.returncode != 2 or os.path.exists(path) or os.path.exists(ds):
            failures.append(f"accelerate launch without --emit-accelerate: rc {r.returncode} "
                            f"(want 2), files left: {os.listdir(tmp)}")
    print(f"{checked} launch files accepted by bash and their launchers")
    for f in failures:
        print("FAIL " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
