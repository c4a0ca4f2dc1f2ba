#!/usr/bin/env bash
# Formats every C and C++ file git tracks with clang-format and the project's .clang-format, or,
# with --check, lists the files that are not formatted and exits 1 (scripts/test.sh runs this).
# Usage: scripts/format.sh [--check]
set -euo pipefail
cd "$(dirname "$0")/.."
clang_format=$(command -v clang-format-14 || command -v clang-format || true)
if [[ -z $clang_format ]]; then
  echo "format.sh: clang-format is not installed (scripts/setup.sh installs it)" >&2
  exit 2
fi
mapfile -t files < <(git ls-files -- '*.cc' '*.h' '*.c' '*.cu' | grep -v -E '^(fuzz/corpus|fuzz/regressions)/')
if [[ ${1:-} == --check ]]; then
  bad=()
  for f in "${files[@]}"; do
    "$clang_format" --style=file --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
  done
  if ((${#bad[@]})); then
    printf '%s\n' "${bad[@]}" >&2
    echo "format.sh: ${#bad[@]} file(s) are not formatted; run scripts/format.sh" >&2
    exit 1
  fi
  echo "format.sh: ${#files[@]} files formatted"
else
  "$clang_format" --style=file -i "${files[@]}"
fi
