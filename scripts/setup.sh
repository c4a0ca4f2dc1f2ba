#!/usr/bin/env bash
# Installs what memplan needs on Debian 12 (idempotent; uses sudo when not root) and builds it into
# ./build. Usage: scripts/setup.sh [extra cmake -D options...]
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake ninja-build pkg-config git nlohmann-json3-dev libcli11-dev doctest-dev
  liburing-dev libaio-dev libxxhash-dev libboost-dev fio
  # libcurl: `--model org/name` fetches config.json (and safetensors headers) from the Hub.
  libcurl4-openssl-dev
  # Eigen: the least-squares fit of `memplan calibrate` (planner/calibrate.cc).
  libeigen3-dev
  # libyaml: `memplan check` reads Accelerate's YAML config files (tools/yaml_json.cc).
  libyaml-dev
  # The Python extension (memplan._native): pybind11 and Python's headers.
  pybind11-dev python3-dev
  # clang with its sanitizer and libFuzzer runtimes: scripts/test.sh's sanitizer job and fuzz smoke.
  clang libclang-rt-dev
  # clang-format: scripts/test.sh checks the C and C++ files' format (scripts/format.sh --check).
  clang-format
  # valgrind: tests/reliability_cli_test.cc checks a reproduction with it (skipped without).
  valgrind)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "memplan setup: installing ${missing[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

jobs=$(nproc 2>/dev/null || echo 2)
# Warnings are errors, as in scripts/test.sh: the same flags mean the test run reuses this build
# instead of compiling everything again (pass -DMEMPLAN_WERROR=OFF to relax it).
# Release at -O2 (RelWithDebInfo's optimisation without the debug info: a third less compile
# time; GCC 12's -O3 raises false -Wrestrict errors in libstdc++'s string code). A unity build:
# the libraries' files compiled eight to a translation unit, a third less compile time for them
# (Note [Unity builds] in cmake/MemplanOptions.cmake).
# Ninja, not Make: Make starts no file of a target before the libraries it links are linked,
# and with two cores a cold build then waits on one long file (docs/testing.md, "Build time").
# A build directory configured before keeps its generator (CMake cannot change it).
generator=(-G Ninja)
[[ -f build/CMakeCache.txt ]] || ! command -v ninja >/dev/null && generator=()
cmake -S . -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" -DCMAKE_C_FLAGS_RELEASE="-O2 -DNDEBUG" \
  -DMEMPLAN_WERROR=ON -DCMAKE_UNITY_BUILD=ON "$@" >/dev/null
cmake --build build -j"$jobs"
echo "memplan setup: built build/tools/memplan" >&2
