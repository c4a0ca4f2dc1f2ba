#!/usr/bin/env bash
# Installs the built memplan into a temporary prefix, checks that the headers installed are exactly
# public_headers.txt (Note [Public headers] in the top-level CMakeLists.txt), builds tests/consumer
# against it with find_package(memplan) (every installed header included too), and runs it; then,
# where the C API is built, builds c_main.c with the flags pkg-config gives for the installed
# memplan.pc, and runs it.
# Usage: run.sh <memplan build dir> <consumer source dir>
set -euo pipefail
build=$1
src=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/memplan-consumer.XXXXXX")
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
installed=$(cd "$work/prefix/include/memplan" && find . -name '*.h' | sed 's|^\./||' | LC_ALL=C sort)
if ! diff -u <(LC_ALL=C sort "$src/public_headers.txt") <(printf '%s\n' "$installed"); then
  echo "the installed headers (+) differ from tests/consumer/public_headers.txt (-)" >&2
  exit 1
fi
cmake -S "$src" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/consumer"
test -x "$work/prefix/bin/memplan"
pc=$(find "$work/prefix" -name memplan.pc -print -quit)
if [[ -n $pc ]]; then
  export PKG_CONFIG_PATH=$(dirname "$pc")
  # shellcheck disable=SC2046  # word splitting of the flags is wanted
  cc -std=c11 -Wall -Werror -o "$work/c_consumer" "$src/c_main.c" $(pkg-config --cflags --libs memplan)
  LD_LIBRARY_PATH=$(pkg-config --variable=libdir memplan) "$work/c_consumer"
fi
