#!/usr/bin/env bash
# Installs the built memplan into a temporary prefix, builds tests/consumer against it with
# find_package(memplan), and runs it. Usage: run.sh <memplan build dir> <consumer source dir>
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
