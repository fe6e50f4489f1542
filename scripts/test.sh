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
# The chat page tests drive Debian's Chromium through Playwright (never `playwright install`, which
# downloads a browser build); without it they skip and say so.
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing Debian's chromium for the chat page tests" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } >&2 \
      || echo "could not install chromium: the chat page browser tests will skip" >&2
  else
    echo "chromium is missing and cannot be installed here (needs apt-get as root): the chat page browser tests will skip" >&2
  fi
fi
.venv/bin/python -m pytest "$@"
# A whole run (no arguments) also runs the Triton kernels' tests, in their own environment.
if [ $# -eq 0 ]; then
  bash scripts/test_triton.sh
fi
