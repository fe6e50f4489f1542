#!/usr/bin/env bash
# vLLM's entrypoint tests (tests/entrypoints/{openai,serve,anthropic} at VLLM_COMMIT) against a live
# `tidal serve` of the embedded model. Not CI: a conformance measurement, a few minutes on 2 cores.
#
#   benchmarks/vllm_conformance/run.sh [VLLM_GIT_DIR] [extra pytest args, e.g. -k chat]
#
# VLLM_GIT_DIR: a clone (bare or not) of vllm-project/vllm or local-inference-lab/vllm holding
# VLLM_COMMIT (default: $VLLM_GIT_DIR, else the fetch mirror). The tests run unmodified; the
# glue (tests/utils.py, tests/conftest.py, a `vllm` stand-in) comes from glue/. Prints the pass
# count; the JUnit report and the full log go to $TIDAL_HARNESS_WORK (default /tmp/tidal-vllm-harness).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VLLM_COMMIT=9aaf83ef502fc37bc647f6e474314d48ba36cd1c
VLLM_GIT="${1:-${VLLM_GIT_DIR:-/work/.mirror/local-inference-lab+vllm/repo}}"
[ $# -gt 0 ] && shift
WORK="${TIDAL_HARNESS_WORK:-/tmp/tidal-vllm-harness}"
TIDAL_PYTHON="${TIDAL_PYTHON:-$REPO/.venv/bin/python}"
[ -x "$TIDAL_PYTHON" ] || TIDAL_PYTHON="$(command -v python3)"

# The test venv: tidal's own environment underneath (torch stays the pinned one, pip sees it as
# installed), plus the two light packages the tests import that tidal does not need.
VENV="$WORK/venv"
if [ ! -x "$VENV/bin/python" ]; then
  "$TIDAL_PYTHON" -m venv "$VENV"
  base="$("$TIDAL_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  own="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$base" > "$own/zz_tidal_env.pth"
  "$VENV/bin/python" -m pip install -q "pytest-asyncio==1.5.0" "pybase64==1.5.1"
fi

# vLLM's tests at the pinned commit, with our glue in place of tests/utils.py and tests/conftest.py.
SRC="$WORK/src"
rm -rf "$SRC" && mkdir -p "$SRC"
GIT_DIR_ABS="$(git -C "$VLLM_GIT" rev-parse --absolute-git-dir)"
# file by file (a partial mirror may lack blobs elsewhere in the tree, which `git archive` trips on)
git --git-dir="$GIT_DIR_ABS" ls-tree -r --name-only "$VLLM_COMMIT" -- tests/__init__.py \
  tests/entrypoints/__init__.py tests/entrypoints/conftest.py tests/entrypoints/openai \
  tests/entrypoints/serve tests/entrypoints/anthropic | while read -r path; do
  mkdir -p "$SRC/$(dirname "$path")"
  git --git-dir="$GIT_DIR_ABS" show "$VLLM_COMMIT:$path" > "$SRC/$path"
done
cp "$HERE/glue/tests/utils.py" "$HERE/glue/tests/conftest.py" "$SRC/tests/"
cat > "$SRC/pytest.ini" <<'INI'
[pytest]
asyncio_default_fixture_loop_scope = function
markers =
    slow_test
    skip_global_cleanup
    core_model
    cpu_model
    cpu_test
    distributed
    optional
    benchmark
filterwarnings = ignore::DeprecationWarning
INI

cd "$SRC"
export PYTHONPATH="$HERE/glue/vllm_stub"
export TIDAL_REPO="$REPO" TIDAL_PYTHON="$TIDAL_PYTHON"
export TIDAL_HARNESS_MODEL_DIR="${TIDAL_HARNESS_MODEL_DIR:-$REPO/tidal/assets/embedded}"
set +e
"$VENV/bin/python" -m pytest tests/entrypoints -p no:cacheprovider -q -rfE \
  --junitxml="$WORK/report.xml" "$@" > "$WORK/pytest.log" 2>&1
set -e
"$VENV/bin/python" "$HERE/summary.py" "$WORK/report.xml"
