"""``F.linear`` for the trunk's bias-free projections, behind one seam: few rows times a bfloat16
weight on the CPU go to the C kernel (``csrc/bf16_gemm.c``: the weight streamed once, bf16 widened
in registers, fp32 sums; torch's bf16 matmul has no fast one-row path on CPUs without bf16 dot
products); everything else is torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.ops.cpu_kernels import bf16_gemm_kernel

# Rows up to which the C kernel runs (a decode batch); beyond, a weight is reused enough for BLAS.
FEW_ROWS = 8


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w.t() (w [N, K]) in x's dtype."""
    if (w.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or w.device.type != "cpu" or w.dim() != 2
            or w.stride(1) != 1 or x.numel() > FEW_ROWS * x.shape[-1] or x.numel() == 0
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return F.linear(x, w)
    kernel = bf16_gemm_kernel()
    if kernel is None:
        return F.linear(x, w)
    return kernel(x.reshape(-1, x.shape[-1]), w).to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
