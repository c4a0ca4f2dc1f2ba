#!/usr/bin/env bash
# One command for the day a GPU is lent: builds memplan with the real CUDA runtime and NCCL and runs
# everything that needs a GPU, then writes one report (JSON and a table).
#
#   bash scripts/gpu-verify.sh [report-dir]          # default report dir: gpu-verify/
#
#   1. offload_gpu_test: the CUDA runtime, the NCCL collective, and the engine on the GPU, bit for
#      bit against the host-only engine (fp32 and bf16, cpu and nvme tiers; ZeRO-3 over NCCL when
#      the machine has two GPUs). The same tests run on the emulated GPU in scripts/test.sh.
#   2. the PyTorch adapter's CUDA path: examples/train_gpt.py --device cuda --compare (the losses of
#      a GPT trained through memplan.torch against torch.optim.AdamW on the same GPU);
#   3. bench/measure_peak.py over the published-measurement records (tests/accuracy/published.json):
#      each setup this GPU can run is trained again and its peak written as a record of the same
#      format to the report's measured_records.json, which bench/accuracy.py then sets against
#      memplan's predictions (measured_vs_memplan.json), beside its table for the published rows.
#
# Needs the README's set-up (bash scripts/setup.sh) on a machine with an NVIDIA GPU, its driver,
# the CUDA toolkit and NCCL. Exits 77 with a one-line reason where there is no GPU, 1 when a check
# failed, 0 when all passed. Step 2 and 3 need a CUDA build of torch; scripts/python-env.sh
# --modern installs one (PyPI's), and a step without it is reported as skipped.
set -uo pipefail
cd "$(dirname "$0")/.."

report_dir=${1:-gpu-verify}
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu-verify: skipped: no GPU (nvidia-smi not found)"
  exit 77
fi
if ! gpus=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null) ||
  [[ -z $gpus ]]; then
  echo "gpu-verify: skipped: no GPU (nvidia-smi lists none)"
  exit 77
fi

mkdir -p "$report_dir"
report_dir=$(cd "$report_dir" && pwd)
log="$report_dir/log.txt"
: >"$log"
results=()  # name|status|seconds|detail

record() {  # name status seconds detail
  results+=("$1|$2|$3|$4")
  printf 'gpu-verify: %-22s %-7s %6ss  %s\n' "$1" "$2" "$3" "$4"
}

# run NAME COMMAND...: runs COMMAND, logging its output; exit 77 means skipped.
run() {
  local name=$1
  shift
  local start=$SECONDS
  echo "==== $name: $*" >>"$log"
  "$@" >>"$log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  local last
  last=$(tail -n 1 "$log" | tr '|' '/' | cut -c1-160)
  [[ $last == "==== $name:"* ]] && last="output in $report_dir"
  case $rc in
    0) record "$name" pass "$took" "$last" ;;
    77) record "$name" skipped "$took" "$last" ;;
    *) record "$name" FAIL "$took" "exit $rc: $last (see $log)" ;;
  esac
  return 0
}

python=$(bash scripts/python-env.sh 2>>"$log")
modern_python=$(bash scripts/python-env.sh --modern 2>>"$log")
jobs=$(nproc 2>/dev/null || echo 2)

start=$SECONDS
if cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" \
  -DMEMPLAN_WITH_CUDA=ON -DMEMPLAN_WITH_NCCL=ON -DMEMPLAN_PYTHON="$python" \
  -DMEMPLAN_MODERN_PYTHON="$modern_python" >>"$log" 2>&1 &&
  cmake --build build-gpu -j"$jobs" --target offload_gpu_test memplan memplan_python >>"$log" 2>&1
then
  record build pass $((SECONDS - start)) "build-gpu: CUDA and NCCL"
else
  record build FAIL $((SECONDS - start)) "cmake with MEMPLAN_WITH_CUDA=ON MEMPLAN_WITH_NCCL=ON failed (see $log)"
fi

if [[ -x build-gpu/offload/offload_gpu_test ]]; then
  run offload_gpu_test build-gpu/offload/offload_gpu_test
fi

# A Python whose torch sees the GPU (the modern venv's PyPI torch, usually).
cuda_python=""
for p in "$modern_python" "$python"; do
  if [[ -n $p ]] && "$p" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    >/dev/null 2>&1; then
    cuda_python=$p
    break
  fi
done
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
if [[ -z $cuda_python ]]; then
  record train_gpt_cuda skipped 0 "no Python with a CUDA torch (bash scripts/python-env.sh --modern)"
  record measure_peak skipped 0 "no Python with a CUDA torch"
else
  run train_gpt_cuda env PYTHONPATH=build-gpu/python "$cuda_python" examples/train_gpt.py \
    --device cuda --compare --nvme "$scratch/swap" --steps 20 --json "$report_dir/train_gpt.json"
  # The published setups this GPU can run, measured again and written as records of the same
  # format to the report (never into the repository's records), then judged as any record is.
  run measure_peak "$cuda_python" bench/measure_peak.py --memplan build-gpu/tools/memplan \
    --append "$report_dir/measured_records.json"
  if [[ -f $report_dir/measured_records.json ]]; then
    run measured_records bash -c '"$0" bench/accuracy.py --memplan build-gpu/tools/memplan \
      --records "$1/measured_records.json" --json >"$1/measured_vs_memplan.json"' \
      "${python:-python3}" "$report_dir"
  fi
fi
if [[ -f tests/accuracy/published.json && -f bench/accuracy.py ]]; then
  run published_records bash -c '"$0" bench/accuracy.py --memplan build-gpu/tools/memplan \
    --records tests/accuracy/published.json --json >"$1/published_records.json"' \
    "${python:-python3}" "$report_dir"
fi

# The report: one JSON document and the same as a table.
{
  printf '{"gpus": %s, "results": [' "$(printf '%s' "$gpus" | "${python:-python3}" -c \
    'import json, sys; print(json.dumps([l.strip() for l in sys.stdin if l.strip()]))')"
  sep=""
  for r in "${results[@]}"; do
    IFS='|' read -r name status took detail <<<"$r"
    printf '%s{"check": "%s", "status": "%s", "seconds": %s, "detail": %s}' "$sep" "$name" \
      "$status" "$took" "$(printf '%s' "$detail" | "${python:-python3}" -c \
      'import json, sys; print(json.dumps(sys.stdin.read()))')"
    sep=", "
  done
  printf ']}\n'
} >"$report_dir/report.json"
{
  echo "GPU: $gpus"
  printf '%-22s %-8s %8s  %s\n' check status seconds detail
  for r in "${results[@]}"; do
    IFS='|' read -r name status took detail <<<"$r"
    printf '%-22s %-8s %8s  %s\n' "$name" "$status" "$took" "$detail"
  done
} >"$report_dir/report.txt"
cat "$report_dir/report.txt"
echo "gpu-verify: report in $report_dir/report.json and report.txt; logs in $log"
for r in "${results[@]}"; do
  [[ $r == *"|FAIL|"* ]] && exit 1
done
exit 0
