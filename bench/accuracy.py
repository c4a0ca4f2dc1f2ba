#!/usr/bin/env python3
"""memplan's predictions against published measurements of real training runs.

    python3 bench/accuracy.py [--memplan build/tools/memplan] [--records tests/accuracy/published.json]
        [--check] [--json]

Reads the records (one published run each: source, hardware, setup, the measured figure and
what it is, and the memplan flags that express it), asks `memplan estimate --format json` for
each, and prints predicted vs measured with the signed error, then the median and the worst
|error| over the fully specified rows. Peak rows compare like with like: an nvidia-smi figure
(CUDA context included) and a max_memory_reserved figure (without it) with memplan's
gpu_reserved_bytes (what the caching allocator reserves on a GPU with room to spare), a
max_memory_allocated figure with the gpu_allocated_bytes of memplan's peak phase. Verdict rows (oom / fits) compare the predicted peak
with the GPU's memory; max_micro_batch rows find the largest micro-batch memplan fits there and
must land within +-1 of the published one and keep the published order within their order_group;
ratio_group rows are judged on the ratio between the runs of the group.

--check exits 1 when any of issue 14's acceptance fails: the median |error| over the fully
specified peak rows above 5%, a fully specified row off by more than its tolerance (10% unless
the record says less), a wrong oom / fits verdict, a fully specified batch limit off by more than
1, a batch limit out of the published order within its order_group (rows whose setting is not
fully published are judged on that order), or a ratio off by more than its tolerance. There is
no lenient mode (--strict is accepted and means the same). Python 3 standard library only; the
paths in the records are relative to the repository root.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEDIAN_LIMIT = 0.05
DEFAULT_TOLERANCE = 0.10
MAX_BATCH_SEARCH = 128


def load_records(path):
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("records"), list):
        sys.exit(f"{path}: expected an object with a 'records' list")
    for r in doc["records"]:
        for key in ("id", "source", "hardware", "measured", "memplan"):
            if key not in r:
                sys.exit(f"{path}: record {r.get('id', '?')} has no '{key}'")
    return doc


def measured_bytes(m):
    """The measured figure in bytes (peak rows)."""
    scale = {"MiB": 2**20, "GiB": 2**30, "GB": 1e9, "MB": 1e6, "bytes": 1}[m["units"]]
    return float(m["value"]) * scale


def estimate(memplan, flags, micro_batch=None):
    args = list(flags)
    if micro_batch is not None:
        if "--micro-batch" in args:
            args[args.index("--micro-batch") + 1] = str(micro_batch)
        else:
            args += ["--micro-batch", str(micro_batch)]
    run = subprocess.run([memplan, "estimate", *args, "--format", "json"], capture_output=True,
                         text=True, cwd=ROOT)
    if run.returncode != 0:
        raise RuntimeError(f"memplan estimate {' '.join(args)}: {run.stderr.strip()}")
    j = json.loads(run.stdout)
    peak = j["peak"]
    allocated = next(p["gpu_allocated_bytes"] for p in j["phases"] if p["phase"] == peak["phase"])
    context = sum(i["gpu_bytes"] for i in j["breakdown"] if i["item"] == "cuda_context")
    return {"gpu_bytes": peak["gpu_bytes"], "allocated_bytes": allocated, "phase": peak["phase"],
            "reserved_bytes": peak.get("gpu_reserved_bytes", peak["gpu_bytes"] - context),
            "cpu_bytes": peak["cpu_bytes"], "context_bytes": context,
            "step_bytes": j.get("step_model", {}).get("peak_bytes")}


def predicted_for(kind, p):
    # The runs were measured on GPUs with room to spare, where the caching allocator keeps what
    # it frees: max_memory_reserved (what torchtitan logs) is its segments, nvidia-smi those and
    # the CUDA context.
    if kind == "max_memory_allocated":
        return p["allocated_bytes"]
    if kind == "max_memory_reserved":
        return p["reserved_bytes"]
    return p["reserved_bytes"] + p["context_bytes"]


def evaluate(memplan, doc):
    rows = []
    for r in doc["records"]:
        m = r["measured"]
        kind = m["kind"]
        capacity = r["hardware"].get("gpu_memory_bytes", 0)
        row = {"id": r["id"], "kind": kind, "fully_specified": bool(r.get("fully_specified")),
               "tolerance": r.get("tolerance", DEFAULT_TOLERANCE), "record": r}
        if kind in ("nvidia-smi", "max_memory_allocated", "max_memory_reserved"):
            p = estimate(memplan, r["memplan"])
            row["predicted"] = predicted_for(kind, p)
            row["measured"] = measured_bytes(m)
            row["error"] = row["predicted"] / row["measured"] - 1
            row["phase"] = p["phase"]
            if kind == "max_memory_allocated" and p["step_bytes"]:
                row["step_predicted"] = p["step_bytes"]
                row["step_error"] = p["step_bytes"] / row["measured"] - 1
        elif kind in ("oom", "fits"):
            p = estimate(memplan, r["memplan"])
            row["predicted"] = p["gpu_bytes"]
            row["verdict"] = "fits" if p["gpu_bytes"] <= capacity else "oom"
            row["ok"] = row["verdict"] == kind
        elif kind == "max_micro_batch":
            limit = 0
            for b in range(1, MAX_BATCH_SEARCH + 1):
                if estimate(memplan, r["memplan"], b)["gpu_bytes"] > capacity:
                    break
                limit = b
            row["predicted"] = limit
            row["measured"] = int(m["value"])
            row["ok"] = abs(limit - row["measured"]) <= 1
        else:
            raise RuntimeError(f"record {r['id']}: unknown measured.kind {kind}")
        rows.append(row)
    return rows


def judge(rows):
    """The acceptance failures, one line each; empty when every check holds."""
    problems = []
    exact = [r for r in rows if "error" in r and r["fully_specified"]]
    for r in exact:
        if abs(r["error"]) > r["tolerance"]:
            problems.append(f"{r['id']}: error {r['error']:+.1%} beyond {r['tolerance']:.0%}")
    if exact:
        median = statistics.median(abs(r["error"]) for r in exact)
        if median > MEDIAN_LIMIT:
            problems.append(f"median |error| {median:.1%} beyond {MEDIAN_LIMIT:.0%}")
    for r in rows:
        if r["kind"] in ("oom", "fits") and not r["ok"]:
            problems.append(f"{r['id']}: predicted {r['verdict']}, published {r['kind']}")
    groups = {}
    for r in rows:
        if r["kind"] == "max_micro_batch":
            groups.setdefault(r["record"].get("order_group"), []).append(r)
    for name, members in groups.items():
        for r in members:
            if not r["ok"] and r["fully_specified"]:
                problems.append(f"{r['id']}: batch limit {r['predicted']}, published {r['measured']}")
        members = sorted(members, key=lambda r: r["record"].get("order", 0))
        for a, b in zip(members, members[1:]):
            published = (a["measured"] > b["measured"]) - (a["measured"] < b["measured"])
            predicted = (a["predicted"] > b["predicted"]) - (a["predicted"] < b["predicted"])
            if published != predicted:
                problems.append(f"{name}: {a['id']} ({a['predicted']}) vs {b['id']} "
                                f"({b['predicted']}) is out of the published order "
                                f"({a['measured']} vs {b['measured']})")
    ratios = {}
    for r in rows:
        if "error" in r and r["record"].get("ratio_group"):
            ratios.setdefault(r["record"]["ratio_group"], []).append(r)
    for name, members in ratios.items():
        base, *others = members
        for r in others:
            published = r["measured"] / base["measured"]
            predicted = r["predicted"] / base["predicted"]
            r["ratio"] = (predicted, published)
            if abs(predicted / published - 1) > r["tolerance"]:
                problems.append(f"{name}: {r['id']} / {base['id']} predicted {predicted:.3f}, "
                                f"published {published:.3f}")
    return problems


def fmt(v, kind):
    if kind == "max_micro_batch":
        return f"{v:>9}"
    return f"{v / 2**30:9.2f}"


def print_table(rows, problems):
    print(f"{'record':38} {'measured':>9} {'predicted':>9} {'error':>7}  what (GiB unless a batch)")
    for r in rows:
        kind = r["kind"]
        if "error" in r:
            tag = "" if r["fully_specified"] else "  (not fully specified)"
            if "ratio" in r:
                tag += f"  ratio {r['ratio'][0]:.3f} vs {r['ratio'][1]:.3f}"
            print(f"{r['id']:38} {fmt(r['measured'], kind)} {fmt(r['predicted'], kind)} "
                  f"{r['error']:+7.1%}  {kind}, peak in {r['phase']}{tag}")
        elif kind in ("oom", "fits"):
            print(f"{r['id']:38} {kind:>9} {r['verdict']:>9} {'ok' if r['ok'] else 'WRONG':>7}  "
                  f"verdict ({r['predicted'] / 2**30:.2f} GiB predicted of "
                  f"{r['record']['hardware']['gpu_memory_bytes'] / 2**30:.0f})")
        else:
            print(f"{r['id']:38} {fmt(r['measured'], kind)} {fmt(r['predicted'], kind)} "
                  f"{r['predicted'] - r['measured']:+7d}  max micro-batch "
                  f"({r['record'].get('order_group')} #{r['record'].get('order')})")
    stepped = [r for r in rows if "step_error" in r]
    if stepped:
        # The step model (op by op, held to the traced grid) beside the itemised peak, where it
        # runs and the record reports max_memory_allocated: a check of the step model against
        # real runs, not part of the acceptance.
        print(f"\nstep model beside it ({len(stepped)} max_memory_allocated rows it runs):")
        for r in stepped:
            print(f"  {r['id']:36} {fmt(r['measured'], r['kind'])} {fmt(r['step_predicted'], r['kind'])} "
                  f"{r['step_error']:+7.1%}")
        print(f"  median |error| {statistics.median(abs(r['step_error']) for r in stepped):.1%}")
    exact = [r for r in rows if "error" in r and r["fully_specified"]]
    if exact:
        errors = [abs(r["error"]) for r in exact]
        worst = max(exact, key=lambda r: abs(r["error"]))
        print(f"\nfully specified peak rows: {len(exact)}; median |error| "
              f"{statistics.median(errors):.1%}; worst {worst['id']} {worst['error']:+.1%}")
    print("acceptance holds: median, tolerances, verdicts, batch limits and orders"
          if not problems else "\n".join(["NOT MET:"] + problems))


def self_test():
    """judge() must catch each kind of failure the acceptance names; returns the failures."""
    def peak(rid, err, fully=True, tol=DEFAULT_TOLERANCE):
        return {"id": rid, "kind": "max_memory_allocated", "fully_specified": fully,
                "tolerance": tol, "error": err, "measured": 100.0, "predicted": 100.0 * (1 + err),
                "record": {}}
    def limit(rid, measured, predicted, order, fully=False):
        return {"id": rid, "kind": "max_micro_batch", "fully_specified": fully,
                "tolerance": DEFAULT_TOLERANCE, "measured": measured, "predicted": predicted,
                "ok": abs(predicted - measured) <= 1, "record": {"order_group": "g", "order": order}}
    def verdict(rid, kind, predicted):
        return {"id": rid, "kind": kind, "verdict": predicted, "ok": kind == predicted,
                "record": {}}
    good = [peak("a", 0.01), peak("b", -0.02), peak("c", 0.03), limit("d", 5, 6, 1),
            limit("e", 9, 8, 2), verdict("f", "oom", "oom")]
    cases = {
        "passes": (good, None),
        "median": ([peak("a", 0.06), peak("b", -0.07), peak("c", 0.01)], "median"),
        "tolerance": (good + [peak("x", 0.12)], "beyond 10%"),
        "own tolerance": (good + [peak("x", 0.04, tol=0.03)], "beyond 3%"),
        "verdict": (good + [verdict("x", "fits", "oom")], "predicted oom"),
        "limit": (good + [limit("x", 12, 14, 3, fully=True)], "batch limit"),
        "order": ([limit("d", 5, 9, 1), limit("e", 9, 8, 2)], "out of the published order"),
    }
    failures = []
    for name, (rows, expect) in cases.items():
        problems = judge([dict(r) for r in rows])
        if expect is None and problems:
            failures.append(f"{name}: unexpected {problems}")
        if expect is not None and not any(expect in p for p in problems):
            failures.append(f"{name}: no problem mentioning '{expect}' in {problems}")
    return failures


def find_memplan(given):
    for c in [given, os.path.join(ROOT, "build/tools/memplan")]:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit("memplan binary not found; pass --memplan PATH")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--memplan", default=None)
    ap.add_argument("--records", default=os.path.join(ROOT, "tests/accuracy/published.json"))
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when any part of the acceptance fails")
    ap.add_argument("--strict", action="store_true", help="the same as --check")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--self-test", action="store_true",
                    help="check that the acceptance catches each kind of failure, then exit")
    args = ap.parse_args()
    if args.self_test:
        failures = self_test()
        print("\n".join(failures) if failures else "self-test: every kind of failure is caught")
        sys.exit(1 if failures else 0)
    memplan = find_memplan(args.memplan)
    rows = evaluate(memplan, load_records(args.records))
    problems = judge(rows)
    if args.json:
        for r in rows:
            r.pop("record")
        print(json.dumps({"rows": rows, "problems": problems}, indent=2))
    else:
        print_table(rows, problems)
    if (args.check or args.strict) and problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
