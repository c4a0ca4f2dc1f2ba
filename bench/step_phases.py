#!/usr/bin/env python3
"""Where one training step's time goes: forward, backward and step() of the same GPT, in memory
(torch.optim.AdamW) or through memplan.torch.offload with its defaults.

    PY=$(bash scripts/python-env.sh --modern)
    PYTHONPATH=build/python OMP_NUM_THREADS=1 $PY bench/step_phases.py --path /var/tmp \\
        [--arms torch,memplan] [--rounds 3] [--hidden 512 --layers 8] [--engine-nice N]
        [--memplan-options '{"direct": true}']

The model and batches are bench/train_vs_deepspeed.py's (examples/train_gpt.py's GPT, batch 8 x 64
tokens, vocabulary 512), forward and backward on one thread, the optimizer on --threads. Each arm
runs in its own process, in rotated order each round; an arm's figures are the medians of its
steps after the first two. For memplan it also prints the engine's step_profile medians: sync_s
(the commit: the store's fdatasync, then its index written and renamed), optimizer_s, read_s,
write_s and the share of sub-groups stepped during backward. --engine-nice N renices every thread
of the memplan process but the one running forward and backward (a watcher, every 5 ms): whether
the engine's threads slow backward's. A benchmark, not a test.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from deepspeed_peer import load_average, median  # noqa: E402  (the benches' shared helpers)

PROFILE_KEYS = ("sync_s", "optimizer_s", "read_s", "write_s", "overlapped_fraction")


def renice_others(nice):
    main = threading.get_native_id()

    def loop():
        while True:
            for tid in os.listdir("/proc/self/task"):
                if int(tid) != main:
                    try:
                        os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                    except OSError:
                        pass
            time.sleep(0.005)
    threading.Thread(target=loop, daemon=True).start()


def run_arm(args):
    import torch
    from train_gpt import GPT, batches
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT(vocab=512, hidden=args.hidden, layers=args.layers, seq=64)
    data = list(batches(args.steps + 2, 8, 65, 512))
    rows, profiles = [], []
    if args.arm == "torch":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

        def finish():
            torch.set_num_threads(args.threads)
            optimizer.step()
            torch.set_num_threads(1)
            optimizer.zero_grad()
        close = None
    else:
        import memplan.torch
        if args.engine_nice:
            renice_others(args.engine_nice)
        store = tempfile.mkdtemp(prefix="step-phases.", dir=args.path)
        trainer = memplan.torch.offload(model, os.path.join(store, "engine"), lr=1e-3,
                                        weight_decay=0.01, threads=args.threads,
                                        **json.loads(args.memplan_options))

        def finish():
            trainer.step()
            profiles.append(trainer.stats()["step_profile"])

        def close():
            trainer.close()
            shutil.rmtree(store, ignore_errors=True)
    try:
        for tokens in data:
            t0 = time.perf_counter()
            loss = model(tokens)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            finish()
            rows.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    finally:
        if close is not None:
            close()
    rows, profiles = rows[2:], profiles[2:]
    out = {k: median([r[i] for r in rows]) for i, k in enumerate(("forward", "backward", "step"))}
    out["total"] = median([sum(r) for r in rows])
    for key in PROFILE_KEYS:
        if profiles:
            out[key] = median([p[key] for p in profiles])
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--path", default="/var/tmp", help="a directory on the drive to measure")
    p.add_argument("--arms", default="torch,memplan")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="measured steps per run (after 2)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="the optimizer's threads")
    p.add_argument("--engine-nice", type=int, default=0)
    p.add_argument("--memplan-options", default="{}",
                   help="JSON of extra memplan.torch.offload keywords")
    p.add_argument("--arm", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:
        run_arm(args)
        return 0
    arms = args.arms.split(",")
    print(f"step phases: {args.hidden}x{args.layers}, load {load_average():.2f}")
    for r in range(args.rounds):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            command = [sys.executable, os.path.abspath(__file__), "--arm", arm] + \
                [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k not in ("arm", "arms", "rounds")]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                sys.exit(f"{arm} failed:\n{done.stderr[-3000:]}")
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"round {r + 1} {arm:<8} " +
                  " ".join(f"{k} {v:.3f}" for k, v in figures.items()), flush=True)
    print(f"load {load_average():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
