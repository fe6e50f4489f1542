"""Gated MLP activations: SwiGLU (Kimi Linear) and SiTU (Kimi-K3, spec §3.2)."""

from __future__ import annotations

import torch

from tidal.model.layers import compute_dtype


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g, u = gate.to(compute_dtype(gate.dtype)), up.to(compute_dtype(up.dtype))
    return (torch.nn.functional.silu(g) * u).to(gate.dtype)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta), in float32 or wider.

    Soft-clips the gate to +-beta and the up branch to +-linear_beta; tends to SwiGLU as both grow."""
    g, u = gate.to(compute_dtype(gate.dtype)), up.to(compute_dtype(up.dtype))
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    b = linear_beta * torch.tanh(u / linear_beta)
    return (a * b).to(gate.dtype)
