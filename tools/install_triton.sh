#!/usr/bin/env bash
# Creates .venv-triton (override with TRITON_VENV) holding PyTriton, whose wheel ships a real
# tritonserver binary, plus the CPU onnxruntime and numpy that tests/triton_member.py needs.
#
# Why a virtualenv of its own: PyTriton's dependencies (its own tritonclient, protobuf, numpy
# pins) conflict with InferMesh's .venv. Idempotent: a stamp file naming the pinned versions
# marks a finished install; rerunning with the same pins does nothing. A fresh install
# downloads ~90 MB (the pytriton wheel is 55 MB) and took 54 s here; the venv is ~440 MB.
#
# The tritonserver Python backend stub links the system libpython while running this venv's
# standard library; tests/triton_member.py sets LD_LIBRARY_PATH to fix that (see there).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TRITON_VENV:-$root/.venv-triton}"
python="${PYTHON:-python3}"
# PyTriton 0.7.0 wants numpy < 2; onnxruntime is the CPU build, the version InferMesh uses.
pins=(nvidia-pytriton==0.7.0 onnxruntime==1.31.1 "numpy>=1.26,<2")
stamp="$venv/.infermesh-triton-installed"

fail() {
  echo "install_triton: $*" >&2
  exit 1
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ] && [ -x "$venv/bin/python" ]; then
  echo "install_triton: $venv is up to date (${pins[*]})"
  exit 0
fi

case "$(uname -s)-$(uname -m)" in
  Linux-x86_64 | Linux-aarch64) ;;
  *) fail "PyTriton ships tritonserver for Linux x86_64/aarch64 only, not $(uname -sm)" ;;
esac
command -v "$python" >/dev/null 2>&1 || fail "no Python interpreter $python (set PYTHON)"
"$python" -c 'import sys; sys.exit(sys.version_info[:2] not in ((3, 11), (3, 12)))' ||
  fail "$python is $("$python" -V 2>&1); these pins need Python 3.11 or 3.12 (set PYTHON)"

if [ ! -x "$venv/bin/python" ]; then
  echo "install_triton: creating virtualenv $venv"
  "$python" -m venv "$venv" || fail "could not create $venv with $python -m venv"
fi
# Keeps the venv out of git without touching the repository's .gitignore.
echo '*' >"$venv/.gitignore"

log="$venv/install.log"
echo "install_triton: installing ${pins[*]} (~90 MB download the first time; log: $log)"
if ! "$venv/bin/python" -m pip install --disable-pip-version-check "${pins[@]}" >"$log" 2>&1; then
  tail -n 20 "$log" >&2
  fail "pip install failed; full log in $log"
fi

tritonserver="$("$venv/bin/python" -c \
  'import pathlib, pytriton; print(pathlib.Path(pytriton.__file__).parent / "tritonserver" / "bin" / "tritonserver")')" ||
  fail "pytriton does not import in $venv; see $log"
[ -x "$tritonserver" ] || fail "the pytriton wheel has no tritonserver binary at $tritonserver"
"$venv/bin/python" -c 'import numpy, onnxruntime' || fail "numpy/onnxruntime do not import in $venv"

echo "${pins[*]}" >"$stamp"
echo "install_triton: done; start a member with $venv/bin/python tests/triton_member.py --help"
