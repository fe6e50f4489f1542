#!/usr/bin/env bash
# Triton kernels (tidal/ops/triton) against their torch references on the CPU, under triton's
# interpreter (TRITON_INTERPRET=1), in an environment of their own: triton must never be in .venv
# (with triton present, transformers and fla pick GPU kernels and crash on CPU). torch and tidal's
# other dependencies are read from .venv through a .pth path, so nothing large is installed twice.
# numpy < 2.4: triton 3.6's interpreter converts 1-element arrays to scalars, which numpy 2.4 refuses.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "scripts/test_triton.sh: .venv is missing; run scripts/test.sh first" >&2
  exit 2
fi
VENV=.venv-triton
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "triton==3.6.0" "numpy<2.4" pytest
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
purelib .venv/bin/python > "$(purelib "$VENV/bin/python")/tidal_main_env.pth"
export TRITON_INTERPRET=1
# The warnings are the interpreter's own (numpy deprecations, log(0) for masked rows).
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::RuntimeWarning \
  tests_triton "$@"
