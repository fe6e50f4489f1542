"""The dispatch seam between the model and the device kernels of the GPU path.

Each function keeps the contract of its torch reference in ``tidal.ops`` and runs the Triton
kernel (``tidal.ops.triton``) or fla's KDA kernels where they apply (CUDA tensors), the reference
elsewhere. Kernel modules are imported on first use, so triton is never imported on a CPU run.
"""

from __future__ import annotations

from typing import Callable

import torch

from tidal.model.layers import compute_dtype
from tidal.ops import mla as mla_ref
from tidal.ops.triton import use_triton

# Programs the MLA decode kernel should launch at least (an H200 has 132 SMs): short batches cut
# the context into more splits. Derived from shapes only, so a captured graph keeps its grid.
MLA_DECODE_TARGET_PROGRAMS = 264
MLA_DECODE_MAX_SPLITS = 32


def mla_paged_decode(
    q_nope: torch.Tensor, q_pe: torch.Tensor, pages: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
    kv_b_weight: torch.Tensor, scale: float,
) -> torch.Tensor:
    """:func:`tidal.ops.mla.mla_paged_decode`; on the GPU the split-K Triton kernel over the pages."""
    if not use_triton(pages):
        return mla_ref.mla_paged_decode(q_nope, q_pe, pages, table, lengths, kv_b_weight, scale)
    from tidal.ops.triton.mla_decode import BLOCK_H, mla_decode_attention

    B, n, dn = q_nope.shape
    w_uk, w_uv = mla_ref.split_kv_b(kv_b_weight, n, dn)
    # absorbed query in the weights' dtype (bf16 on the GPU): the kernel multiplies in it
    query = torch.cat([torch.einsum("bnd,ndr->bnr", q_nope.to(w_uk.dtype), w_uk), q_pe.to(w_uk.dtype)], dim=-1)
    programs = max(1, B * -(-n // BLOCK_H))
    splits = max(1, min(MLA_DECODE_MAX_SPLITS, -(-MLA_DECODE_TARGET_PROGRAMS // programs)))
    o_lat, _ = mla_decode_attention(query, pages, table, lengths, w_uk.shape[-1], scale, num_splits=splits)
    return torch.einsum("bnr,nvr->bnv", o_lat.to(w_uv.dtype), w_uv).to(q_nope.dtype)


def mla_prefill_attention(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, kv_b_weight: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`tidal.ops.mla.mla_naive_attention`; on the GPU the key-tiled flash kernel."""
    if not use_triton(latents):
        return mla_ref.mla_naive_attention(q_nope, q_pe, latents, kv_b_weight, scale)
    from tidal.ops.triton.prefill_attention import mla_prefill_attention as tiled

    return tiled(q_nope, q_pe, latents, kv_b_weight, scale)


def routed_experts(
    h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    w13: tuple[torch.Tensor, torch.Tensor | None], w2: tuple[torch.Tensor, torch.Tensor | None],
    activate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The routed-expert sum of ``tidal.model.moe.Experts.forward`` with the grouped Triton GEMM
    (dense or MXFP4 weights: (weight, None) or (packed, scales)) -> [T, d] in float32 or wider.
    For tensors where ``use_triton`` holds."""
    from tidal.ops.triton.moe import fused_experts

    return fused_experts(h, ids, weights, w13, w2, activate).to(compute_dtype(h.dtype))


def conv_decode_(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One decode token per sequence through the short conv, the states ``state[slots]`` updated
    in place (slot -1: a padded row, skipped) -> SiLU(conv) [B, C]. Triton kernel only."""
    from tidal.ops.triton.short_conv import conv_step_

    return conv_step_(x.contiguous(), weight.contiguous(), state, slots)


def kda_decode_(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """One decode token per sequence (q, k, g [B, H, K], v [B, H, V], beta [B, H]; q normalised
    and scaled, k normalised) on the pool's states ``state[slots]`` IN PLACE, through fla's
    ``fused_recurrent_kda_fwd`` with ``ssm_state_indices`` (vLLM's decode) -> o [B, H, V].

    ``cu_seqlens`` [B+1]: 0..B for live rows; a padded row of a captured batch repeats the last
    offset, so it has no token and the kernel returns before touching any state."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    o, _ = fused_recurrent_kda_fwd(
        q=q.unsqueeze(0).contiguous(), k=k.unsqueeze(0).contiguous(), v=v.unsqueeze(0).contiguous(),
        g=g.unsqueeze(0).contiguous(), beta=beta.unsqueeze(0).contiguous(), initial_state=state, scale=1.0,
        inplace_final_state=True, cu_seqlens=cu_seqlens, ssm_state_indices=slots,
    )
    return o[0]


def kda_prefill_(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, slots: torch.Tensor, cu_seqlens: list[int],
) -> torch.Tensor:
    """Several sequences' tokens, concatenated (q, k, g [T, H, K] ...), through fla's varlen
    ``chunk_kda``: their states are gathered from ``state[slots]``, run, and scattered back
    (vLLM's prefill) -> o [T, H, V]."""
    from fla.ops.kda import chunk_kda

    cu = torch.tensor(cu_seqlens, dtype=torch.long)
    o, final = chunk_kda(
        q=q.unsqueeze(0).contiguous(), k=k.unsqueeze(0).contiguous(), v=v.unsqueeze(0).contiguous(),
        g=g.unsqueeze(0).contiguous(), beta=beta.unsqueeze(0).contiguous(), scale=1.0,
        initial_state=state[slots].contiguous(), output_final_state=True,
        cu_seqlens=cu.to(q.device), cu_seqlens_cpu=cu,
    )
    state[slots] = final.to(state.dtype)
    return o[0]
