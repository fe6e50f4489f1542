"""Block Attention Residuals (spec §4): softmax over depth instead of a plain residual sum.

Each sub-layer mixes the completed block summaries and the current partial sum with weights from a
learned pseudo-query against their RMS-normalised values. Token-local: nothing is kept across steps
(within a forward pass a completed block's normalisation can be computed once: ``block_cache``)."""

from __future__ import annotations

import torch
from torch import nn

from tidal.model.layers import compute_dtype, derived_weight, trusted_derived
from tidal.ops import batch_invariant, fused_decode


def attn_res(
    partial: torch.Tensor, blocks: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float,
    block_cache: fused_decode.BlockCache | None = None, query: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mix [*blocks, partial] (each [T, d]) with softmax weights over depth; returns [T, d].
    ``block_cache``: what the caller keeps for one forward pass (the fused kernel stores each
    block's inverse RMS there once); ``query``: norm_weight * proj_weight in float32, precomputed."""
    if not blocks:
        return partial
    if block_cache is not None:
        q32 = query if query is not None else (norm_weight.float() * proj_weight.reshape(-1).float())
        fused = fused_decode.attn_res(partial, blocks, block_cache, q32, eps)
        if fused is not None:
            return fused
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


def _query(owner: nn.Module, prefix: str, norm: torch.Tensor, proj: torch.Tensor) -> torch.Tensor | None:
    """The float32 pseudo-query norm * proj, kept on owner while they do not change; None under
    autograd (the torch form then differentiates through them)."""
    if torch.is_grad_enabled() and (norm.requires_grad or proj.requires_grad):
        return None
    return derived_weight(owner, f"_{prefix}_query", (norm, proj),
                          lambda: (norm.float() * proj.reshape(-1).float()).contiguous())


def attn_res_query(owner: nn.Module, prefix: str) -> torch.Tensor | None:
    """The float32 pseudo-query of the AttnRes registered on owner under ``prefix`` (see _query)."""
    return _query(owner, prefix, getattr(owner, f"{prefix}_norm").weight, getattr(owner, f"{prefix}_proj").weight)


def attn_res_glue(
    owner: nn.Module, prefix: str, partial: torch.Tensor, add: torch.Tensor | None, blocks: list[torch.Tensor],
    eps: float, block_cache: fused_decode.BlockCache, norm: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What runs between two sub-layers: the partial sum ``s = partial + add`` (partial where add is
    None), ``a = attn_res(s, blocks)`` with the weights registered on owner under ``prefix``, and
    the next sub-layer's input norm(a) -> (s, a, norm(a)). One C call where the kernels take the
    rows (fewer Python calls per sub-layer of a decode step), with the bits of the three ops."""
    query = trusted_derived(owner, f"_{prefix}_query")
    if query is None:
        query = attn_res_query(owner, prefix)
    if query is not None:
        fused = fused_decode.attn_res_glue(partial, add, blocks, block_cache, query, eps, norm.weight, norm.eps)
        if fused is not None:
            return fused
    weight, proj = getattr(owner, f"{prefix}_norm").weight, getattr(owner, f"{prefix}_proj").weight
    total = partial if add is None else partial + add
    a = attn_res(total, blocks, weight, proj, eps, block_cache, query)
    return total, a, norm(a)
