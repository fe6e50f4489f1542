"""Depthwise causal short convolution + SiLU (the KDA input path, spec §1.2).

The carried state is the last W-1 PRE-conv inputs, oldest first (column W-2 is the most recent
token), so a sequence can be fed in pieces of any length, including single decode tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.model.layers import compute_dtype


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [T, C], weight [C, W], state [C, W-1] -> (SiLU(conv) [T, C], new state [C, W-1]).

    Accumulates in at least float32; y and the new state keep x's and state's dtypes."""
    T, C = x.shape
    W = weight.shape[1]
    cdt = compute_dtype(x.dtype)
    xx = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [C, W-1+T], oldest first
    y = F.conv1d(xx.to(cdt).unsqueeze(0), weight.to(cdt).unsqueeze(1), groups=C)[0]  # [C, T]
    new_state = xx[:, xx.shape[1] - (W - 1):].to(state.dtype)
    return F.silu(y).t().to(x.dtype), new_state


def causal_conv_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched decode, one token per sequence: x [B, C], state [B, C, W-1] -> (y [B, C], new state)."""
    cdt = compute_dtype(x.dtype)
    xx = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, W]
    y = (xx.to(cdt) * weight.to(cdt)).sum(-1)
    return F.silu(y).to(x.dtype), xx[..., 1:].to(state.dtype)
