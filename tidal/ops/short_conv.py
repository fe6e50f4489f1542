"""Depthwise causal short convolution + SiLU (the KDA input path, spec §1.2).

The carried state is the last W-1 PRE-conv inputs, oldest first, channels last ([W-1, C]: row
W-2 is the most recent token), so a sequence can be fed in pieces of any length, including single
decode tokens. Channels last makes every tap one contiguous multiply-add over [T or B, C]: on the
CPU that is 3x faster for a decode batch than reducing over a trailing dim of W.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.model.layers import compute_dtype


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [T, C], weight [C, W], state [W-1, C] -> (SiLU(conv) [T, C], new state [W-1, C]).

    Accumulates in at least float32; y and the new state keep x's and state's dtypes."""
    T = x.shape[0]
    W = weight.shape[1]
    xx = torch.cat([state.to(x.dtype), x])  # [W-1+T, C], oldest first
    return F.silu(_taps(xx, weight, T)).to(x.dtype), xx[xx.shape[0] - (W - 1):].to(state.dtype)


def causal_conv_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched decode, one token per sequence: x [B, C], state [B, W-1, C] -> (y [B, C], new state)."""
    xx = torch.cat([state.to(x.dtype), x.unsqueeze(1)], dim=1)  # [B, W, C]
    return F.silu(_taps(xx.transpose(0, 1), weight, 1)[0]).to(x.dtype), xx[:, 1:].to(state.dtype)


def _taps(xx: torch.Tensor, weight: torch.Tensor, T: int) -> torch.Tensor:
    """sum_j xx[j : j + T] * weight[:, j] over the W taps, in at least float32: xx [W-1+T, ..., C]."""
    cdt = compute_dtype(xx.dtype)
    w = weight.to(cdt).t().contiguous()  # [W, C]: each tap's weights contiguous
    xx = xx.to(cdt)  # widened once for all the taps (exact), not once per tap
    y = xx[0:T] * w[0]
    for j in range(1, w.shape[0]):
        y.addcmul_(xx[j : j + T], w[j])
    return y
