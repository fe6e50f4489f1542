"""The KDA short convolution's decode step in Triton, on the pool's conv states in place.

The fast form of ``tidal.ops.short_conv.causal_conv_step``: one token per sequence, the state of
sequence b at ``state[slots[b]]`` (a slot < 0 is a padded row of a captured batch: skipped, its
output row left as it is). fla's conv kernels take no state indices, hence this one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 256


@triton.jit
def _conv_step_kernel(
    X, Wt, State, Slots, Y,
    C, stride_x, stride_w, stride_s, stride_sr, stride_y,
    W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.load(Slots + b).to(tl.int64)
    if slot < 0:
        return
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < C
    state = State + slot * stride_s + ch
    x = tl.load(X + b * stride_x + ch, mask=cmask, other=0.0)
    prev = tl.load(state, mask=cmask, other=0.0)
    acc = prev.to(tl.float32) * tl.load(Wt + ch * stride_w, mask=cmask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, W - 1):
        cur = tl.load(state + j * stride_sr, mask=cmask, other=0.0)
        acc += cur.to(tl.float32) * tl.load(Wt + ch * stride_w + j, mask=cmask, other=0.0).to(tl.float32)
        tl.store(state + (j - 1) * stride_sr, cur, mask=cmask)  # shift: the oldest row drops out
    acc += x.to(tl.float32) * tl.load(Wt + ch * stride_w + (W - 1), mask=cmask, other=0.0).to(tl.float32)
    tl.store(state + (W - 2) * stride_sr, x.to(prev.dtype), mask=cmask)
    y = acc * tl.sigmoid(acc)
    tl.store(Y + b * stride_y + ch, y.to(Y.dtype.element_ty), mask=cmask)


def conv_step_(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C], weight [C, W], state [N, W-1, C] (rows contiguous; updated IN PLACE at ``slots``
    [B]) -> SiLU(conv) [B, C] in x's dtype (written into ``out`` when given)."""
    B, C = x.shape
    W = weight.shape[1]
    if state.shape[1:] != (W - 1, C) or state.stride(2) != 1 or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"conv state {list(state.shape)} / weight {list(weight.shape)} do not fit inputs [{B}, {C}]")
    if W < 2:
        raise ValueError(f"a short convolution of width {W} carries no state")
    y = out if out is not None else torch.empty_like(x)
    _conv_step_kernel[(B, triton.cdiv(C, BLOCK_C))](
        x, weight, state, slots, y,
        C, x.stride(0), weight.stride(0), state.stride(0), state.stride(1), y.stride(0),
        W=W, BLOCK_C=BLOCK_C,
    )
    return y
