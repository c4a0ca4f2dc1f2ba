#!/usr/bin/env python3
"""memplan's step-time model against published training throughputs.

    python3 bench/step_time_accuracy.py [--memplan build/tools/memplan]
        [--records tests/accuracy/step_times.json] [--check] [--json]
        [--calibration FILE] [--runs OUT.json] [--cross-validate]

Each record (tests/accuracy/step_times.json) is one published run: source, hardware, setup, the
measured figure and what it is, and the `memplan plan` flags that give its configuration as a
"what if" (--zero-stage, --offload-optimizer, --checkpointing, --micro-batch, --sharding). The
published configuration must fit (a plan comes back); its predicted step time is compared with
the published one: error = predicted / published - 1 (positive: memplan predicts slower).

--calibration FILE predicts with `memplan calibrate`'s constants (plan --calibration). --runs OUT
writes the records as measured runs (memplan.runs/1: each configuration as `memplan plan` resolves
it, with the published step time), which `memplan calibrate` fits. --cross-validate calibrates on
all records but one and predicts that one, for each record in turn (leave-one-out), and prints
the held-out errors next to the uncalibrated ones: what calibration buys on runs it has not
seen.

--check exits 1 when a published configuration does not fit, when the median |error| over the
acceptance rows (issue 16's eight runs) is above 15%, or when any row (acceptance or not) is off
by more than 30%. Python 3 standard library only; paths in the records are relative to the
repository root.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEDIAN_LIMIT = 0.15
WORST_LIMIT = 0.30


def flag(args, name, default=None):
    return args[args.index(name) + 1] if name in args else default


def published_step_seconds(record):
    """The published step time in seconds, from whatever figure the source printed."""
    m = record["measured"]
    args = record["memplan"]
    kind = m["kind"]
    world = int(flag(args, "--gpus", 1)) * int(flag(args, "--nodes", 1))
    global_batch = int(flag(args, "--global-batch"))
    seq = int(flag(args, "--seq-len"))
    if kind == "tokens_per_s_per_gpu":
        return global_batch * seq / world / float(m["value"])
    if kind == "ms_per_step":
        return float(m["value"]) / 1000
    if kind == "tflops_per_gpu_megatron":
        b, s, l, h, v = (m[k] for k in ("batch", "seq", "layers", "hidden", "vocab"))
        flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
        return flops / (float(m["value"]) * 1e12)
    raise RuntimeError(f"record {record['id']}: unknown measured.kind {kind}")


def plan(memplan, args, calibration=None):
    extra = ["--calibration", calibration] if calibration else []
    run = subprocess.run([memplan, "plan", *args, "--format", "json", "--top", "1", *extra],
                         capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        raise RuntimeError(f"memplan plan {' '.join(args)}: {run.stderr.strip()}")
    return json.loads(run.stdout)


def evaluate(memplan, doc, calibration=None):
    rows = []
    for r in doc["records"]:
        row = {"id": r["id"], "acceptance": bool(r.get("acceptance")), "record": r}
        row["published_s"] = published_step_seconds(r)
        j = plan(memplan, r["memplan"], calibration)
        if not j["plans"]:
            row["fits"] = False
            row["why"] = "; ".join(x["plan"] + ": " + x["reason"] for x in j["rejected"][:2])
        else:
            p = j["plans"][0]
            row["fits"] = True
            row["predicted_s"] = p["step_time_s"]
            row["error"] = p["step_time_s"] / row["published_s"] - 1
            row["mfu"] = p["mfu"]
            row["hfu"] = p["hfu"]
            row["bound"] = p["time"]["bound"]
            row["family"] = p["family"]
        rows.append(row)
    return rows


def as_run(memplan, record):
    """The record as a measured run of `memplan calibrate` (memplan.runs/1)."""
    j = plan(memplan, record["memplan"])
    if not j["plans"]:
        raise RuntimeError(f"{record['id']}: the published configuration does not fit")
    p, job = j["plans"][0], j["job"]
    args = record["memplan"]
    setup = {"precision": job["precision"], "optimizer": p["optimizer"],
             "zero_stage": p["zero_stage"], "offload_optimizer": p["offload_optimizer"],
             "offload_param": p["offload_param"], "checkpointing": p["activation_checkpointing"],
             "micro_batch": p["micro_batch"], "grad_accum": p["grad_accum"],
             "seq_len": job["seq_len"], "pin_memory": p["pin_memory"],
             "flash_attention": job["flash_attention"]}
    if job.get("lora_rank"):
        setup["lora_rank"] = job["lora_rank"]
    return {"id": record["id"], "model": flag(args, "--model"),
            "model_class": flag(args, "--model-class", "auto"), "cluster": j["cluster"],
            "setup": setup, "sharding": p["sharding"],
            "step_time_s": published_step_seconds(record), "source": record["source"]}


def calibrate(memplan, runs, directory, name):
    path = os.path.join(directory, name + ".runs.json")
    with open(path, "w") as f:
        json.dump({"format": "memplan.runs/1", "runs": runs}, f)
    out = os.path.join(directory, name + ".calibration.json")
    run = subprocess.run([memplan, "calibrate", path, "-o", out], capture_output=True,
                         text=True, cwd=ROOT)
    if run.returncode != 0:
        raise RuntimeError(f"memplan calibrate ({name}): {run.stderr.strip()}")
    return out


def cross_validate(memplan, doc):
    """Leave-one-out: (id, published, prior, held-out calibrated) per record."""
    import tempfile
    runs = [as_run(memplan, r) for r in doc["records"]]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, r in enumerate(doc["records"]):
            cal = calibrate(memplan, runs[:i] + runs[i + 1:], tmp, f"loo{i}")
            prior = plan(memplan, r["memplan"])["plans"][0]["step_time_s"]
            held = plan(memplan, r["memplan"], cal)["plans"][0]["step_time_s"]
            out.append((r["id"], runs[i]["step_time_s"], prior, held))
    return out


def judge(rows):
    problems = []
    for r in rows:
        if not r["fits"]:
            problems.append(f"{r['id']}: the published configuration does not fit: {r['why']}")
        elif abs(r["error"]) > WORST_LIMIT:
            problems.append(f"{r['id']}: error {r['error']:+.1%} beyond {WORST_LIMIT:.0%}")
    accepted = [abs(r["error"]) for r in rows if r["acceptance"] and r["fits"]]
    if accepted and statistics.median(accepted) > MEDIAN_LIMIT:
        problems.append(f"median |error| {statistics.median(accepted):.1%} over the acceptance rows "
                        f"beyond {MEDIAN_LIMIT:.0%}")
    return problems


def table(rows):
    lines = [f"{'record':38} {'published':>10} {'predicted':>10} {'error':>7}  {'MFU':>5} {'HFU':>5}  bound",
             f"{'':38} {'s/step':>10} {'s/step':>10}"]
    for r in rows:
        mark = "*" if r["acceptance"] else " "
        if not r["fits"]:
            lines.append(f"{mark}{r['id']:37} {r['published_s']:10.3f} {'no fit':>10}")
            continue
        lines.append(f"{mark}{r['id']:37} {r['published_s']:10.3f} {r['predicted_s']:10.3f} "
                     f"{r['error']:+7.1%}  {r['mfu']:5.1%} {r['hfu']:5.1%}  {r['bound']}")
    for label, subset in (("acceptance rows (*)", [r for r in rows if r["acceptance"]]),
                          ("all rows", rows)):
        errors = [r["error"] for r in subset if r["fits"]]
        if errors:
            worst = max(subset, key=lambda r: abs(r.get("error", 0)))
            lines.append(f"{label}: {len(errors)}; median |error| "
                         f"{statistics.median(abs(e) for e in errors):.1%}; worst {worst['id']} "
                         f"{worst['error']:+.1%}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memplan", default=os.path.join(ROOT, "build", "tools", "memplan"))
    parser.add_argument("--records", default=os.path.join(ROOT, "tests", "accuracy",
                                                          "step_times.json"))
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--calibration", default=None,
                        help="predict with this `memplan calibrate` file")
    parser.add_argument("--runs", default=None,
                        help="write the records as memplan.runs/1 measured runs and exit")
    parser.add_argument("--cross-validate", action="store_true",
                        help="leave-one-out: calibrate on the others, predict each record")
    args = parser.parse_args()
    with open(args.records) as f:
        doc = json.load(f)
    try:
        if args.runs:
            runs = [as_run(args.memplan, r) for r in doc["records"]]
            with open(args.runs, "w") as f:
                json.dump({"format": "memplan.runs/1", "runs": runs}, f, indent=1)
                f.write("\n")
            print(f"{len(runs)} runs written to {args.runs}")
            return 0
        if args.cross_validate:
            rows = cross_validate(args.memplan, doc)
            print(f"{'record (held out)':38} {'published':>10} {'prior':>9} {'error':>7} "
                  f"{'calibrated':>10} {'error':>7}")
            for rid, pub, prior, held in rows:
                print(f"{rid:38} {pub:10.3f} {prior:9.3f} {prior / pub - 1:+7.1%} {held:10.3f} "
                      f"{held / pub - 1:+7.1%}")
            med = lambda xs: statistics.median(abs(x) for x in xs)  # noqa: E731
            print(f"median |error| over {len(rows)} held-out records: "
                  f"{med(p / pub - 1 for _, pub, p, _ in rows):.1%} with the priors, "
                  f"{med(h / pub - 1 for _, pub, _, h in rows):.1%} calibrated on the others")
            return 0
        rows = evaluate(args.memplan, doc, args.calibration)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "record"} for r in rows], indent=2))
    else:
        print(table(rows))
    problems = judge(rows)
    if problems:
        print("NOT MET:" if args.check else "beyond the acceptance bounds:")
        for p in problems:
            print("  " + p)
    else:
        print("every published configuration fits; median and worst errors within bounds")
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
