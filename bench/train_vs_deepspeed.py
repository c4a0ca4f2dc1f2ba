#!/usr/bin/env python3
"""The whole offloaded training step: the same GPT trained through memplan and DeepSpeed ZeRO-Infinity.

    PY=$(bash scripts/python-env.sh --modern)       # PyPI torch 2 + DeepSpeed 0.19 (the peer)
    PYTHONPATH=build/python $PY bench/train_vs_deepspeed.py --path /var/tmp [--models 25M,100M]
        [--steps 8] [--warmup 3] [--rounds 3] [--arms torch,memplan,deepspeed] [--json out.json]
        [--batch 8] [--seq 64] [--svg curve.svg [--larger-than-ram larger_than_ram.json]]

The model is examples/train_gpt.py's GPT (tied embedding and head, GPT-2 initialisation), trained
on CPU in fp32 with AdamW (lr 1e-3, weight decay 0.01) on the same batches (--batch 8 sequences of
--seq 64 tokens by default, vocabulary 512) by these arms, each in a fresh process:
  torch      torch.optim.AdamW with everything in memory: the loss reference and the compute floor
  memplan    memplan.torch.offload: parameters and AdamW states on NVMe under --path (O_DIRECT),
             the optimizer overlapped, 16 MiB staging buffers, --memplan-options
  memplan_defaults
             memplan.torch.offload(model, path, lr=..., weight_decay=..., threads=...) as a user
             calls it: overlap_optimizer "auto", sizes chosen from the machine (issue 33), its
             choice printed with the round (not in the default --arms)
  deepspeed  DeepSpeed ZeRO-3 with offload_param and offload_optimizer on NVMe under --path, on
             its CPU accelerator (gloo, world size 1); aio block 1 MiB, queue depth 16, one
             thread; offload_param.buffer_size holds the largest parameter (DeepSpeed asserts
             otherwise), buffer_count 5, pin_memory
  deepspeed_defaults
             the same with only what a user must write (stage, devices, nvme_path, pin_memory;
             a parameter buffer for a parameter over 1e8 elements): DeepSpeed's defaults
             otherwise (bench/deepspeed_peer.zero_infinity_config)
Model sizes: 25M (hidden 512, 8 layers: 25.5 M parameters), 100M (hidden 1024, 8 layers:
101 M) and 400M (hidden 2048, 8 layers: 404 M), or any hidden x layers given as e.g. 768x12.

memplan runs with the optimizer overlapped with backward (overlap_optimizer: each sub-group of the
AdamW step read, updated and written back during backward as soon as its gradients are in);
--no-overlap measures the serial step instead. For memplan the table below the summary shows
where its step went (medians of the engine's step_profile over the measured steps and rounds):
backward window (the step's first gradient to step()), step() wait, optimizer compute, state
reads and writes, the commit, the optimizer waiting for backward, backward waiting for the
engine, and the optimizer sub-groups done before step() was called.

Each round runs every arm once, in a rotated order, so the machine's drift and its other users'
load fall on all of them; a run's step time is the median of its steps after --warmup. The table
shows medians over rounds: seconds per step, memplan / DeepSpeed, memplan / max(in-memory step,
I/O time), and the largest |loss - torch's loss| over the steps. I/O time is memplan's NVMe bytes
per step (parameters read and written back, optimizer states and gradients read and written) at
the drive's bandwidth measured in the same round (memplan.IoFile, 256 MiB each way, O_DIRECT,
--path), i.e. what the step would take if it did nothing but its I/O.

Environment: as bench/vs_deepspeed.py (memplan's extension imports in the modern venv unchanged;
DeepSpeed JIT-builds its ops once into build/torch_extensions). A benchmark, not a test.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import deepspeed_peer as peer  # noqa: E402  (sets DS_ACCELERATOR, TORCH_EXTENSIONS_DIR)

PRESETS = {"4.9M": (256, 6), "25M": (512, 8), "100M": (1024, 8), "400M": (2048, 8)}
VOCAB, LR, WD = 512, 1e-3, 0.01


def model_shape(name):
    if name in PRESETS:
        return PRESETS[name]
    hidden, layers = name.lower().split("x")
    return int(hidden), int(layers)


# ---- one arm, in its own process ------------------------------------------------------------------

def run_arm(args):
    import torch
    from train_gpt import GPT, batches

    torch.manual_seed(0)
    torch.set_num_threads(args.torch_threads)
    model = GPT(vocab=VOCAB, hidden=args.hidden, layers=args.layers, seq=args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    data = list(batches(args.warmup + args.steps, args.batch, args.seq + 1, VOCAB))
    out = {"arm": args.arm, "params": n_params, "losses": [], "step_s": []}
    nvme = os.path.join(args.path, f"{args.arm}-{os.getpid()}")

    def optimizer_phase(fn):
        # The optimizer step runs with --optimizer-threads in every arm (DeepSpeed's cpu_adam
        # uses torch's OpenMP pool; memplan's optimizer its own threads, set in the schedule).
        torch.set_num_threads(args.optimizer_threads)
        try:
            fn()
        finally:
            torch.set_num_threads(args.torch_threads)

    if args.arm == "torch":
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)

        def step(tokens):
            optimizer.zero_grad()
            loss = model(tokens)
            loss.backward()
            optimizer_phase(optimizer.step)
            return loss
        finish = None
    elif args.arm.startswith("memplan"):
        import memplan.torch
        if args.arm == "memplan_defaults":
            # offload()'s own defaults; threads is the bench's control (every arm's optimizer
            # runs on --optimizer-threads), not a size.
            options = {"threads": args.optimizer_threads}
        else:
            options = dict(direct=True, param_buffer_bytes=max(16 << 20, 4 * largest),
                           threads=args.optimizer_threads, overlap_optimizer=not args.no_overlap)
            options.update(json.loads(args.memplan_options))
        trainer = memplan.torch.offload(model, nvme, lr=LR, weight_decay=WD, **options)
        out["profiles"] = []

        def step(tokens):
            loss = model(tokens)
            loss.backward()
            trainer.step()
            out["profiles"].append(trainer.stats()["step_profile"])
            return loss

        def finish():
            out["chosen"] = trainer.explain()  # after the steps: what "auto" decided too
            out["stats"] = trainer.stats()
            trainer.close()
    else:
        import deepspeed
        peer.single_rank_environment()
        os.makedirs(nvme, mode=0o700)
        config = peer.zero_infinity_config(nvme, largest, args.batch, LR, WD,
                                           json.loads(args.deepspeed_options),
                                           defaults=args.arm == "deepspeed_defaults")
        out["config"] = config
        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)

        def step(tokens):
            loss = engine(tokens)
            engine.backward(loss)
            optimizer_phase(engine.step)
            return loss
        finish = None
    try:
        for i, tokens in enumerate(data):
            start = time.perf_counter()
            loss = step(tokens)
            elapsed = time.perf_counter() - start
            out["losses"].append(float(loss.detach()))
            if i >= args.warmup:
                out["step_s"].append(elapsed)
            if args.arm.startswith("memplan") and i == args.warmup - 1:
                out["stats_after_warmup"] = trainer.stats()
        if finish is not None:
            finish()
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f)


# ---- the parent: rounds of interleaved arms -------------------------------------------------------

def io_bytes(stats):
    """NVMe bytes memplan moved, by direction, from the engine's statistics."""
    param = stats["param"]
    read = param["nvme_read_bytes"] + stats["optimizer_read_bytes"]
    write = param["nvme_write_bytes"] + stats["optimizer_write_bytes"]
    # Gradients stored for a serial optimizer step: their reads are in optimizer_read_bytes,
    # their writes in grad_write_bytes (an overlapped step keeps them in memory).
    write += stats["grad_write_bytes"]
    return read, write


def drive_bandwidth(path, memplan, torch):
    """Read and write bytes/s of 256 MiB through memplan's engine at `path`, O_DIRECT."""
    import mmap
    size = 256 << 20
    buf = mmap.mmap(-1, size)
    tensor = torch.frombuffer(buf, dtype=torch.uint8)
    tensor.fill_(1)
    fd, name = tempfile.mkstemp(dir=path, prefix="memplan-bw.")
    os.close(fd)
    try:
        f = memplan.IoFile(name, block_size=1 << 20, queue_depth=16)
        f.write(tensor, 0)
        start = time.perf_counter()
        f.write(tensor, 0)
        f.sync()
        write = size / (time.perf_counter() - start)
        start = time.perf_counter()
        f.read(tensor, 0)
        read = size / (time.perf_counter() - start)
        f.close()
    finally:
        os.unlink(name)
        del tensor
        buf.close()
    return read, write


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--path", default="/var/tmp", help="a directory on the real drive")
    p.add_argument("--models", default="25M,100M")
    p.add_argument("--arms", default="torch,memplan,deepspeed")
    p.add_argument("--steps", type=int, default=8, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=64,
                   help="tokens per sequence (default 64): with --batch, the compute each step "
                        "has to hide the drive's time behind")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch's threads for forward and backward, in every arm (default 1: on a "
                        "shared 2-core machine OpenMP barriers collapse under others' load)")
    p.add_argument("--optimizer-threads", type=int, default=os.cpu_count() or 1,
                   help="threads of the optimizer step, in every arm")
    p.add_argument("--memplan-options", default="{}",
                   help="JSON of extra memplan.schedule keywords, e.g. '{\"io_threads\": 2}'")
    p.add_argument("--deepspeed-options", default="{}",
                   help="JSON merged into DeepSpeed's zero_optimization block")
    p.add_argument("--no-overlap", action="store_true",
                   help="memplan's optimizer after backward (serial), not overlapped with it")
    p.add_argument("--json", help="write every run and the summary here")
    p.add_argument("--from-json", metavar="JSON",
                   help="run nothing: print the summary (and draw --svg) of an earlier --json")
    p.add_argument("--svg", help="draw each arm's step time against the bytes memplan moves per "
                                 "step (the scaling curve of docs/bench.md) into this file")
    p.add_argument("--larger-than-ram", metavar="JSON",
                   help="with --svg: add the run of bench/larger_than_ram.py --json JSON as "
                        "memplan's largest point")
    # A child process running one arm.
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.arm:
        run_arm(args)
        return 0

    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            report = json.load(f)
        for key in ("models", "rounds", "warmup"):
            setattr(args, key, report["args"][key])
        report["summary"] = summarize(report["runs"], args)
        print(report["uptime_start"])
        print_summary(report["summary"])
        print(report["uptime_end"])
        if args.svg:
            write_summary_svg(args, report)
        return 0

    import torch
    import memplan
    arms = args.arms.split(",")
    report = {"versions": peer.versions(), "uptime_start": peer.uptime_line(),
              "args": {k: v for k, v in vars(args).items() if k != "json"}, "runs": []}
    print("train vs DeepSpeed:", report["versions"], "|", report["uptime_start"], flush=True)
    work = tempfile.mkdtemp(prefix="train-vs-ds.")
    try:
        for model in args.models.split(","):
            hidden, layers = model_shape(model)
            for r in range(args.rounds):
                read_bw, write_bw = drive_bandwidth(args.path, memplan, torch)
                order = arms[r % len(arms):] + arms[:r % len(arms)]
                for arm in order:
                    out = os.path.join(work, f"{model}-{arm}-{r}.json")
                    command = [sys.executable, os.path.abspath(__file__), "--arm", arm,
                               "--hidden", str(hidden), "--layers", str(layers), "--out", out,
                               "--path", args.path, "--steps", str(args.steps),
                               "--warmup", str(args.warmup), "--batch", str(args.batch),
                               "--seq", str(args.seq),
                               "--torch-threads", str(args.torch_threads),
                               "--optimizer-threads", str(args.optimizer_threads),
                               "--memplan-options", args.memplan_options,
                               "--deepspeed-options", args.deepspeed_options]
                    if args.no_overlap:
                        command.append("--no-overlap")
                    load = peer.load_average()
                    done = subprocess.run(command, capture_output=True, text=True, check=False)
                    if done.returncode != 0:
                        sys.exit(f"{arm} ({model}) failed:\n{done.stderr[-3000:]}")
                    with open(out, encoding="utf-8") as f:
                        run = json.load(f)
                    run.update(model=model, round=r, load=load, drive_read_bytes_per_s=read_bw,
                               drive_write_bytes_per_s=write_bw,
                               step_median_s=peer.median(run["step_s"]))
                    if r == 0 and "chosen" in run:
                        print(f"{arm} ran with ({model}):\n  " +
                              run["chosen"].replace("\n", "\n  "), flush=True)
                    if r == 0 and "config" in run:
                        print(f"{arm} ran with ({model}): {json.dumps(run['config'])}", flush=True)
                    if arm.startswith("memplan"):
                        before = io_bytes(run["stats_after_warmup"])
                        after = io_bytes(run["stats"])
                        steps = len(run["step_s"])
                        run["io_read_bytes_per_step"] = (after[0] - before[0]) / steps
                        run["io_write_bytes_per_step"] = (after[1] - before[1]) / steps
                        run["io_s"] = (run["io_read_bytes_per_step"] / read_bw +
                                       run["io_write_bytes_per_step"] / write_bw)
                    report["runs"].append(run)
                    print(f"{model} round {r + 1}/{args.rounds} {arm:<9} "
                          f"{run['step_median_s']:.3f} s/step (load {load:.2f})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["summary"] = summarize(report["runs"], args)
    report["uptime_end"] = peer.uptime_line()
    print_summary(report["summary"])
    print(report["uptime_end"])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    if args.svg:
        write_summary_svg(args, report)
    return 0


def write_summary_svg(args, report):
    extra = None
    if args.larger_than_ram:
        with open(args.larger_than_ram, encoding="utf-8") as f:
            extra = json.load(f)["summary"]
    write_svg(args.svg, report["summary"], extra)
    print(f"scaling curve: {args.svg}")


def summarize(runs, args):
    out = []
    for model in args.models.split(","):
        by = {}
        for run in runs:
            if run["model"] == model:
                by.setdefault(run["arm"], {})[run["round"]] = run
        entry = {"model": model, "params": next(iter(next(iter(by.values())).values()))["params"]}
        for arm, rounds in by.items():
            entry[f"{arm}_s"] = peer.median([r["step_median_s"] for r in rounds.values()])
        rounds = range(args.rounds)
        for num, den in RATIOS:
            if num in by and den in by:
                entry[f"{num}_over_{den}"] = peer.median(
                    [by[num][k]["step_median_s"] / by[den][k]["step_median_s"] for k in rounds])
        if "memplan" in by and "memplan_defaults" in by:
            # The same model and rounds: the defaults' step over the tuned (or small) one's.
            entry["defaults_over_memplan"] = entry["memplan_defaults_over_memplan"]
        moving = [arm for arm in ("memplan", "memplan_defaults") if arm in by]
        if moving:
            # What the model's step must move through the drive, as memplan moves it: the x of
            # the scaling curve, the same for every arm.
            entry["io_bytes_per_step"] = peer.median(
                [by[moving[0]][k]["io_read_bytes_per_step"] +
                 by[moving[0]][k]["io_write_bytes_per_step"] for k in rounds])
        for arm in moving:
            # The I/O time of the arm's own bytes at the round's measured bandwidth, and its step
            # over the floor max(in-memory step, I/O time).
            prefix = "" if arm == "memplan" else f"{arm}_"
            entry[f"{prefix}io_s"] = peer.median([by[arm][k]["io_s"] for k in rounds])
            if "torch" in by:
                entry[f"{arm}_over_floor"] = peer.median(
                    [by[arm][k]["step_median_s"] /
                     max(by["torch"][k]["step_median_s"], by[arm][k]["io_s"]) for k in rounds])
        for arm in ("memplan", "memplan_defaults"):
            if arm in by:
                # The step profile after warm-up, every round's steps together.
                profiles = [p for k in rounds for p in by[arm][k]["profiles"][args.warmup:]]
                profile = {key: peer.median([p[key] for p in profiles]) for key in PROFILE_KEYS}
                profile["overlapped"] = all(p["overlapped"] for p in profiles)
                entry[f"{arm}_profile"] = profile
        if "torch" in by:
            for arm in by:
                if arm != "torch":
                    entry[f"{arm}_max_loss_diff"] = max(
                        max(abs(a - b) for a, b in zip(by[arm][k]["losses"],
                                                       by["torch"][k]["losses"]))
                        for k in rounds)
        out.append(entry)
    return out


# The ratios of step times the summary gives, each the median of the rounds' ratios: the tuned
# runs, then defaults against defaults, then each memplan arm against the in-memory step.
RATIOS = (("memplan", "deepspeed"), ("memplan_defaults", "deepspeed_defaults"),
          ("memplan_defaults", "memplan"), ("memplan", "torch"), ("memplan_defaults", "torch"),
          ("deepspeed", "torch"), ("deepspeed_defaults", "torch"))

PROFILE_KEYS = ("backward_s", "step_s", "optimizer_s", "read_s", "write_s", "sync_s",
                "backward_wait_s", "stall_s", "sub_groups", "sub_groups_before_step",
                "overlapped_fraction")


ARM_COLOURS = {"torch": "#444444", "memplan": "#1f77b4", "memplan_defaults": "#17becf",
               "deepspeed": "#d62728", "deepspeed_defaults": "#ff7f0e"}


def write_svg(path, summary, larger_than_ram=None):
    """Step time against NVMe bytes per step, log-log, one polyline per arm; `larger_than_ram`
    (bench/larger_than_ram.py's summary) adds memplan's point there."""
    import math
    series = {}
    for e in summary:
        if "io_bytes_per_step" not in e:
            continue
        for arm in ARM_COLOURS:
            if f"{arm}_s" in e:
                series.setdefault(arm, []).append((e["io_bytes_per_step"], e[f"{arm}_s"],
                                                   e["model"]))
    if larger_than_ram:
        moved = (larger_than_ram["engine_read_bytes_per_step"] +
                 larger_than_ram["engine_write_bytes_per_step"])
        series.setdefault("memplan_defaults", []).append(
            (moved, larger_than_ram["step_s"], "larger than RAM"))
    points = [p for pts in series.values() for p in pts]
    if not points:
        raise SystemExit("--svg: no run with memplan's bytes per step to draw")
    width, height, left, bottom, top, right = 640, 420, 70, 50, 20, 160
    xs = [math.log10(p[0]) for p in points]
    ys = [math.log10(p[1]) for p in points]
    x0, x1 = math.floor(min(xs)), math.ceil(max(xs))
    y0, y1 = math.floor(min(ys)), math.ceil(max(ys))

    def at(x, y):
        px = left + (math.log10(x) - x0) / max(x1 - x0, 1) * (width - left - right)
        py = height - bottom - (math.log10(y) - y0) / max(y1 - y0, 1) * (height - bottom - top)
        return px, py
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    for d in range(x0, x1 + 1):
        px, _ = at(10 ** d, 10 ** y0)
        out.append(f'<line x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{height - bottom}" '
                   f'stroke="#ddd"/><text x="{px:.1f}" y="{height - bottom + 14}" '
                   f'text-anchor="middle">{10 ** d / 1e9:g} GB</text>')
    for d in range(y0, y1 + 1):
        _, py = at(10 ** x0, 10 ** d)
        out.append(f'<line x1="{left}" y1="{py:.1f}" x2="{width - right}" y2="{py:.1f}" '
                   f'stroke="#ddd"/><text x="{left - 6}" y="{py + 4:.1f}" '
                   f'text-anchor="end">{10 ** d:g} s</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">'
               f'NVMe bytes memplan moves per step (read + written)</text>')
    out.append(f'<text x="16" y="{(top + height - bottom) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {(top + height - bottom) / 2})">seconds per step</text>')
    for i, (arm, pts) in enumerate(series.items()):
        pts.sort()
        colour = ARM_COLOURS[arm]
        coords = " ".join(f"{at(x, y)[0]:.1f},{at(x, y)[1]:.1f}" for x, y, _ in pts)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" '
                   f'stroke-width="2"/>')
        for x, y, model in pts:
            px, py = at(x, y)
            out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour}">'
                       f'<title>{arm} {model}: {y:.2f} s</title></circle>')
        ly = top + 14 + 18 * i
        out.append(f'<line x1="{width - right + 12}" y1="{ly - 4}" x2="{width - right + 32}" '
                   f'y2="{ly - 4}" stroke="{colour}" stroke-width="2"/>'
                   f'<text x="{width - right + 38}" y="{ly}">{arm}</text>')
    out.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


def print_summary(summary):
    for e in summary:
        if "defaults_over_memplan" in e:
            print(f"{e['model']}: memplan_defaults {e['memplan_defaults_s']:.3f} s/step, memplan "
                  f"{e['memplan_s']:.3f} s/step: defaults / memplan = "
                  f"{e['defaults_over_memplan']:.3f} (median of the rounds' ratios)")
    print(f"\n{'model':<7} {'params':>11} {'torch s':>8} {'memplan s':>10} {'DeepSpeed s':>12} "
          f"{'I/O s':>6} {'mp/DS':>6} {'mp/max(torch,I/O)':>18} {'mp dloss':>9} {'DS dloss':>9}")
    for e in summary:
        def f(key, fmt):
            return format(e[key], fmt) if key in e else "-"
        print(f"{e['model']:<7} {e['params']:>11,} {f('torch_s', '8.3f'):>8} "
              f"{f('memplan_s', '10.3f'):>10} {f('deepspeed_s', '12.3f'):>12} "
              f"{f('io_s', '6.3f'):>6} {f('memplan_over_deepspeed', '6.3f'):>6} "
              f"{f('memplan_over_floor', '18.3f'):>18} {f('memplan_max_loss_diff', '9.2g'):>9} "
              f"{f('deepspeed_max_loss_diff', '9.2g'):>9}")
    print(f"\nratios of step times (median over rounds of each round's ratio): ")
    for e in summary:
        ratios = [f"{num}/{den} {e[f'{num}_over_{den}']:.3f}" for num, den in RATIOS
                  if f"{num}_over_{den}" in e]
        ratios += [f"{arm}/max(torch, its I/O) {e[f'{arm}_over_floor']:.3f}"
                   for arm in ("memplan", "memplan_defaults") if f"{arm}_over_floor" in e]
        print(f"  {e['model']:<7} " + ", ".join(ratios))
    profiled = [(e, arm) for e in summary for arm in ("memplan", "memplan_defaults")
                if f"{arm}_profile" in e]
    if profiled:
        print(f"\nmemplan's step (medians, s): {'model':<7} {'arm':<16} {'overlap':>7} "
              f"{'backward':>8} {'step()':>7} {'optim':>6} {'read':>6} {'write':>6} {'sync':>6} "
              f"{'opt wait':>8} {'bw stall':>8} {'before step()':>13}")
        for e, arm in profiled:
            p = e[f"{arm}_profile"]
            print(f"{'':28} {e['model']:<7} {arm:<16} {'yes' if p['overlapped'] else 'no':>7} "
                  f"{p['backward_s']:8.3f} {p['step_s']:7.3f} {p['optimizer_s']:6.3f} "
                  f"{p['read_s']:6.3f} {p['write_s']:6.3f} {p['sync_s']:6.3f} "
                  f"{p['backward_wait_s']:8.3f} {p['stall_s']:8.3f} "
                  f"{p['sub_groups_before_step']:>6.0f}/{p['sub_groups']:<6.0f}")

if __name__ == "__main__":
    sys.exit(main())
