"""Small building blocks shared by the Kimi layers."""

from __future__ import annotations

import torch
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision for norms, gates and routers: at least float32 (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm computed in at least float32, returned in x's dtype."""
    xf = x.to(compute_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def linear(in_features: int, out_features: int) -> nn.Linear:
    """Bias-free projection (every Kimi projection is bias-free)."""
    return nn.Linear(in_features, out_features, bias=False)


def inference_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] with the same values, stored input-major on the CPU.

    CPU BLAS streams a weight stored [in, out] up to 2x faster at the small batches of decode
    (batch 1 reads every weight once per token): measured on one core, a 32000 x 512 head 7.3 -> 3.1
    ms, a 1796 x 512 projection 9 -> 17 GB/s; prefill-sized batches are unaffected. GPUs keep the
    checkpoint layout, and so do 16-bit weights (input-major bf16 measured slower on this CPU)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not weight.is_contiguous() or weight.dim() != 2:
        return weight
    return weight.detach().t().contiguous().t()


def fuse_linears(linears: list[nn.Linear]) -> torch.Tensor:
    """One [sum of outputs, in] tensor holding the weights of bias-free linears that read the same
    input; each ``weight`` becomes a row view of it, so ``state_dict`` is unchanged and one matmul
    computes every projection (fewer, larger matmuls: less per-op overhead at small batches)."""
    fused = inference_layout(torch.cat([m.weight.detach() for m in linears]))
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = fused[start : start + rows]
        start += rows
    return fused
