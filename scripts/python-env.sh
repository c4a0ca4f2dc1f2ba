#!/usr/bin/env bash
# Makes one of the two Python environments the tests run in, and prints its python.
#
#   PY=$(scripts/python-env.sh)            # progress goes to stderr, only the path to stdout
#   MODERN=$(scripts/python-env.sh --modern)
#   cmake -S . -B build -DMEMPLAN_PYTHON="$PY" -DMEMPLAN_MODERN_PYTHON="$MODERN"
#
# The default environment ($MEMPLAN_VENV, default <repo>/.venv) is small: Debian's torch 1.13 with
# the Transformers 4.47 and DeepSpeed 0.16.9 that still run on it (tests/oracle/requirements.txt).
# The modern one (--modern: $MEMPLAN_MODERN_VENV, default <repo>/.venv-modern; about 5.6 GB and
# 1-3 minutes) is PyPI's torch 2.x with today's Transformers, Accelerate, PEFT and DeepSpeed
# (tests/oracle/requirements-modern.txt, pinned exactly): the oracle for model families that
# Transformers 4.47 lacks and the real peer for DeepSpeed ZeRO-3 on its CPU accelerator; and the
# training frameworks memplan.trace runs (tests/oracle/requirements-trace.txt: torchtune,
# torchtitan, LitGPT, llm-foundry, Liger-Kernel, bitsandbytes; about 0.6 GB more). It does
# not see Debian's packages (no --system-site-packages), so nothing of torch 1.13 leaks into it.
#
# Steps for the default environment, each skipped when already done (so running it again is cheap
# and changes nothing):
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
modern=0
case "${1:-}" in
  "") ;;
  --modern) modern=1 ;;
  *) printf 'usage: %s [--modern]\n' "$0" >&2; exit 2 ;;
esac
extra_requirements=
if ((modern)); then
  venv=${MEMPLAN_MODERN_VENV:-$root/.venv-modern}
  requirements=$root/tests/oracle/requirements-modern.txt
  # The frameworks memplan.trace runs (torchtune, torchtitan, LitGPT, llm-foundry's MPT, Liger,
  # bitsandbytes), pinned as one resolved set and installed with --no-deps (the file says why).
  extra_requirements=$root/tests/oracle/requirements-trace.txt
else
  venv=${MEMPLAN_VENV:-$root/.venv}
  requirements=$root/tests/oracle/requirements.txt
fi
system_python=/usr/bin/python3   # Debian's; a pyenv or other python3 earlier on PATH has no torch
# libopenblas0-pthread: Debian's torch calls the system BLAS, which is otherwise the slow reference one
# (2 GFLOP/s here instead of 15); installing OpenBLAS switches libblas.so.3 to it.
packages=(python3-venv python3-torch libopenblas0-pthread)
((modern)) && packages=(python3-venv)

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
site_packages=true
((modern)) && site_packages=false
venv_ok() {
  [[ -x $venv/bin/python && -f $venv/pyvenv.cfg ]] &&
    grep -Eq "^include-system-site-packages *= *$site_packages" "$venv/pyvenv.cfg"
}
if ! venv_ok; then
  if [[ -e $venv ]]; then
    log "$venv is not the environment this script makes; making it again"
    rm -rf "$venv"
  fi
  log "creating $venv"
  if ((modern)); then
    "$system_python" -m venv "$venv" >&2
  else
    "$system_python" -m venv --system-site-packages "$venv" >&2
    "$venv/bin/python" -c 'import torch' >&2 || fail "the new environment at $venv cannot import torch"
  fi
fi
python=$venv/bin/python

# ---- 3. pinned packages --------------------------------------------------------------------------
stamp=$venv/.memplan-oracle-requirements
check='import torch, transformers, tokenizers, safetensors, deepspeed, scikit_build_core
print(f"torch {torch.__version__}, transformers {transformers.__version__}, deepspeed {deepspeed.__version__}")'
((modern)) && check='import torch, transformers, accelerate, peft, safetensors, deepspeed
import torchtune, torchtitan, litgpt, liger_kernel, bitsandbytes, torchao
print(f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}, peft {peft.__version__}, deepspeed {deepspeed.__version__}, torchtune {torchtune.__version__}, litgpt, torchtitan, liger-kernel, bitsandbytes {bitsandbytes.__version__}")'
# DeepSpeed logs its accelerator choice to stdout on import: keep only the last line.
versions_of() { "$python" -c "$check" 2>/dev/null | tail -n 1; }
# The stamp holds the requirement files installed (both, for --modern), so a changed pin in
# either reinstalls.
wanted=$(cat "$requirements" ${extra_requirements:+"$extra_requirements"})
if [[ -f $stamp ]] && [[ "$(cat "$stamp")" == "$wanted" ]] && versions=$(versions_of) && [[ -n $versions ]]; then
  log "requirements already installed ($(basename "$requirements"))"
else
  log "installing $(basename "$requirements") into $venv"
  pip=("$python" -m pip install --disable-pip-version-check --no-input -q)
  # DeepSpeed ships an sdist whose setup.py imports torch (so no build isolation, and torch must be
  # there first) and would compile its CUDA/C++ ops unless told not to (DS_BUILD_OPS=0: ops are
  # JIT-built if ever used).
  if ((modern)); then
    torch_pin=$(grep -E '^torch==' "$requirements") || fail "no torch== pin in $requirements"
    "${pip[@]}" "$torch_pin" >&2
  fi
  DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation -r "$requirements" >&2
  if [[ -n $extra_requirements ]]; then
    log "installing $(basename "$extra_requirements") into $venv (--no-deps)"
    "${pip[@]}" --no-deps -r "$extra_requirements" >&2
  fi
  "$python" -c "$check" >/dev/null || fail "a required package does not import in $venv after installing"
  versions=$(versions_of)
  printf '%s\n' "$wanted" > "$stamp"
fi

# ---- 4. the python to use ------------------------------------------------------------------------
log "ready: $versions"
printf '%s\n' "$python"
