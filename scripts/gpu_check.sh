#!/usr/bin/env bash
# Issue 19's hardware check on an H200 (about 5 minutes): the CUDA path against the CPU float32
# reference, Triton kernels compiled for the GPU against their references, decode and prefill speed
# of a slice of real K3 shapes against the HBM and FLOP bounds (CUDA graphs on and off), and a
# projection to full K3 on 8 GPUs. Prepare with scripts/gpu_wheels.sh; run from the source tree:
#   OUT=/some/dir bash scripts/gpu_check.sh
# The JSON report ($OUT/gpu_check.json) is rewritten after every step: a cut run still reports.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
LOG="$OUT/gpu_check.log"
log() { echo "[gpu_check] $*" | tee -a "$LOG"; }
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton',
triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
# No index there; --no-deps: the machine's own torch stays (pyproject pins 2.13 for CPU machines).
if ls wheels/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps wheels/*.whl 2>&1 | tail -3 | tee -a "$LOG"
else
  log "no wheels/ folder (scripts/gpu_wheels.sh): the KDA steps need fla-core"
fi
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3 | tee -a "$LOG" \
  || log "editable install failed: running from the tree"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout "${GPU_CHECK_TIMEOUT:-420}" "$PY" benchmarks/gpu_check.py --out "$OUT/gpu_check.json" "$@" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
log "exit $rc; report in $OUT/gpu_check.json"
exit "$rc"
