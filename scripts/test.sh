#!/usr/bin/env bash
# Checks the C and C++ files' format; runs the concurrent NVMe engine and CPU optimizer tests
# under ThreadSanitizer together with the GPU path on the emulated GPU (tests/gpu_emulation), then
# the unit tests under AddressSanitizer + UndefinedBehaviorSanitizer and every fuzz target for a
# few seconds (fuzz/), all while the Python environments are made (./.venv and ./.venv-modern,
# scripts/python-env.sh); then builds memplan with warnings as errors and runs the whole test
# suite, including the oracle tests against Hugging Face Transformers and DeepSpeed.
# Run scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."

# Tests never reach the network: a run of memplan that would fetch from the Hugging Face Hub is
# refused instead (the Hub's own tests set up a loopback server and clear this).
export HF_HUB_OFFLINE=1

# The house format (.clang-format), checked first: it takes two seconds.
bash scripts/format.sh --check

jobs=$(nproc 2>/dev/null || echo 2)
# Ninja for a new build directory (as scripts/setup.sh); one configured before keeps its generator.
generator() { [[ -f $1/CMakeCache.txt ]] || ! command -v ninja >/dev/null || echo "-GNinja"; }
scratch=$(mktemp -d)
python_envs=""
trap '[[ -n $python_envs ]] && { kill -- -"$python_envs" || kill "$python_envs"; } 2>/dev/null
  rm -rf "$scratch"' EXIT

# The Python environments are made while the two sanitizer builds below compile and test: on a
# new machine they download and unpack about 6 GB (the network's and the disk's time more than
# the CPU's), which would otherwise hold up everything else. The Release tests, which use them,
# come last; where the environments exist already, this takes seconds. In a session of its own, so
# that a failure before it is done stops pip too (the EXIT trap).
setsid bash -c 'bash scripts/python-env.sh > "$1/python" &&
  bash scripts/python-env.sh --modern > "$1/modern-python"' _ "$scratch" \
  2> "$scratch/python-env.log" &
python_envs=$!

# The nvme backends, IoEngine and SwapStore, the host-only GPU runtime's copy threads (gpu/), the
# NVMe bench's sweep (bench/), and the CPU optimizer's thread pool, are used from many threads at
# once. The same build is the GPU emulation build (tests/gpu_emulation/README.md): the real CUDA
# runtime, NCCL collective, engine and C API run on an emulated CUDA and NCCL, whose streams are
# threads, so ThreadSanitizer also sees the GPU path's ordering. It needs the CUDA and NCCL
# headers (not a GPU); without them those tests are left out, and said so.
gpu_emulation=OFF
gpu_targets=()
gpu_tests=""
have_header() {  # have_header NAME: in one of the places CMake looks for CUDA and NCCL
  local dir
  for dir in /usr/local/cuda/include /usr/local/include /usr/include; do
    [[ -f $dir/$1 ]] && return 0
  done
  return 1
}
if have_header cuda_runtime_api.h && have_header nccl.h; then
  gpu_emulation=ON
  gpu_targets=(offload_gpu_test gpu_emulation_test c_api_emulated_test)
  gpu_tests="|offload_gpu_test|gpu_emulation_test|c_api_emulated_test"
else
  echo "test.sh: no CUDA/NCCL headers: the emulated GPU tests are skipped" >&2
fi
cmake -S . -B build-tsan $(generator build-tsan) -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
  -DCMAKE_C_FLAGS_DEBUG="-O1 -g1" -DMEMPLAN_SANITIZE=thread -DMEMPLAN_WERROR=ON -DCMAKE_UNITY_BUILD=ON \
  -DMEMPLAN_GPU_EMULATION="$gpu_emulation" >/dev/null
cmake --build build-tsan -j"$jobs" --target nvme_test gpu_test bench_test offload_test \
  "${gpu_targets[@]}"
(cd build-tsan && TSAN_OPTIONS="halt_on_error=1" ctest --output-on-failure -j"$jobs" \
  -R "^(nvme_test|gpu_test|bench_test|offload_test$gpu_tests)\$")

# AddressSanitizer + UndefinedBehaviorSanitizer on the unit tests (which include every fuzz seed
# and regression input, tests/fuzz_regressions_test.cc). Built with clang at -O1 so the libFuzzer
# targets share the build; MEMPLAN_SANITIZE compiles with -fno-sanitize-recover=all, so any report
# fails the test that triggered it.
# Note [CI time]: a cold `.ci/run` (scripts/setup.sh, then this script) took 40 minutes on two
# cores at the end of November 2026: the Release build 11, the ThreadSanitizer build 8 and its
# tests 1.5, the clang build below 11.5 and its tests 1.3, the fuzz smoke 0.6 and the Release
# tests 6. The Python environments' download took 6 of the ThreadSanitizer build's 8 minutes
# there; on a slower network it also overlaps the clang build, which comes before the Release
# tests for that reason. What has been cut:
# - the clang build's test files (fifty-odd, against a dozen library units) compile at -O0, in
#   half the CPU of -O1, and its unit tests then run in about twice their minute
#   (MEMPLAN_TEST_COMPILE_OPTIONS, the top-level CMakeLists.txt);
# - the unit tests' scale cases (a 10 MB config, a 50k-tensor header, the estimator's linear-time
#   checks) run a tenth of their size, or fewer timed repeats, under a sanitizer
#   (testing::kSanitizerBuild): they check memory there, and the Release suite checks their time.
#   estimator_test went from 101 s to 38 s here;
# - the ThreadSanitizer build compiles neither the estimator nor the planner: the C API's emulated
#   test links the API's engine half alone (tests/gpu_emulation/CMakeLists.txt). Cold, on a quiet
#   machine, that build went from 5.2 to 3.3 minutes (9.7 to 6.1 minutes of CPU).
cmake -S . -B build-san $(generator build-san) -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -gline-tables-only" \
  -DCMAKE_C_FLAGS_DEBUG="-O1 -gline-tables-only" -DMEMPLAN_SANITIZE="address;undefined" \
  -DMEMPLAN_FUZZ=ON -DMEMPLAN_WITH_CUDA=OFF -DMEMPLAN_WERROR=ON -DCMAKE_UNITY_BUILD=ON \
  -DMEMPLAN_TEST_COMPILE_OPTIONS=-O0 >/dev/null
fuzz_targets=(hf_config shape_list safetensors deepspeed_config deepspeed_check swap_index cli
  check_arithmetic launch_script accelerate_check)
unit_tests=$(cd build-san && ctest -N -L unit | sed -n 's/^ *Test *#[0-9]*: //p')
cmake --build build-san -j"$jobs" --target $unit_tests "${fuzz_targets[@]/%/_fuzz}"
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:abort_on_error=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
(cd build-san && ctest --output-on-failure -j"$jobs" -L unit --timeout 600)

# Fuzz smoke: each target for a few seconds from its seed corpus (new inputs go to a scratch
# directory, never into the checked-in corpus). Long runs: fuzz/README.md.
fuzz_seconds=${MEMPLAN_FUZZ_SECONDS:-10}
fuzz_one() {  # fuzz_one TARGET: runs it, says how many inputs it ran; fails on a crash
  local t=$1 runs
  mkdir -p "$scratch/$t"
  if ! build-san/fuzz/"${t}_fuzz" -max_total_time="$fuzz_seconds" -rss_limit_mb=2048 \
    -timeout=10 -artifact_prefix="build-san/fuzz-$t-" -print_final_stats=1 "$scratch/$t" \
    "fuzz/corpus/$t" 2>"$scratch/$t.log"; then
    tail -n 50 "$scratch/$t.log"
    echo "fuzz smoke: $t failed; the input is build-san/fuzz-$t-*" >&2
    return 1
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$scratch/$t.log")
  echo "fuzz smoke: $t: $runs runs in ${fuzz_seconds} s, no crash"
}
# One target per core at a time (each fuzzes on one thread).
running=0
failed=0
for t in "${fuzz_targets[@]}"; do
  if ((running >= jobs)); then
    wait -n || failed=1
    running=$((running - 1))
  fi
  fuzz_one "$t" &
  running=$((running + 1))
done
while ((running > 0)); do
  wait -n || failed=1
  running=$((running - 1))
done
((failed == 0)) || exit 1

# The Release build (scripts/setup.sh built it; this configures the Python tests) and the whole
# suite but the wheel.
if ! wait "$python_envs"; then
  cat "$scratch/python-env.log" >&2
  echo "test.sh: the Python environments could not be made (scripts/python-env.sh, above)" >&2
  exit 1
fi
python_envs=""
cat "$scratch/python-env.log" >&2
python=$(<"$scratch/python")
modern_python=$(<"$scratch/modern-python")
cmake -S . -B build $(generator build) -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" \
  -DCMAKE_C_FLAGS_RELEASE="-O2 -DNDEBUG" -DMEMPLAN_WERROR=ON -DCMAKE_UNITY_BUILD=ON \
  -DMEMPLAN_PYTHON="$python" -DMEMPLAN_MODERN_PYTHON="$modern_python" >/dev/null
cmake --build build -j"$jobs"
# The wheel test (`pip install .`, tests/python/wheel_test.sh) compiles the libraries a second
# time, so it runs only when asked: MEMPLAN_TEST_WHEEL=1 bash scripts/test.sh.
skip_wheel=(-LE wheel)
[[ ${MEMPLAN_TEST_WHEEL:-0} == 1 ]] && skip_wheel=()
(cd build && ctest --output-on-failure -j"$jobs" --timeout 600 "${skip_wheel[@]}")
