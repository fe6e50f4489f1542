"""Multi-head latent attention (spec §2): NoPE, optional q-LoRA, optional sigmoid output gate."""

from __future__ import annotations

import torch
from torch import nn

from tidal.config import ModelConfig
from tidal.model.context import ForwardBatch
from tidal.model.layers import FusedWeights, RMSNorm, compute_dtype, derived_weight, fuse_linears, kept_derived, linear
from tidal.ops import batch_invariant, dense, fused_decode
from tidal.ops.backends import mla_paged_decode, mla_prefill_attention
from tidal.ops.mla import mla_absorbed_attention, mla_naive_attention
from tidal.ops.mla_tiled import mla_tiled_attention
from tidal.ops.triton import use_triton
from tidal.spec.verify import verify_mla


class KimiMLA(nn.Module):
    """Parameter names match the checkpoint (``layers.{i}.self_attn.*``)."""

    def __init__(self, config: ModelConfig, mla_index: int) -> None:
        super().__init__()
        self.config = config
        self.mla_index = mla_index
        d, n = config.hidden_size, config.num_attention_heads
        self.num_heads = n
        self.qk_nope, self.qk_rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        q_out = n * config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = linear(d, q_out)
        else:
            self.q_a_proj = linear(d, config.q_lora_rank)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = linear(config.q_lora_rank, q_out)
        self.kv_a_proj_with_mqa = linear(d, config.kv_lora_rank + config.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = linear(config.kv_lora_rank, n * (config.qk_nope_head_dim + config.v_head_dim))
        if config.mla_use_output_gate:
            self.g_proj = linear(d, n * config.v_head_dim)
        self.o_proj = linear(n * config.v_head_dim, d)
        self.in_proj: FusedWeights | None = None  # set by fuse_weights (serving)
        self.scale = config.qk_head_dim ** -0.5
        # Set on a decode-context-parallel rank (tidal.parallel.dcp): the cache then holds this rank's
        # slice of the tokens, and attention over it is merged across the DCP group.
        self.context_parallel = None

    def fuse_weights(self) -> None:
        """Make the projections of x (q or q_a, kv_a, the output gate) row views of one tensor: one
        matmul per step for all of them; parameters and state_dict keep their names and values.
        16-bit CPU weights stay apart (``layers.keeps_apart``): one parts product."""
        first = self.q_proj if self.config.q_lora_rank is None else self.q_a_proj
        parts = [first, self.kv_a_proj_with_mqa] + ([self.g_proj] if self.config.mla_use_output_gate else [])
        self.in_proj = fuse_linears(parts)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [T, n * (d_nope + d_rope)], kv_a(x) [T, r + d_rope], output-gate logits or None)."""
        fused = self.in_proj.for_forward() if self.in_proj is not None else None
        if fused is not None:
            first, kv, *gate = dense.linear(x, fused).split(self.in_proj.sizes, dim=-1)
        else:
            ws, sizes = self._in_weights()
            first, kv, *gate = dense.linear_parts(x, ws).split(sizes, dim=-1)
        q = first if self.config.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(first))
        return q, kv, (gate[0] if gate else None)

    def _in_weights(self) -> tuple[list[torch.Tensor] | dense.WeightParts, list[int]]:
        """The unfused input projections' weights (q or q_a, kv_a, the output gate) and their output
        sizes, as the parts product takes them (kept while none changes)."""
        parts = [self.q_proj if self.config.q_lora_rank is None else self.q_a_proj, self.kv_a_proj_with_mqa]
        ws = [m.weight for m in parts + ([self.g_proj] if self.config.mla_use_output_gate else [])]
        sizes = [w.shape[0] for w in ws]
        return derived_weight(self, "_in_weights_cached", tuple(ws),
                              lambda: (dense.weight_parts(ws) or ws, sizes))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; appends this step's latents to ``batch.cache``.

        Decode sequences (one new token) share one weight-absorbed call; longer queries run one by
        one. Over the pool's pages both read the cache in key tiles (memory bounded by the chunk,
        not the context); over a SimpleCache the reference kernels run."""
        T, n = x.shape[0], self.num_heads
        stepped = self._decode_step(x, batch)
        if stepped is not None:
            return stepped
        q, kv, gate = self._project(x)
        q_nope, q_pe = q.reshape(T, n, self.qk_nope + self.qk_rope).split([self.qk_nope, self.qk_rope], dim=-1)
        c, k_pe = kv.split([self.kv_lora_rank, self.qk_rope], dim=-1)
        batch.cache.mla_write(self.mla_index, torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1))
        w = self.kv_b_proj.weight
        if batch_invariant.enabled():
            out = self._attend_row_invariant(q_nope, q_pe, batch)
        elif self.context_parallel is not None:
            out = self.context_parallel.attend(q_nope, q_pe, w, self.scale, batch, self.mla_index)
        else:
            out = self._attend(q_nope, q_pe, w, batch)
        out = out.reshape(T, n * self.v_dim)
        if gate is not None:
            gated = fused_decode.sigmoid_gate(out, gate)  # a few rows: one C call
            if gated is None:
                cdt = compute_dtype(x.dtype)
                gated = (out.to(cdt) * torch.sigmoid(gate.to(cdt))).to(x.dtype)
            out = gated
        return self.o_proj(out)

    def _decode_step(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """A bfloat16 decode step (every token the one new token of its sequence) over the engine's
        pages as one C call (``fused_decode.mla_layer_step``), or None where it does not apply."""
        cache = batch.cache
        if (x.dtype != torch.bfloat16 or not x.is_cpu or x.dim() != 2 or len(batch.decode_seqs) != x.shape[0]
                or self.context_parallel is not None or batch_invariant.enabled()
                or not hasattr(cache, "mla_write_rows")):
            return None
        write = cache.mla_write_rows()
        plan = self._step_plan() if write is not None else None
        if plan is None:
            return None
        pages, table, lengths = cache.mla_pages(self.mla_index, batch.decode_seqs)
        return fused_decode.mla_layer_step(plan, x, pages, table, lengths, write)

    def decode_step_plan(self) -> fused_decode.StepPlan | None:
        """The plan of the layer's one-call decode step where it takes one (all heads and the whole
        cache on this rank), else None."""
        return self._step_plan() if self.context_parallel is None else None

    @kept_derived("_step_plan_cached")
    def _step_plan(self) -> fused_decode.StepPlan | None:
        """The layer's weights as the one-call decode step takes them (kept while none changes), or None."""
        c = self.config
        ws, _ = self._in_weights()
        in_ws = list(ws.weights) if isinstance(ws, dense.WeightParts) else list(ws)
        lora = c.q_lora_rank is not None
        params = (*in_ws, self.kv_a_layernorm.weight, self.kv_b_proj.weight, self.o_proj.weight,
                  *((self.q_b_proj.weight, self.q_a_layernorm.weight) if lora else ()))
        return derived_weight(self, "_step_plan_cached", params, lambda: fused_decode.mla_layer_plan(
            in_ws, self.q_b_proj.weight if lora else None,
            (self.q_a_layernorm.weight, self.q_a_layernorm.eps) if lora else None,
            (self.kv_a_layernorm.weight, self.kv_a_layernorm.eps), self.kv_b_proj.weight, self.o_proj.weight,
            self.num_heads, self.qk_nope, self.qk_rope, self.v_dim, self.scale))

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention of the step's queries over all of each sequence's latents -> [T, n, d_v]."""
        T, n = q_nope.shape[:2]
        out = q_nope.new_empty(T, n, self.v_dim)
        paged = getattr(batch.cache, "mla_pages", None)  # a paged cache: read the pages in place
        if batch.decode_seqs:
            rows = batch.decode_tokens(q_nope.device)
            if paged is not None:
                pages = paged(self.mla_index, batch.decode_seqs)
                out[rows] = mla_paged_decode(q_nope[rows], q_pe[rows], *pages, w, self.scale)
            else:
                latents, lengths = batch.cache.mla_read_padded(self.mla_index, batch.decode_seqs)
                o = mla_absorbed_attention(q_nope[rows, None], q_pe[rows, None], latents, lengths, w, self.scale)
                out[rows] = o[:, 0]
        if batch.verify_seqs:
            verify_mla(q_nope, q_pe, batch, self.mla_index, w, self.scale, out)
        for b in batch.prefill_seqs:
            sl = batch.token_slice(b)
            if use_triton(q_nope):  # the GPU's key-tiled flash kernel (tidal.ops.backends)
                latents = batch.cache.mla_read(self.mla_index, b)
                out[sl] = mla_prefill_attention(q_nope[sl], q_pe[sl], latents, w, self.scale)
            elif paged is not None:
                pages, table, _ = paged(self.mla_index, [b])
                length = batch.cached_lens[b] + batch.query_lens[b]
                out[sl] = mla_tiled_attention(q_nope[None, sl], q_pe[None, sl], pages, table, [length], w, self.scale)[0]
            else:
                latents = batch.cache.mla_read(self.mla_index, b)
                out[sl] = mla_naive_attention(q_nope[sl], q_pe[sl], latents, w, self.scale)
        return out

    def _attend_row_invariant(self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Deterministic mode: every query, prefill or decode, as a decode query over its own
        prefix (``tidal.ops.batch_invariant.mla_attention``), all in one call over the pool's pages
        (one page holding a sequence's latents over a SimpleCache)."""
        w, dev = self.kv_b_proj.weight, q_nope.device
        lengths = torch.cat([torch.arange(c + 1, c + q + 1) for c, q in zip(batch.cached_lens, batch.query_lens)])
        paged = getattr(batch.cache, "mla_pages", None)
        if paged is not None:
            pages, table, _ = paged(self.mla_index, list(range(batch.num_seqs)))
            seq_of = torch.repeat_interleave(torch.arange(batch.num_seqs), torch.tensor(batch.query_lens))
            return batch_invariant.mla_attention(q_nope, q_pe, pages, table[seq_of.to(dev)], lengths, w, self.scale)
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        for b in range(batch.num_seqs):
            sl = batch.token_slice(b)
            latents = batch.cache.mla_read(self.mla_index, b)[None]
            table = torch.zeros(sl.stop - sl.start, 1, dtype=torch.long)
            out[sl] = batch_invariant.mla_attention(q_nope[sl], q_pe[sl], latents, table, lengths[sl], w, self.scale)
        return out
