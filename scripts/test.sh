#!/usr/bin/env bash
# Set up a virtual environment (CPU torch pinned in pyproject.toml) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
PIP=".venv/bin/pip"
"$PIP" install -q --disable-pip-version-check -e ".[test]"
# flash-linear-attention is a test-only reference. Installed without dependencies so that triton never
# arrives: with triton present, fla and transformers pick GPU kernels and crash on CPU.
"$PIP" install -q --disable-pip-version-check --no-deps "flash-linear-attention==0.6.0" "fla-core==0.6.0"
if .venv/bin/python -c "import triton" 2>/dev/null; then
  echo "triton is installed in .venv; removing it (CPU tests need the torch fallbacks)" >&2
  "$PIP" uninstall -y -q triton
fi
.venv/bin/python -m pytest "$@"
# A whole run (no arguments) also runs the Triton kernels' tests, in their own environment.
if [ $# -eq 0 ]; then
  bash scripts/test_triton.sh
fi
