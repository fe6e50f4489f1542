"""Grouped matmul of activation rows by packed MXFP4 expert weights: the one dispatch seam of the
packed routed experts (``tidal.model.moe.PackedExperts``).

Rows come sorted by expert: group g is rows offsets[g] .. offsets[g+1]-1, multiplied by expert
experts[g]'s weight, given as an :class:`~tidal.ops.mxfp4_table.ExpertTable` (stacked experts, or
each expert's matrices wherever the checkpoint's mapping holds them), or stacked as packed
[E, N, K/2] and scales [E, N, K/32] uint8 (``tidal.ops.mxfp`` layout). Backends, all returning
float32 [S, N]:

- the C kernel (``csrc/mxfp4_gemm.c``) at every group size: decodes panels of weight rows to float32
  in L1 and runs the group's rows under them in register tiles; each row bitwise independent of the
  other rows and of the group sizes (bfloat16 rows in groups of a few rows or more take the AMX
  tiles where the CPU has them, outside deterministic inference: another order);
- :func:`grouped_matmul_torch`: the torch form (no compiler, ``TIDAL_CPU_KERNELS=0``, other devices),
  which dequantises only the active experts;
- groups of many rows in a bfloat16 model (``bf16_rows``) on a CPU with AMX tiles: the expert
  dequantised to bfloat16 (exact) and multiplied by torch's matmul (``tidal.ops.bf16_blas``: a
  prefill chunk's experts; not under deterministic inference), the rows rounded to bfloat16 as the
  model's trunk rounds its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.ops import bf16_blas
from tidal.ops.cpu_kernels import mxfp4_dequantize_bf16_kernel, mxfp4_kernels
from tidal.ops.mxfp import dequantize_mxfp4
from tidal.ops.mxfp4_table import ExpertTable


def _applies(x: torch.Tensor, weight: torch.Tensor | ExpertTable) -> bool:
    if isinstance(weight, ExpertTable):
        return x.device.type == "cpu"
    return x.device.type == "cpu" and weight.device.type == "cpu" and weight.is_contiguous()


def grouped_matmul(
    x: torch.Tensor, offsets: torch.Tensor, experts: torch.Tensor, counts: list[int], expert_list: list[int],
    packed: torch.Tensor | ExpertTable, scales: torch.Tensor | None = None, bf16_rows: bool = False,
) -> torch.Tensor:
    """x [S, K] (rows sorted by expert; ``counts``/``expert_list`` are offsets/experts as lists) ->
    float32 [S, N]. offsets int64 [G+1] and experts int64 [G] on the CPU. ``packed``: an
    ExpertTable, or the stacked codes with their ``scales``. ``bf16_rows``: a bfloat16 model's rows,
    which a group of many may multiply in bfloat16 (see the module)."""
    kernels = mxfp4_kernels() if _applies(x, packed) else None
    if kernels is None:
        return grouped_matmul_torch(x, counts, expert_list, packed, scales)
    if bf16_rows and counts and bf16_blas.takes(max(counts), expert=True):
        blas = _grouped_matmul_blas(x, offsets, experts, counts, expert_list, packed, scales, kernels[0])
        if blas is not None:
            return blas
    return kernels[0](x, offsets, experts, packed, scales)


def _grouped_matmul_blas(
    x: torch.Tensor, offsets: torch.Tensor, experts: torch.Tensor, counts: list[int], expert_list: list[int],
    packed: torch.Tensor | ExpertTable, scales: torch.Tensor | None, kernel,
) -> torch.Tensor | None:
    """Groups of at least ``bf16_blas.min_rows(expert=True)`` rows through a bfloat16 copy of their expert and
    torch's matmul, the others through the C kernel in one call; None without the dequantiser."""
    dequantize = mxfp4_dequantize_bf16_kernel()
    if dequantize is None:
        return None
    table = packed if isinstance(packed, ExpertTable) else ExpertTable.stacked(packed, scales)
    out = torch.empty(x.shape[0], table.rows, dtype=torch.float32)
    small = [g for g, n in enumerate(counts) if n and not bf16_blas.takes(n, expert=True)]
    if small:
        rows = torch.cat([torch.arange(int(offsets[g]), int(offsets[g + 1])) for g in small])
        sizes = torch.tensor([0] + [counts[g] for g in small], dtype=torch.int64).cumsum_(0)
        out[rows] = kernel(x[rows], sizes, experts[small], table)
    xb = x.to(torch.bfloat16)
    start = 0
    for e, n in zip(expert_list, counts):
        if n and bf16_blas.takes(n, expert=True):
            out[start : start + n] = F.linear(xb[start : start + n], dequantize(table, e))
        start += n
    return out


def grouped_matmul_torch(
    x: torch.Tensor, counts: list[int], expert_list: list[int], packed: torch.Tensor | ExpertTable,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch form: each active expert dequantised to float32 (exact) and multiplied by its rows."""
    x = x.to(torch.float32)
    expert = packed.expert if isinstance(packed, ExpertTable) else lambda e: (packed[e], scales[e])
    parts = [F.linear(r, dequantize_mxfp4(*expert(e), torch.float32)) for e, r in zip(expert_list, x.split(counts))]
    rows = packed.rows if isinstance(packed, ExpertTable) else packed.shape[1]
    return torch.cat(parts) if parts else x.new_zeros(0, rows)
