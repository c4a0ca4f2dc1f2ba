#!/usr/bin/env bash
# `pip install .` end to end: builds memplan's wheel with scikit-build-core (no build isolation, so
# Debian's pybind11 and the environment's scikit-build-core are used and nothing is downloaded),
# installs it into a scratch virtual environment on top of $PYTHON's packages, and checks that the
# installed package answers like the CLI. Usage: wheel_test.sh PYTHON MEMPLAN_BINARY SOURCE_DIR
set -euo pipefail
python=$1
memplan=$2
source_dir=$3
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

"$python" -m pip wheel --no-build-isolation --no-deps --disable-pip-version-check -q \
  -w "$scratch/dist" --config-settings=build-dir="$scratch/build" "$source_dir"
wheel=$(ls "$scratch"/dist/memplan-*.whl)
echo "built $(basename "$wheel")"
"$python" -m venv --system-site-packages "$scratch/venv"
"$scratch/venv/bin/python" -m pip install --no-deps --disable-pip-version-check -q "$wheel"
cd "$scratch"  # not the source tree, so the installed package is the one imported
"$scratch/venv/bin/python" - "$memplan" <<'PY'
import json, subprocess, sys
import memplan, memplan.torch
assert memplan.__file__.startswith(sys.prefix), memplan.__file__
cli = json.loads(subprocess.run([sys.argv[1], "estimate", "--model", "llama-2-7b", "--gpus", "4",
                                 "--format", "json"], check=True, capture_output=True,
                                text=True).stdout)
assert memplan.estimate("llama-2-7b", gpus=4) == cli
print("installed memplan", memplan.__version__, "from", memplan.__file__, "answers as the CLI")
PY
# The wheel's `memplan` command: the same answers as the build's CLI, and its exit statuses.
test -x "$scratch/venv/bin/memplan"
diff <("$scratch/venv/bin/memplan" estimate --model gpt2 --gpus 4 --format json) \
  <("$memplan" estimate --model gpt2 --gpus 4 --format json)
if "$scratch/venv/bin/memplan" estimate --model no-such-model-xyz 2>/dev/null; then
  echo "wheel: memplan accepted an unknown model" >&2
  exit 1
fi
echo "installed memplan command answers as the CLI"
