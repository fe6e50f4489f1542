"""Triton kernels against their torch references on the CPU, under triton's interpreter.

Run by scripts/test_triton.sh in its own environment (triton must never be in the main one). The
interpreter must be on before triton is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")
