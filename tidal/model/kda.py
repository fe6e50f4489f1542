"""Kimi Delta Attention layer (spec §1): projections, short conv, gates, KDA kernel, gated norm."""

from __future__ import annotations

import torch
from torch import nn

from tidal.config import ModelConfig
from tidal.model.context import ForwardBatch
from tidal.model.layers import (Conv1d, FusedWeights, compute_dtype, derived_weight, fuse_linears, linear, rms_norm,
                                 kept_derived)
from tidal.ops import backends, batch_invariant, dense, fused_decode
from tidal.ops.kda import (
    CHUNK,
    kda_chunked,
    kda_decode_step_,
    kda_gate,
    kda_recurrent,
    l2_normalize,
)
from tidal.ops.short_conv import causal_conv, causal_conv_step
from tidal.ops.triton import use_triton
from tidal.spec.verify import verify_conv, verify_delta, verify_kda_fused

# Prefill pieces up to this many tokens run the token-by-token kernel (cheaper than one chunk).
RECURRENT_MAX_LEN = 12


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
        self.q_conv1d = Conv1d(P, P, W, groups=P, bias=False)
        self.k_conv1d = Conv1d(P, P, W, groups=P, bias=False)
        self.v_conv1d = Conv1d(P, P, W, groups=P, bias=False)
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
        self.in_proj: FusedWeights | None = None  # set by fuse_weights (serving)

    def fuse_weights(self) -> None:
        """Make the projections of x (q, k, v, f_a, the output gate's first matrix, b) row views of
        one tensor, so a step runs one matmul for all of them; parameters and state_dict keep their
        names and values. 16-bit CPU weights stay apart (``layers.keeps_apart``): one parts product."""
        gate = self.g_proj if self.config.kda_full_rank_gate else self.g_a_proj
        self.in_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, gate, self.b_proj])

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(pre-conv q|k|v [T, 3P], f_a(x) [T, K], output-gate input [T, K or P], b(x) [T, H])."""
        fused = self.in_proj.for_forward() if self.in_proj is not None else None
        if fused is not None:
            sizes = self.in_proj.sizes  # q, k, v (taken together), f_a, gate, b
            return dense.linear(x, fused).split([sum(sizes[:3]), *sizes[3:]], dim=-1)
        gate = self.g_proj if self.config.kda_full_rank_gate else self.g_a_proj
        ws = [m.weight for m in (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, gate, self.b_proj)]
        sizes = [w.shape[0] for w in ws]
        return dense.linear_parts(x, ws).split([sum(sizes[:3]), *sizes[3:]], dim=-1)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; updates this layer's states of the step's sequences in
        place in ``batch.cache``."""
        T = x.shape[0]
        H, K = self.num_heads, self.head_dim
        conv_state, rec_state = batch.cache.kda_storage(self.kda_index)
        # A pure decode step of a bfloat16 CPU layer (its projections left apart, not fused): the whole
        # layer in one kernel call (under batch invariance the torch ops below: see the recurrent part's call).
        if batch.is_decode and T and x.is_cpu and self.in_proj is None and not batch_invariant.enabled():
            plan = self._step_plan()
            if plan is not None:
                out = fused_decode.kda_layer_step(plan, x, conv_state, rec_state, batch.decode_slots(x.device))
                if out is not None:
                    return out
        sdt = rec_state.dtype
        qkv, f_a, gate, b = self._project(x)
        z = self.f_b_proj(f_a)
        if not self.config.kda_full_rank_gate:
            gate = self.g_b_proj(gate)
        # A pure decode step in one kernel call. Not under batch invariance: there a token's bits must
        # not depend on whether its step also prefills (mixed steps run the torch ops below).
        if batch.verify_seqs and not batch.prefill_seqs and batch.verify.method == "swap" and T \
                and not batch_invariant.enabled():
            o = verify_kda_fused(qkv, z, gate, b, conv_state, rec_state, batch, conv_weight=self._conv_weight(),
                                 A_log=self.A_log, dt_bias=self.dt_bias,
                                 lower_bound=self.config.kda_gate_lower_bound, o_norm_weight=self._o_norm_weight(),
                                 eps=self.config.rms_norm_eps)
            if o is not None:
                return self.o_proj(o.to(x.dtype))
        if batch.is_decode and T and not batch_invariant.enabled():
            o = fused_decode.kda_layer_decode(
                qkv, z, gate, b, conv_state, rec_state, batch.decode_slots(x.device), self._conv_weight(),
                self.A_log, self.dt_bias, self.config.kda_gate_lower_bound, self._o_norm_weight(),
                self.config.rms_norm_eps)
            if o is not None:
                return self.o_proj(o.to(x.dtype))
        qkv = self._short_conv(qkv, conv_state, batch)
        q, k, v = qkv.to(sdt).view(T, 3, H, K).unbind(1)
        q = l2_normalize(q) * K**-0.5
        k = l2_normalize(k)
        b = b.to(compute_dtype(x.dtype))
        beta = batch_invariant.rowwise(torch.sigmoid, b) if batch_invariant.enabled() else torch.sigmoid(b)
        g = kda_gate(z.view(T, H, K), self.A_log, self.dt_bias, self.config.kda_gate_lower_bound)
        o = self._delta_rule((q, k, v, g, beta), rec_state, batch)  # [T, H, V] in state dtype
        o = rms_norm(o, self.o_norm.weight, self.config.rms_norm_eps) * torch.sigmoid(gate.view(T, H, K).to(o.dtype))
        return self.o_proj(o.flatten(1).to(x.dtype))

    def decode_step_plan(self) -> fused_decode.StepPlan | None:
        """The plan of the layer's one-call decode step where it takes one (its projections left
        apart), else None."""
        return self._step_plan() if self.in_proj is None else None

    @kept_derived("_step_plan_cached")
    def _step_plan(self) -> fused_decode.StepPlan | None:
        """The layer's weights as the one-call decode step takes them (kept while none changes),
        or None where it does not take them (float32 or fused projections, another device)."""
        gate = self.g_proj if self.config.kda_full_rank_gate else self.g_a_proj
        g_b = None if self.config.kda_full_rank_gate else self.g_b_proj.weight
        in_ws = [m.weight for m in (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, gate, self.b_proj)]
        params = (*in_ws, self.f_b_proj.weight, self.o_proj.weight, *([g_b] if g_b is not None else []),
                  self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight, self.A_log, self.dt_bias,
                  self.o_norm.weight)
        return derived_weight(self, "_step_plan_cached", params, lambda: fused_decode.kda_step_plan(
            in_ws, self.f_b_proj.weight, g_b, self.o_proj.weight, self._conv_weight(), self.A_log, self.dt_bias,
            self.config.kda_gate_lower_bound, self._o_norm_weight(), self.config.rms_norm_eps))

    def _o_norm_weight(self) -> torch.Tensor:
        """The output norm's weight in float32, as the fused kernels read it (kept while it does not
        change: a bf16 model would otherwise cast it at every step)."""
        w = self.o_norm.weight
        if w.dtype not in (torch.bfloat16, torch.float16):
            return w
        return derived_weight(self, "_o_norm_weight_f32", (w,), lambda: w.to(torch.float32).contiguous())

    def _conv_weight(self) -> torch.Tensor:
        """The q|k|v conv weights as one float32 [3P, W] tensor (kept while they do not change)."""
        params = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        return derived_weight(self, "_conv_weight_f32", params,
                              lambda: torch.cat(params).squeeze(1).to(torch.float32).contiguous())

    def _short_conv(
        self, qkv: torch.Tensor, state: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Depthwise causal conv + SiLU over q|k|v [T, 3P]; advances the sequences' rows of the
        conv storage ``state`` [N, W-1, 3P] in place."""
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)
        out = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        if batch.decode_seqs and use_triton(qkv):  # one kernel on the pool's rows by slot
            rows = batch.decode_tokens(qkv.device)
            out[rows] = backends.conv_decode_(qkv[rows], weight, state, batch.decode_slots(qkv.device))
        else:
            for run in batch.decode_runs(qkv.device):
                rows = state[run.slots]
                out[run.tokens], new = causal_conv_step(qkv[run.tokens], weight, rows)
                rows.copy_(new)
        if batch.verify_seqs:
            verify_conv(qkv, weight, state, batch, self.kda_index, out)
        for b in batch.prefill_seqs:
            sl, row = batch.token_slice(b), state[batch.cache.state_slots[b]]
            out[sl], new = causal_conv(qkv[sl], weight, row)
            row.copy_(new)
        return out

    def _delta_rule(
        self, inputs: tuple[torch.Tensor, ...], state: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """KDA recurrence over (q, k, v, g, beta), each [T, H, *]: single-token sequences step in
        place on views of the state storage ``state`` [N, H, K, V], run by run; longer ones go
        through the recurrent kernel alone or the chunked kernel batched with others of the same
        number of chunks. Returns o [T, H, V]."""
        T = inputs[0].shape[0]
        if state.is_cuda:
            return self._delta_rule_cuda(inputs, state, batch)
        o = torch.empty(T, self.num_heads, state.shape[-1], dtype=state.dtype, device=state.device)
        for run in batch.decode_runs(state.device):
            o[run.tokens] = kda_decode_step_(*(t[run.tokens] for t in inputs), state[run.slots]).to(state.dtype)
        if batch.verify_seqs:
            verify_delta(inputs, state, batch, self.kda_index, o)
        slots = batch.cache.state_slots
        groups: dict[int, list[int]] = {}
        for b in batch.prefill_seqs:
            n = batch.query_lens[b]
            if batch_invariant.enabled():  # each token as a decode step: any chunking, the same bits
                s = slots[b]
                for t in range(batch.token_slice(b).start, batch.token_slice(b).stop):
                    o[t : t + 1] = kda_decode_step_(*(x[t : t + 1] for x in inputs), state[s : s + 1]).to(state.dtype)
            elif n <= RECURRENT_MAX_LEN:
                sl, s = batch.token_slice(b), slots[b]
                o_b, s_b = kda_recurrent(*(t[sl].unsqueeze(0) for t in inputs), state[s : s + 1])
                o[sl], state[s] = o_b[0], s_b[0]
            else:
                groups.setdefault(-(-n // CHUNK), []).append(b)
        for seqs in groups.values():
            self._chunked_group(inputs, state, batch, seqs, o)
        return o

    def _delta_rule_cuda(
        self, inputs: tuple[torch.Tensor, ...], state: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """On the GPU, fla's kernels on the pool's states by slot: decode tokens in one in-place
        recurrent call, every prefill sequence in one varlen chunked call."""
        dev = state.device
        o = torch.zeros(inputs[0].shape[0], self.num_heads, state.shape[-1], dtype=state.dtype, device=dev)
        if batch.verify_seqs:
            verify_delta(inputs, state, batch, self.kda_index, o)
        if batch.decode_seqs:
            rows = batch.decode_tokens(dev)
            o[rows] = backends.kda_decode_(*(t[rows] for t in inputs), state, batch.decode_slots(dev),
                                           batch.decode_cu_seqlens(dev)).to(state.dtype)
        if batch.prefill_seqs:
            slices = [batch.token_slice(b) for b in batch.prefill_seqs]
            rows = torch.cat([torch.arange(sl.start, sl.stop) for sl in slices]).to(dev)
            cu = [0]
            for sl in slices:
                cu.append(cu[-1] + sl.stop - sl.start)
            slots = torch.tensor([batch.cache.state_slots[b] for b in batch.prefill_seqs], device=dev)
            o[rows] = backends.kda_prefill_(*(t[rows] for t in inputs), state, slots, cu).to(state.dtype)
        return o

    def _chunked_group(
        self, inputs: tuple[torch.Tensor, ...], state: torch.Tensor, batch: ForwardBatch, seqs: list[int],
        o: torch.Tensor,
    ) -> None:
        """One chunked-kernel call for sequences with the same number of chunks: each is zero-padded
        at its end to the longest (padding tokens neither decay nor write the state)."""
        slices = [batch.token_slice(b) for b in seqs]
        longest = max(sl.stop - sl.start for sl in slices)
        padded = []
        for t in inputs:
            parts = [torch.nn.functional.pad(t[sl], (0, 0) * (t.dim() - 1) + (0, longest - (sl.stop - sl.start)))
                     for sl in slices]
            padded.append(torch.stack(parts))
        index = torch.tensor([batch.cache.state_slots[b] for b in seqs], dtype=torch.long, device=state.device)
        out, new = kda_chunked(*padded, state[index])
        state[index] = new
        for i, sl in enumerate(slices):
            o[sl] = out[i, : sl.stop - sl.start]
