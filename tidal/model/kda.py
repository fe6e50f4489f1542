"""Kimi Delta Attention layer (spec §1): projections, short conv, gates, KDA kernel, gated norm."""

from __future__ import annotations

import torch
from torch import nn

from tidal.config import ModelConfig
from tidal.model.context import ForwardBatch
from tidal.model.layers import compute_dtype, linear, rms_norm
from tidal.ops.kda import (
    kda_chunked,
    kda_decode_step_,
    kda_gate,
    kda_recurrent,
    l2_normalize,
)
from tidal.ops.short_conv import causal_conv, causal_conv_step

# Prefill pieces up to this many tokens run the token-by-token kernel (fewer ops than one chunk).
RECURRENT_MAX_LEN = 16


class KimiDeltaAttention(nn.Module):
    """Parameter names match the checkpoint (``layers.{i}.self_attn.*``).

    ``A_log`` is held as [H, 1] (layout "head": one value per head, the first H of the checkpoint's
    vector) or [1, K] (layout "channel"); the loader narrows/reshapes the stored tensor.
    """

    def __init__(self, config: ModelConfig, kda_index: int) -> None:
        super().__init__()
        self.config = config
        self.kda_index = kda_index
        d = config.hidden_size
        H, K, W = config.kda_num_heads, config.kda_head_dim, config.kda_conv_kernel
        P = H * K
        self.num_heads, self.head_dim, self.conv_kernel = H, K, W
        self.q_proj = linear(d, P)
        self.k_proj = linear(d, P)
        self.v_proj = linear(d, P)
        self.q_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.f_a_proj = linear(d, K)
        self.f_b_proj = linear(K, P)
        self.b_proj = linear(d, H)
        a_log_shape = (H, 1) if config.kda_a_log_layout == "head" else (1, K)
        self.A_log = nn.Parameter(torch.zeros(a_log_shape, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(P, dtype=torch.float32))
        if config.kda_full_rank_gate:
            self.g_proj = linear(d, P)
        else:
            self.g_a_proj = linear(d, K)
            self.g_b_proj = linear(K, P)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(K, dtype=torch.float32))
        self.o_proj = linear(P, d)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; reads and writes this layer's state in ``batch.cache``.

        The cache's state tensors are updated in place (rows of this step's sequences) and then
        handed back through ``set_kda_state``."""
        T = x.shape[0]
        H, K = self.num_heads, self.head_dim
        conv_state, rec_state = batch.cache.kda_state(self.kda_index)
        sdt = rec_state.dtype
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # pre-conv [T, 3P]
        qkv = self._short_conv(qkv, conv_state, batch)
        q, k, v = qkv.to(sdt).view(T, 3, H, K).unbind(1)
        q = l2_normalize(q) * K**-0.5
        k = l2_normalize(k)
        beta = torch.sigmoid(self.b_proj(x).to(compute_dtype(x.dtype)))
        z = self.f_b_proj(self.f_a_proj(x)).view(T, H, K)
        g = kda_gate(z, self.A_log, self.dt_bias, self.config.kda_gate_lower_bound)
        o = self._delta_rule((q, k, v, g, beta), rec_state, batch)  # [T, H, V] in state dtype
        batch.cache.set_kda_state(self.kda_index, conv_state, rec_state)
        gate = self.g_proj(x) if self.config.kda_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = rms_norm(o, self.o_norm.weight, self.config.rms_norm_eps) * torch.sigmoid(gate.view(T, H, K).to(o.dtype))
        return self.o_proj(o.flatten(1).to(x.dtype))

    def _short_conv(
        self, qkv: torch.Tensor, state: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Depthwise causal conv + SiLU over q|k|v [T, 3P]; advances ``state`` [B, 3P, W-1] in place."""
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)
        out = torch.empty_like(qkv)
        seqs, toks = batch.decode_rows(qkv.device)
        if len(batch.decode_seqs) == batch.num_seqs:  # every sequence decodes: whole states, no gather
            out, new = causal_conv_step(qkv, weight, state)
            state.copy_(new)
        elif len(seqs):
            out[toks], state[seqs] = causal_conv_step(qkv[toks], weight, state[seqs])
        for b in batch.prefill_seqs:
            sl = batch.token_slice(b)
            out[sl], state[b] = causal_conv(qkv[sl], weight, state[b])
        return out

    def _delta_rule(
        self, inputs: tuple[torch.Tensor, ...], state: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """KDA recurrence over (q, k, v, g, beta), each [T, H, *]: one batched step for all
        single-token sequences, a recurrent or chunked pass for each longer one.
        Returns o [T, H, V] and advances ``state`` [B, H, K, V] in place."""
        T = inputs[0].shape[0]
        o = torch.empty(T, self.num_heads, state.shape[-1], dtype=state.dtype, device=state.device)
        seqs, toks = batch.decode_rows(state.device)
        if len(batch.decode_seqs) == batch.num_seqs:  # every sequence decodes: whole states, no gather
            return kda_decode_step_(*inputs, state).to(state.dtype)
        if len(seqs):
            rows = state[seqs]
            o[toks] = kda_decode_step_(*(t[toks] for t in inputs), rows).to(state.dtype)
            state[seqs] = rows
        for b in batch.prefill_seqs:
            sl = batch.token_slice(b)
            kernel = kda_recurrent if batch.query_lens[b] <= RECURRENT_MAX_LEN else kda_chunked
            o_b, s_b = kernel(*(t[sl].unsqueeze(0) for t in inputs), state[b : b + 1])
            o[sl], state[b] = o_b[0], s_b[0]
        return o
