#!/usr/bin/env bash
# Wall-clock latency of `memplan estimate` for every built-in model (process start to exit, text
# output to /dev/null): the whole cost a user or a script pays per call. Prints mean, min and max
# over N runs per model, in milliseconds. Usage: bench/estimate_latency.sh [build dir] [runs]
set -euo pipefail
build=${1:-build}
runs=${2:-50}
memplan="$build/tools/memplan"
[ -x "$memplan" ] || { echo "no $memplan: build first (scripts/setup.sh)" >&2; exit 1; }
models=$("$memplan" models --format json | python3 -c 'import json,sys; print(" ".join(m["name"] for m in json.load(sys.stdin)))')
printf '%-18s %8s %8s %8s  (ms, %d runs, --gpus 4)\n' model mean min max "$runs"
for m in $models; do
  stats=()
  for ((i = 0; i < runs; i++)); do
    t0=$(date +%s%N)
    "$memplan" estimate --model "$m" --gpus 4 >/dev/null
    t1=$(date +%s%N)
    stats+=($(((t1 - t0) / 1000)))
  done
  printf '%s\n' "${stats[@]}" | awk -v m="$m" '
    NR == 1 { min = $1; max = $1 }
    { s += $1; if ($1 < min) min = $1; if ($1 > max) max = $1 }
    END { printf "%-18s %8.2f %8.2f %8.2f\n", m, s / NR / 1000, min / 1000, max / 1000 }'
done
