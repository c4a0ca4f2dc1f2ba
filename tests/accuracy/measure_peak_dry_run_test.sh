#!/usr/bin/env bash
# bench/measure_peak.py's record handling without a GPU: --dry-run picks the runnable published
# records, writes the records it would append (memplan's prediction standing in for the
# measurement) in the published format, and bench/accuracy.py reads them back and finds each one
# equal to memplan's prediction for the re-run's flags (the flags are rewritten for the re-run:
# no --torch-version, the context measured). With --runs it also writes the step times as
# `memplan calibrate` runs, which calibrate back to memplan's priors.
# Usage: measure_peak_dry_run_test.sh MEMPLAN
set -euo pipefail
memplan=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 "$root/bench/measure_peak.py" --memplan "$memplan" --dry-run --append "$tmp/out.json" \
  --runs "$tmp/runs.json" > "$tmp/log"
cat "$tmp/log"
# The runnable ones: the anatomy runs and torchtune's (Transformers code on one GPU).
for id in hf-anatomy-bs4 hf-anatomy-ga4 hf-anatomy-ga4-gc torchtune-llama2-7b-sgd \
          torchtune-llama2-7b-adamw; do
  grep -q "^$id .*would run" "$tmp/log" || { echo "FAIL: $id not runnable"; exit 1; }
done
grep -q "^litgpt-llama2-7b-lora-mbs1 .*not runnable: --framework litgpt" "$tmp/log" \
  || { echo "FAIL: a Lit-GPT record was taken as runnable"; exit 1; }
grep -q "^fsdp-gpt2-large-full-shard .*not runnable" "$tmp/log" \
  || { echo "FAIL: an FSDP batch-limit record was taken as runnable"; exit 1; }
python3 - "$tmp/out.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
ids = [r["id"] for r in doc["records"]]
assert len(ids) == 5 and all(i.endswith("-dry-run") for i in ids), ids
for r in doc["records"]:
    assert "--torch-version" not in r["memplan"], r["id"]
    assert r["dry_run"] is True and r["measured"]["units"] == "bytes", r["id"]
PY
python3 "$root/bench/accuracy.py" --memplan "$memplan" --records "$tmp/out.json" --check
# The step times, as `memplan calibrate` runs: memplan's own predictions stand in for the
# measurements, so calibrating on them must give back its priors exactly.
(cd "$root" && "$memplan" calibrate "$tmp/runs.json" --format json) > "$tmp/calibration.json"
python3 - "$tmp/runs.json" "$tmp/calibration.json" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))
cal = json.load(open(sys.argv[2]))
assert runs["format"] == "memplan.runs/1" and len(runs["runs"]) == 5, runs
for r in runs["runs"]:
    assert r["id"].endswith("-dry-run") and r["step_time_s"] > 0, r
    assert r["cluster"]["gpu"] == "a100-80" and r["setup"]["zero_stage"] == 0, r
assert cal["rms_error"]["fitted"] < 1e-6 and cal["rms_error"]["prior"] < 1e-6, cal["rms_error"]
assert abs(cal["gpus"]["a100-80"]["gemm_efficiency"] - 0.80) < 1e-6, cal["gpus"]
assert any(n.startswith("link_efficiency[a100-80]: no run has more than one GPU")
           for n in cal["not_determined"]), cal["not_determined"]
PY
echo "measure_peak dry run: record handling ok"
