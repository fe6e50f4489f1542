"""When a bfloat16 product of many rows goes to torch's matmul (oneDNN) instead of the C row kernels.

On a CPU with AMX-BF16 tiles, oneDNN's bfloat16 GEMM multiplies on the tiles, and so do the C
kernels from a few rows (``csrc/amx_tiles.h``; below, the FMA register tiles of
``csrc/row_tiles.h``); past a hundred or so rows oneDNN's blocking wins: a prefill chunk, an
expert's rows in it, a large batch's LM head. Fewer rows (decode) stay in C, where streaming the
weight once is most of the cost and the fused layer steps keep dispatch away.

oneDNN picks its blocking, and so the order of a row's sums, from the number of rows: a row's bits
then depend on the rows beside it. So this path is taken only for bfloat16 rows (whose model is
not batch-invariant outside ``--enable-deterministic-inference``; float32 models always are) and
never under deterministic inference, where every product stays in the row-invariant C kernel.

``TIDAL_BF16_BLAS_MIN_ROWS`` sets the row count from which it applies (0: never); the defaults are
:data:`MIN_ROWS` and :data:`MIN_EXPERT_ROWS` on CPUs with AMX tiles, and never elsewhere.
"""

from __future__ import annotations

from functools import cache

import torch

from tidal.ops import batch_invariant
from tidal.ops.switches import getenv

# Rows from which oneDNN's tiles beat the C kernels' (benchmarks/bench_bf16_blas.py): a trunk product,
# and one packed expert's group, whose bf16 dequantisation each call pays.
MIN_ROWS = 128
MIN_EXPERT_ROWS = 192


@cache
def _amx() -> bool:
    try:
        return bool(torch.cpu._is_amx_tile_supported()) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


def min_rows(expert: bool = False) -> int | None:
    """The row count from which bfloat16 products (``expert``: one packed expert's rows) go to
    torch's matmul, or None (never). ``TIDAL_BF16_BLAS_MIN_ROWS`` sets both."""
    env = getenv("TIDAL_BF16_BLAS_MIN_ROWS", "")
    if env:
        rows = int(env)
        return rows if rows > 0 else None
    if not _amx():
        return None
    return MIN_EXPERT_ROWS if expert else MIN_ROWS


def takes(rows: int, expert: bool = False) -> bool:
    """Whether a bfloat16 product of ``rows`` rows goes to torch's matmul on this CPU now."""
    least = min_rows(expert)
    return least is not None and rows >= least and not batch_invariant.enabled()
