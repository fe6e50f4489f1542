"""Gated MLP activations: SwiGLU (Kimi Linear) and SiTU (Kimi-K3, spec §3.2)."""

from __future__ import annotations

import torch

from tidal.model.layers import compute_dtype
from tidal.ops import fused_decode


def can_overwrite(*tensors: torch.Tensor) -> bool:
    """Whether an in-place op on fresh intermediates of these tensors is safe: no autograd graph
    needs their values. In-place saves an allocation, which costs as much as the op for big tensors."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    fused = fused_decode.gated_activation(gate, up, None)
    if fused is not None:
        return fused
    g, u = gate.to(compute_dtype(gate.dtype)), up.to(compute_dtype(up.dtype))
    a = torch.nn.functional.silu(g)
    return (a.mul_(u) if can_overwrite(g, u) else a * u).to(gate.dtype)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta), in float32 or wider.

    Soft-clips the gate to +-beta and the up branch to +-linear_beta; tends to SwiGLU as both grow."""
    fused = fused_decode.gated_activation(gate, up, (beta, linear_beta))
    if fused is not None:
        return fused
    g, u = gate.to(compute_dtype(gate.dtype)), up.to(compute_dtype(up.dtype))
    if not can_overwrite(g, u):
        a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
        b = linear_beta * torch.tanh(u / linear_beta)
        return (a * b).to(gate.dtype)
    # The same operations in the same order (so the same rounding), on two fresh buffers.
    a = (g / beta).tanh_().mul_(beta).mul_(torch.sigmoid(g))
    b = (u / linear_beta).tanh_().mul_(linear_beta)
    return a.mul_(b).to(gate.dtype)
