"""Block Attention Residuals (spec §4): softmax over depth instead of a plain residual sum.

Each sub-layer mixes the completed block summaries and the current partial sum with weights from a
learned pseudo-query against their RMS-normalised values. Token-local: nothing is cached."""

from __future__ import annotations

import torch
from torch import nn

from tidal.model.layers import compute_dtype
from tidal.ops import batch_invariant


def attn_res(
    partial: torch.Tensor, blocks: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Mix [*blocks, partial] (each [T, d]) with softmax weights over depth; returns [T, d]."""
    if not blocks:
        return partial
    ct = compute_dtype(partial.dtype)
    values = torch.stack([*blocks, partial]).to(ct)  # [n+1, T, d]
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    query = norm_weight.to(ct) * proj_weight.reshape(-1).to(ct)
    if batch_invariant.enabled():
        # token-major, one reduction per token: a matrix-vector product blocks by the rows, and a
        # softmax over dim 0 vectorises across the tokens
        alpha = torch.softmax((keys * query).sum(-1).t(), dim=-1)  # [T, n+1]
        out = alpha[:, :1] * values[0]
        for j in range(1, values.shape[0]):
            out = out + alpha[:, j : j + 1] * values[j]
        return out.to(partial.dtype)
    alpha = torch.softmax(keys @ query, dim=0)  # [n+1, T]
    return (alpha.unsqueeze(-1) * values).sum(0).to(partial.dtype)


def attn_res_params(owner: nn.Module, prefix: str, dim: int) -> None:
    """Register ``{prefix}_norm.weight`` and ``{prefix}_proj.weight`` on owner (checkpoint names)."""
    norm = nn.Module()
    norm.weight = nn.Parameter(torch.ones(dim))
    proj = nn.Module()
    proj.weight = nn.Parameter(torch.zeros(1, dim))
    setattr(owner, f"{prefix}_norm", norm)
    setattr(owner, f"{prefix}_proj", proj)


def apply_attn_res(
    owner: nn.Module, prefix: str, partial: torch.Tensor, blocks: list[torch.Tensor], eps: float
) -> torch.Tensor:
    """:func:`attn_res` with the weights registered on owner under ``prefix``."""
    return attn_res(partial, blocks, getattr(owner, f"{prefix}_norm").weight, getattr(owner, f"{prefix}_proj").weight, eps)
