#!/usr/bin/env bash
# Builds memplan with warnings as errors and runs the whole test suite, including the oracle test
# against Hugging Face Transformers (its Python environment is created in ./.venv by
# scripts/python-env.sh), then runs the concurrent NVMe engine and CPU optimizer tests again under ThreadSanitizer.
# Run scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."

python=$(bash scripts/python-env.sh)
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEMPLAN_WERROR=ON \
  -DMEMPLAN_PYTHON="$python" >/dev/null
cmake --build build -j"$jobs"
(cd build && ctest --output-on-failure -j"$jobs" --timeout 600)

# The nvme backends, IoEngine and SwapStore, and the CPU optimizer's thread pool, are used from
# many threads at once.
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DMEMPLAN_SANITIZE=thread -DMEMPLAN_WERROR=ON \
  >/dev/null
cmake --build build-tsan -j"$jobs" --target nvme_test offload_test
(cd build-tsan && TSAN_OPTIONS="halt_on_error=1" ctest --output-on-failure -R '^(nvme|offload)_test$')
