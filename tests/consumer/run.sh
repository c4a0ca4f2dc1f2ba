#!/usr/bin/env bash
# Installs the built memplan into a temporary prefix, builds tests/consumer against it with
# find_package(memplan), and runs it; then, where the C API is built, builds c_main.c with the
# flags pkg-config gives for the installed memplan.pc, and runs it.
# Usage: run.sh <memplan build dir> <consumer source dir>
set -euo pipefail
build=$1
src=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/memplan-consumer.XXXXXX")
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/consumer"
test -x "$work/prefix/bin/memplan"
test -f "$work/prefix/include/memplan/estimator/inventory.h"
pc=$(find "$work/prefix" -name memplan.pc -print -quit)
if [[ -n $pc ]]; then
  export PKG_CONFIG_PATH=$(dirname "$pc")
  # shellcheck disable=SC2046  # word splitting of the flags is wanted
  cc -std=c11 -Wall -Werror -o "$work/c_consumer" "$src/c_main.c" $(pkg-config --cflags --libs memplan)
  LD_LIBRARY_PATH=$(pkg-config --variable=libdir memplan) "$work/c_consumer"
fi
