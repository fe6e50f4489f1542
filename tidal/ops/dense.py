"""``F.linear`` for the trunk's bias-free projections, behind one seam: float rows times a bfloat16
weight on the CPU go to the C kernel (``csrc/bf16_gemm.c``: bf16 widened in registers, fp32 sums in
register tiles; torch's bf16 matmul on CPUs without bf16 dot products runs at a fraction of its
float32 speed, at one row and at many). Every row's result there is bitwise independent of the
other rows (one summation order at every row count), so the bf16 trunk is batch-invariant on the
CPU. Everything else is torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.ops import batch_invariant
from tidal.ops.cpu_kernels import bf16_rows_kernel


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w.t() (w [N, K]) in x's dtype."""
    if batch_invariant.enabled():
        return batch_invariant.linear(x, w)
    if (w.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or w.device.type != "cpu" or w.dim() != 2
            or w.stride(1) != 1 or x.numel() == 0
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return F.linear(x, w)
    kernel = bf16_rows_kernel()
    if kernel is None:
        return F.linear(x, w)
    if x.dim() == 2:
        return kernel(x, w)
    return kernel(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
