"""Decode context parallelism for MLA: this rank's slice of the latents, every head of its DCP group.

The cache of a DCP rank j (of N) stores logical tokens i = jN.. with i % N == j, in order, so local
row t is logical token t N + j. Per MLA layer and step: the ranks' absorbed queries are all-gathered
(each rank computed its own heads'), every rank attends over its rows (``tidal.ops.attn_merge``),
the log-sum-exps are all-gathered, each rank rescales its part by exp(L_r - L), and an all-reduce
sums the parts (each rank keeps its own heads; the all-reduce stands in for a reduce-scatter, which
gloo lacks). W_UV is applied after the merge, to this rank's heads only.
"""

from __future__ import annotations

import torch

from tidal.model.context import ForwardBatch
from tidal.model.layers import compute_dtype
from tidal.ops.attn_merge import partial_attention
from tidal.ops.mla import split_kv_b
from tidal.parallel.groups import Collectives

# Score elements (queries x heads x keys) one prefill piece materialises at most.
SCORE_BUDGET = 1 << 24


class DecodeContextParallel:
    """Set as ``KimiMLA.context_parallel`` on a DCP rank."""

    def __init__(self, comm: Collectives) -> None:
        self.comm = comm
        self.rank, self.size = comm.place.dcp_rank, comm.place.dcp_size

    def key_positions(self, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """Logical positions [n, width] of the local rows (-1 past each sequence's local length)."""
        local = torch.arange(width, device=lengths.device)[None, :]
        return torch.where(local < lengths[:, None], local * self.size + self.rank, -1)

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b_weight: torch.Tensor, scale: float,
               batch: ForwardBatch, mla_layer: int) -> torch.Tensor:
        """q_nope [T, n, d_nope], q_pe [T, n, d_rope] of this rank's n heads -> [T, n, d_v]."""
        T, n, dn = q_nope.shape
        cdt = compute_dtype(q_nope.dtype)
        dev = q_nope.device
        w_uk, w_uv = split_kv_b(kv_b_weight.to(cdt), n, dn)
        r = w_uk.shape[-1]
        query = torch.cat([torch.einsum("tnd,ndr->tnr", q_nope.to(cdt), w_uk), q_pe.to(cdt)], dim=-1)
        query = self.comm.all_gather(query, dim=1, dcp=True)  # [T, n N, C]: the group's heads
        heads = query.shape[1]
        out = torch.zeros(T, heads, r, dtype=cdt, device=dev)
        lse = torch.full((T, heads), float("-inf"), dtype=cdt, device=dev)
        cache = batch.cache
        if batch.decode_seqs:
            rows = batch.decode_tokens(dev)
            latents, lengths = cache.mla_read_padded(mla_layer, batch.decode_seqs)
            if latents.shape[1]:
                key_pos = self.key_positions(lengths.to(dev), latents.shape[1])
                query_pos = torch.tensor([[batch.cached_lens[b]] for b in batch.decode_seqs], device=dev)
                o, s = partial_attention(query[rows, None], latents, key_pos, query_pos, r, scale)
                out[rows], lse[rows] = o[:, 0], s[:, 0]
        for b in batch.prefill_seqs:
            latents = cache.mla_read(mla_layer, b)
            if not latents.shape[0]:
                continue
            key_pos = self.key_positions(torch.tensor([latents.shape[0]], device=dev), latents.shape[0])
            sl, c = batch.token_slice(b), batch.cached_lens[b]
            piece = max(1, SCORE_BUDGET // (heads * latents.shape[0]))
            for t0 in range(sl.start, sl.stop, piece):
                t1 = min(sl.stop, t0 + piece)
                query_pos = torch.arange(c + t0 - sl.start, c + t1 - sl.start, device=dev)[None]
                o, s = partial_attention(query[None, t0:t1], latents[None], key_pos, query_pos, r, scale)
                out[t0:t1], lse[t0:t1] = o[0], s[0]
        total = torch.logsumexp(self.comm.all_gather(lse[None], dim=0, dcp=True), dim=0)
        weight = torch.exp(lse - total.masked_fill(torch.isinf(total), 0.0))  # 0 where this rank saw nothing
        merged = self.comm.all_reduce(out * weight[..., None], dcp=True)
        mine = merged[:, self.rank * n : (self.rank + 1) * n]
        return torch.einsum("tnr,nvr->tnv", mine, w_uv).to(q_nope.dtype)
