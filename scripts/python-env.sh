#!/usr/bin/env bash
# Makes the Python environment the oracle test (tests/oracle/) runs in, and prints its python.
#
#   PY=$(scripts/python-env.sh)          # progress goes to stderr, only the path to stdout
#   cmake -S . -B build -DMEMPLAN_PYTHON="$PY"
#
# Steps, each skipped when already done (so running it again is cheap and changes nothing):
#   1. Debian packages python3-venv, python3-torch (1.13, CPU only, with python3-numpy) and
#      libopenblas0-pthread (the BLAS torch calls), through
#      sudo when not root; `apt-get update` runs only when one of them is missing.
#   2. A virtual environment at $MEMPLAN_VENV (default: <repo>/.venv) made with
#      --system-site-packages, so it sees Debian's torch and numpy instead of downloading PyPI's.
#   3. The pinned packages of tests/oracle/requirements.txt (Transformers, DeepSpeed and what they
#      need),
#      skipped when the same requirements were installed before and still import.
#   4. Prints the environment's python.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${MEMPLAN_VENV:-$root/.venv}
requirements=$root/tests/oracle/requirements.txt
system_python=/usr/bin/python3   # Debian's; a pyenv or other python3 earlier on PATH has no torch
# libopenblas0-pthread: Debian's torch calls the system BLAS, which is otherwise the slow reference one
# (2 GFLOP/s here instead of 15); installing OpenBLAS switches libblas.so.3 to it.
packages=(python3-venv python3-torch libopenblas0-pthread)

log() { printf 'python-env: %s\n' "$*" >&2; }
fail() { log "error: $*"; exit 1; }

# ---- 1. Debian packages --------------------------------------------------------------------------
missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$package")
  fi
done
if ((${#missing[@]})); then
  command -v apt-get >/dev/null || fail "apt-get not found; install ${missing[*]} by hand"
  sudo=()
  if [[ $(id -u) != 0 ]]; then
    command -v sudo >/dev/null || fail "not root and no sudo: install ${missing[*]} as root"
    sudo=(sudo)
  fi
  log "installing ${missing[*]}"
  "${sudo[@]}" apt-get update -q >&2
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi
[[ -x $system_python ]] || fail "$system_python not found"

# ---- 2. the virtual environment ------------------------------------------------------------------
venv_ok() {
  [[ -x $venv/bin/python && -f $venv/pyvenv.cfg ]] &&
    grep -Eq '^include-system-site-packages *= *true' "$venv/pyvenv.cfg"
}
if ! venv_ok; then
  if [[ -e $venv ]]; then
    log "$venv is not a usable --system-site-packages environment with torch; making it again"
    rm -rf "$venv"
  fi
  log "creating $venv"
  "$system_python" -m venv --system-site-packages "$venv" >&2
  "$venv/bin/python" -c 'import torch' >&2 || fail "the new environment at $venv cannot import torch"
fi
python=$venv/bin/python

# ---- 3. pinned packages --------------------------------------------------------------------------
stamp=$venv/.memplan-oracle-requirements
check='import torch, transformers, tokenizers, safetensors, deepspeed, scikit_build_core
print(f"torch {torch.__version__}, transformers {transformers.__version__}, deepspeed {deepspeed.__version__}")'
if [[ -f $stamp ]] && cmp -s "$requirements" "$stamp" && versions=$("$python" -c "$check" 2>/dev/null); then
  log "requirements already installed ($(basename "$requirements"))"
else
  log "installing $(basename "$requirements") into $venv"
  # DeepSpeed ships an sdist whose setup.py imports torch (so no build isolation) and would
  # compile its CUDA/C++ ops unless told not to (DS_BUILD_OPS=0: ops are JIT-built if ever used).
  DS_BUILD_OPS=0 "$python" -m pip install --disable-pip-version-check --no-input -q \
    --no-build-isolation -r "$requirements" >&2
  versions=$("$python" -c "$check") || fail "torch, transformers or deepspeed does not import in $venv after installing"
  cp "$requirements" "$stamp"
fi

# ---- 4. the python to use ------------------------------------------------------------------------
log "ready: $versions"
printf '%s\n' "$python"
