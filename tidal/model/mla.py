"""Multi-head latent attention (spec §2): NoPE, optional q-LoRA, optional sigmoid output gate."""

from __future__ import annotations

import torch
from torch import nn

from tidal.config import ModelConfig
from tidal.model.context import ForwardBatch
from tidal.model.layers import RMSNorm, compute_dtype, linear
from tidal.ops.mla import mla_absorbed_attention, mla_naive_attention, pad_latents


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
        self.scale = config.qk_head_dim ** -0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; appends this step's latents to ``batch.cache``.

        Decode sequences (one new token) share one weight-absorbed call; longer queries use the
        expanded kernel, which amortises expanding k/v over their many queries."""
        T, n = x.shape[0], self.num_heads
        q = self._query(x).view(T, n, self.qk_nope + self.qk_rope)
        q_nope, q_pe = q.split([self.qk_nope, self.qk_rope], dim=-1)
        batch.cache.mla_write(self.mla_index, self._latents(x))
        w = self.kv_b_proj.weight
        out = x.new_empty(T, n, self.v_dim)
        if batch.decode_seqs:
            rows = batch.decode_rows(x.device)[1]
            latents, lengths = pad_latents([batch.cache.mla_read(self.mla_index, b) for b in batch.decode_seqs])
            o = mla_absorbed_attention(q_nope[rows, None], q_pe[rows, None], latents, lengths, w, self.scale)
            out[rows] = o[:, 0]
        for b in batch.prefill_seqs:
            sl = batch.token_slice(b)
            latents = batch.cache.mla_read(self.mla_index, b)
            out[sl] = mla_naive_attention(q_nope[sl], q_pe[sl], latents, w, self.scale)
        out = out.reshape(T, n * self.v_dim)
        if self.config.mla_use_output_gate:
            cdt = compute_dtype(x.dtype)
            out = (out.to(cdt) * torch.sigmoid(self.g_proj(x).to(cdt))).to(x.dtype)
        return self.o_proj(out)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """[T, n * (d_nope + d_rope)]: q_proj (Kimi Linear) or the q-LoRA path (K3)."""
        if self.config.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _latents(self, x: torch.Tensor) -> torch.Tensor:
        """The cache rows [T, r + d_rope]: normalised latent c, then k_pe (unrotated: NoPE)."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)
