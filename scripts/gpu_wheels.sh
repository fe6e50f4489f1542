#!/usr/bin/env bash
# Copy the wheels the H200 test machine lacks into wheels/ (ignored by git; carry it with the tree):
# that machine has torch 2.11 + CUDA, triton 3.6, einops and no package index. Run here, before
# scripts/gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p wheels
python3 -m pip download -q --disable-pip-version-check --no-deps -d wheels "fla-core==0.6.0"
ls -l wheels
