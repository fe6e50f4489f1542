"""Attention over a slice of the keys, and the exact merge of such slices (decode context parallelism).

With DCP each rank stores only some of a sequence's MLA latents (logical token i on rank i % N) and
attends over them with every head. A rank returns its partial output O_r (normalised over its own
keys) and the log-sum-exp L_r of its scores; with L = logsumexp_r L_r the full output is
sum_r exp(L_r - L) O_r, exactly (spec serving-engines.md §3). A rank that holds no visible key of a
query has L_r = -inf and contributes nothing.

The kernels take the weight-absorbed query ``[q~ | q_pe]`` (``tidal.ops.mla``): one dot product with
each raw cache row ``[c | k_pe]``, and an output in the latent space (W_UV is applied after the merge).
"""

from __future__ import annotations

import torch

from tidal.model.layers import compute_dtype


def partial_attention(
    query: torch.Tensor,
    latents: torch.Tensor,
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    rank: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of B sequences' queries over the keys one rank holds.

    query [B, Q, H, r + d_rope] (absorbed), latents [B, L, r + d_rope] (this rank's rows, padded),
    key_pos [B, L] logical positions of those rows (-1: padding), query_pos [B, Q] logical positions
    of the queries (a query sees keys at positions <= its own), ``rank`` = r (the latent width).
    Returns (O [B, Q, H, r], LSE [B, Q, H]) in float32 or wider; a query with no visible key gets
    O = 0 and LSE = -inf."""
    cdt = compute_dtype(query.dtype)
    B, Q, H, C = query.shape
    kv = latents.to(cdt)
    scores = torch.einsum("bqhc,blc->bqhl", query.to(cdt), kv) * scale
    visible = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= query_pos[:, :, None])  # [B, Q, L]
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is visible
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    out = torch.einsum("bqhl,blr->bqhr", probs, kv[..., :rank])
    return out, lse


def merge_attention(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Exact merge of partial attention outputs: outs [N, ..., D], lses [N, ...] (-inf: the part saw
    no key) -> [..., D] = sum_r exp(L_r - L) O_r with L = logsumexp_r L_r."""
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total.masked_fill(torch.isinf(total), 0.0))  # 0 for a part with -inf
    return (outs * weights[..., None]).sum(0)


def merge_attention_reference(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """The merge one query row at a time in float64 (the test reference): un-normalise each part by
    exp(L_r), add, normalise by the summed exponentials."""
    out = torch.zeros_like(outs[0], dtype=torch.float64)
    flat_out = out.reshape(-1, out.shape[-1])
    for i in range(flat_out.shape[0]):
        num = torch.zeros(out.shape[-1], dtype=torch.float64)
        den = torch.zeros((), dtype=torch.float64)
        peak = max(float(lse.reshape(-1)[i]) for lse in lses)
        if peak == float("-inf"):
            continue
        for o, lse in zip(outs, lses):
            w = torch.exp(lse.reshape(-1)[i].double() - peak)
            num += w * o.reshape(-1, o.shape[-1])[i].double()
            den += w
        flat_out[i] = num / den
    return out
