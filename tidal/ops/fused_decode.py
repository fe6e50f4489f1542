"""One C call where a decode step ran a chain of small torch ops on the CPU: RMSNorm, the gated MLP
activations, Block AttnRes, the recurrent part of a KDA layer, the MoE router and the packed routed
experts (csrc/rms_norm.c, activation.c, attn_res.c, kda_layer_decode.c, moe_router.c, mxfp4_gemm.c),
and whole bfloat16 layers (a KDA layer, a gated MLP, an MoE layer: kda_layer_decode.c, mlp_decode.c,
moe_layer_decode.c).

At batch 1 a step's work per op is a few hundred values, so its time went to dispatching ~2,000
aten calls, not to arithmetic. Each function here takes the arguments of the model's math and
returns its result, or None where the kernel does not apply (not the CPU, float64, autograd, the
kernels off: ``TIDAL_CPU_KERNELS=0`` or ``TIDAL_FUSED_DECODE=0``, or a tensor whose op takes a
Triton kernel, as under the interpreter); the model then runs its torch or Triton form. Every kernel computes a row by one thread in a fixed order: a row's bits do not depend on the
batch or the thread count.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tidal.ops import batch_invariant
from tidal.ops.triton import use_triton
from tidal.ops.mxfp4_table import ExpertTable
from tidal.ops.cpu_kernels import (
    DecodeLayer,
    DecodeProgram,
    GlueWeights,
    activation_kernel,
    attn_res_glue_kernel,
    attn_res_kernels,
    fused_decode_enabled,
    kda_layer_chain_kernel,
    KdaLayerWeights,
    MlpWeights,
    kda_layer_decode_kernel,
    kda_layer_step_kernels,
    mla_layer_step_kernel,
    MlaLayerWeights,
    model_decode_kernel,
    mlp_step_kernels,
    moe_layer_step_kernels,
    MoeLayerWeights,
    moe_router_kernel,
    mxfp4_moe_kernel,
    rms_norm_kernel,
    sigmoid_gate_kernel,
)

_DTYPES = (torch.float32, torch.bfloat16)
# Rows up to which the activation, the router and the MLP step run in C: there dispatch costs more than
# the arithmetic; past it torch's vectorised, threaded ops are faster. Under batch invariance they
# run in C at every size (a row's bits must not depend on the batch).
FUSED_MAX_ROWS = 64
# Token slots (tokens x top-k) up to which the routed experts run as one call: its gather,
# activation and weighted sum run on one thread, which past this costs more than torch's threaded
# glue saves around the same grouped GEMM (a prefill chunk); the bits are the same either way.
PACKED_EXPERTS_MAX_SLOTS = 512
MAX_HEAD_DIM = 1024  # the kernel's per-head arrays live on its stack


def _applies(*tensors: torch.Tensor) -> bool:
    if not fused_decode_enabled():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:  # a plain loop: this runs a few hundred times per decode step
        if not t.is_cpu or t.dtype not in _DTYPES or (grad and t.requires_grad):
            return False
    # use_triton is one answer for all CPU tensors (the interpreter's switch): asked once per call.
    return not use_triton(tensors[0])


def _rows_ok(x: torch.Tensor) -> bool:
    """A 2-D tensor of contiguous rows (any row stride)."""
    return x.dim() == 2 and x.stride(1) == 1 and x.shape[0] > 0


def _small(rows: int) -> bool:
    return rows <= FUSED_MAX_ROWS or batch_invariant.enabled()


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.to(torch.float32).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    """:func:`tidal.model.layers.rms_norm` over the last dim of x (rows of any leading shape)."""
    if not _applies(x, *([weight] if weight is not None else [])) or x.numel() == 0 or x.stride(-1) != 1:
        return None
    if weight is not None and (not weight.is_contiguous() or weight.numel() != x.shape[-1]):
        return None
    flat = x.dim() == 2  # decode's rows: no reshape and view around the call
    rows = x if flat else x.reshape(-1, x.shape[-1])
    if rows.stride(1) != 1:
        return None
    fn = rms_norm_kernel()
    if fn is None:
        return None
    out = torch.empty(rows.shape, dtype=x.dtype)
    fn(_ptr(rows), rows.stride(0), _ptr(out), out.stride(0), _ptr(weight) if weight is not None else None,
       int(weight is not None and weight.dtype == torch.bfloat16), rows.shape[0], rows.shape[1], eps,
       int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out if flat else out.view(x.shape)


def gated_activation(gate: torch.Tensor, up: torch.Tensor, situ_betas: tuple[float, float] | None
                     ) -> torch.Tensor | None:
    """:func:`tidal.ops.activation.situ` (``situ_betas`` = (beta, linear_beta)) or, for None,
    :func:`~tidal.ops.activation.swiglu` of gate and up [M, N] (rows of any stride) -> [M, N] in
    gate's dtype."""
    if (not _applies(gate, up) or up.dtype != gate.dtype or not _rows_ok(gate) or not _rows_ok(up)
            or up.shape != gate.shape or not _small(gate.shape[0])):
        return None
    fn = activation_kernel()
    if fn is None:
        return None
    M, N = gate.shape
    out = torch.empty(M, N, dtype=gate.dtype)
    beta, linear_beta = situ_betas if situ_betas is not None else (1.0, 1.0)
    fn(_ptr(gate), gate.stride(0), _ptr(up), up.stride(0), _ptr(out), M, N, int(situ_betas is not None), beta,
       linear_beta, int(gate.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def sigmoid_gate(o: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """The MLA output gate ``o * sigmoid(g)`` of rows o, g [M, N] (any row strides) in float32 -> [M, N]
    in o's dtype (csrc/activation.c: gated_act.h's vector sigmoid, within a few ulps of libm's)."""
    if (not _applies(o, g) or g.dtype != o.dtype or not _rows_ok(o) or not _rows_ok(g) or g.shape != o.shape
            or not _small(o.shape[0])):
        return None
    fn = sigmoid_gate_kernel()
    if fn is None:
        return None
    out = torch.empty(o.shape, dtype=o.dtype)
    fn(_ptr(o), o.stride(0), _ptr(g), g.stride(0), _ptr(out), o.shape[0], o.shape[1], int(o.dtype == torch.bfloat16),
       torch.get_num_threads())
    return out


def router(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
    renormalize: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:meth:`tidal.model.moe.Router.forward`: x [T, d] -> (expert ids [T, k] int64, weights [T, k]
    float32). Scores in float32 sums of one fixed order; exact ties choose the lower expert index
    (torch.topk's order among equal values is unspecified)."""
    if (not _applies(x, weight) or not _rows_ok(x) or not _small(x.shape[0])
            or not _router_ok(weight, bias, k, n_group, topk_group) or weight.shape[1] != x.shape[1]):
        return None
    E = weight.shape[0]
    fn = moe_router_kernel()
    if fn is None:
        return None
    T = x.shape[0]
    bias = _float32(bias)  # only its values are read
    ids = torch.empty(T, k, dtype=torch.int64)
    weights = torch.empty(T, k, dtype=torch.float32)
    if fn(_ptr(x), x.stride(0), int(x.dtype == torch.bfloat16), T, x.shape[1], _ptr(weight),
          int(weight.dtype == torch.bfloat16), E, _ptr(bias), n_group, topk_group, k, int(renormalize), scale,
          _ptr(ids), _ptr(weights), torch.get_num_threads()) != 0:
        raise MemoryError(f"moe_router_topk: no scratch memory for {T} rows")
    return ids, weights


def packed_experts(
    h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: ExpertTable, w2: ExpertTable,
    situ_betas: tuple[float, float] | None,
) -> torch.Tensor | None:
    """:meth:`tidal.model.moe.PackedExperts.forward` (all experts local) in one call: h [T, d], ids
    [T, k], weights [T, k] -> float32 [T, d], the same bits as the grouped-GEMM path. ``w13``: gate |
    up (2I rows), ``w2``: the down projection (one part)."""
    if (not _applies(h) or not (ids.numel() <= PACKED_EXPERTS_MAX_SLOTS or batch_invariant.enabled())
            or not _rows_ok(h) or ids.shape != weights.shape or ids.dim() != 2
            or w2.parts != 1):
        return None
    fn = mxfp4_moe_kernel()
    if fn is None:
        return None
    T, k = ids.shape
    E, two_i = w13.num_experts, w13.rows
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty(T, h.shape[1], dtype=torch.float32)
    beta, linear_beta = situ_betas if situ_betas is not None else (1.0, 1.0)
    if fn(_ptr(h), h.stride(0), int(h.dtype == torch.bfloat16), T, h.shape[1], _ptr(ids), _ptr(weights), k, E,
          _ptr(w13.packed), _ptr(w13.scales), w13.parts, w13.packed_stride, w13.scale_stride, two_i // 2,
          _ptr(w2.packed), _ptr(w2.scales), w2.packed_stride, w2.scale_stride, int(situ_betas is not None), beta,
          linear_beta, _ptr(out), torch.get_num_threads()) != 0:
        raise ValueError(f"routed experts: expert ids outside [0, {E}) or no scratch memory for {T} tokens")
    return out


MAX_BLOCKS = 64  # blocks (and the partial sum) the AttnRes kernels take


class BlockCache(list):
    """What the AttnRes kernels keep of the completed blocks for one forward pass (a caller makes one
    per pass and hands it to every call): each block's inverse RMS (one [T] float32 tensor per
    block, in order), and the blocks' row addresses, row strides and those tensors' addresses in
    the arrays the kernels take. A block never changes once complete, so each is computed and
    written once per pass, not at each of the ~2 glue calls per layer that read it."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = (ctypes.c_void_p * MAX_BLOCKS)()
        self.strides = (ctypes.c_int64 * MAX_BLOCKS)()
        self.invs = (ctypes.c_void_p * MAX_BLOCKS)()


def _blocks_ready(partial: torch.Tensor, blocks: list[torch.Tensor], block_cache: BlockCache, eps: float,
                  inv_fn: Callable, *others: torch.Tensor) -> bool:
    """Whether the AttnRes kernels take these rows (and ``others``, the call's other tensors), after
    computing the inverse RMS of each block not yet in ``block_cache`` (a block never changes once
    complete: once per block and forward pass). The blocks in the cache were checked when they
    entered it: only the new ones and the rows are."""
    n = len(block_cache)
    new = blocks[n:]
    if not _applies(partial, *others, *new) or not _rows_ok(partial) or len(blocks) + 1 > MAX_BLOCKS:
        return False
    T, D = partial.shape
    if n > len(blocks) or (n and block_cache[0].shape[0] != T):
        return False
    if not new:
        return True
    if any(b.dtype != partial.dtype or not _rows_ok(b) or b.shape != partial.shape for b in new):
        return False
    for i, b in enumerate(new, n):
        inv = torch.empty(T, dtype=torch.float32)
        inv_fn(_ptr(b), b.stride(0), T, D, eps, int(partial.dtype == torch.bfloat16), _ptr(inv))
        block_cache.append(inv)
        block_cache.rows[i], block_cache.strides[i], block_cache.invs[i] = _ptr(b), b.stride(0), _ptr(inv)
    return True


def attn_res(partial: torch.Tensor, blocks: list[torch.Tensor], block_cache: BlockCache,
             query: torch.Tensor, eps: float) -> torch.Tensor | None:
    """:func:`tidal.model.attn_res.attn_res` with the pseudo-query ``query`` [d] (float32). A block
    never changes once complete, so its inverse RMS is computed once, into ``block_cache`` (kept by
    the caller for the forward pass)."""
    fns = attn_res_kernels()
    if fns is None or not _blocks_ready(partial, blocks, block_cache, eps, fns[1]):
        return None
    T, D = partial.shape
    values = [*blocks, partial]
    pointers = (ctypes.c_void_p * len(values))(*[_ptr(v) for v in values])
    strides = (ctypes.c_int64 * len(values))(*[v.stride(0) for v in values])
    out = torch.empty(T, D, dtype=partial.dtype)
    fns[0](pointers, strides, len(values), block_cache.invs, _ptr(query), T, D, eps, int(partial.dtype == torch.bfloat16), _ptr(out),
           torch.get_num_threads())
    return out


def attn_res_glue(
    partial: torch.Tensor, add: torch.Tensor | None, blocks: list[torch.Tensor], block_cache: BlockCache,
    query: torch.Tensor, eps: float, norm_weight: torch.Tensor, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The glue between two sub-layers as one C call: ``s = partial + add`` (partial itself where add
    is None), ``a = attn_res(s, blocks)`` (:func:`attn_res`; s itself without blocks) and
    ``rms_norm(a, norm_weight)`` -> (s, a, the normed rows), each with the bits of its separate call;
    None where one of those would not run in C."""
    fn, fns = attn_res_glue_kernel(), attn_res_kernels()
    if fn is None or fns is None:
        return None
    others = (norm_weight,) if add is None else (add, norm_weight)
    if not _blocks_ready(partial, blocks, block_cache, eps, fns[1], *others):
        return None
    T, D = partial.shape
    if add is not None and (add.dtype != partial.dtype or add.shape != partial.shape or not _rows_ok(add)):
        return None
    if not norm_weight.is_contiguous() or norm_weight.numel() != D:
        return None
    total = torch.empty(T, D, dtype=partial.dtype) if add is not None else partial
    mixed = torch.empty(T, D, dtype=partial.dtype) if blocks else total
    normed = torch.empty(T, D, dtype=partial.dtype)
    fn(_ptr(partial), partial.stride(0), _ptr(add) if add is not None else None, add.stride(0) if add is not None else 0,
       _ptr(total), block_cache.rows, block_cache.strides, len(blocks), block_cache.invs, _ptr(query), eps, _ptr(mixed), _ptr(norm_weight),
       int(norm_weight.dtype == torch.bfloat16), norm_eps, _ptr(normed), T, D, int(partial.dtype == torch.bfloat16),
       torch.get_num_threads())
    return total, mixed, normed


def _kda_rows_ok(qkv: torch.Tensor, z: torch.Tensor, gate: torch.Tensor, b: torch.Tensor, conv_state: torch.Tensor,
                 rec_state: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor) -> bool:
    """Whether csrc/kda_layer_decode.c's recurrent part takes these rows, states and weights (see
    :func:`kda_layer_decode`)."""
    H, K, W = rec_state.shape[1], rec_state.shape[2], conv_weight.shape[1]
    return (_applies(qkv, z, gate, b, conv_state) and _kda_states_ok(conv_state, rec_state, W)
            and all(t.dtype == qkv.dtype and _rows_ok(t) for t in (qkv, z, gate, b))
            and (qkv.shape[1], z.shape[1], gate.shape[1], b.shape[1]) == (3 * H * K, H * K, H * K, H)
            and A_log.shape in ((H, 1), (1, K)) and conv_weight.is_contiguous()
            and conv_weight.dtype == torch.float32)


def kda_layer_decode(
    qkv: torch.Tensor, z: torch.Tensor, gate: torch.Tensor, b: torch.Tensor,
    conv_state: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor,
    conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
    o_norm_weight: torch.Tensor, eps: float,
) -> torch.Tensor | None:
    """The recurrent part of :class:`tidal.model.kda.KimiDeltaAttention` for one token per
    sequence (token t of the step in state slot ``slots[t]``, all distinct): from the projections
    qkv [T, 3P] (pre-conv), z = f_b(f_a(x)) [T, P], gate [T, P] (the output gate's input), b [T, H]
    to the gated, normed o [T, P] float32 that o_proj reads. conv_state [N, W-1, 3P] and rec_state
    [N, H, K, K] (float32) are updated in place; conv_weight [3P, W] float32, contiguous."""
    T = qkv.shape[0]
    H, K, W = rec_state.shape[1], rec_state.shape[2], conv_weight.shape[1]
    if slots.shape != (T,) or not _kda_rows_ok(qkv, z, gate, b, conv_state, rec_state, conv_weight, A_log):
        return None
    fn = kda_layer_decode_kernel()
    if fn is None:
        return None
    slots = slots.to(torch.int32).contiguous()
    A_log, dt_bias, o_norm_weight = _float32(A_log), _float32(dt_bias), _float32(o_norm_weight)
    out = torch.empty(T, H * K, dtype=torch.float32)
    fn(_ptr(qkv), qkv.stride(0), _ptr(z), z.stride(0), _ptr(gate), gate.stride(0), _ptr(b), b.stride(0),
       int(qkv.dtype == torch.bfloat16), _ptr(conv_state), conv_state.stride(0),
       int(conv_state.dtype == torch.bfloat16), _ptr(rec_state), rec_state.stride(0), _ptr(slots),
       _ptr(conv_weight), _ptr(A_log), int(A_log.shape == (H, 1)), _ptr(dt_bias),
       0.0 if lower_bound is None else lower_bound, int(lower_bound is not None), _ptr(o_norm_weight), eps,
       _ptr(out), T, H, K, W, torch.get_num_threads())
    return out


def _kda_states_ok(conv_state: torch.Tensor, rec_state: torch.Tensor, W: int) -> bool:
    """The pool layouts the KDA kernels index by slot: float32 CPU recurrent states [N, H, K, K] with
    each slot's block contiguous, conv states [N, W-1, 3P] with contiguous rows."""
    _, _, K, V = rec_state.shape
    return (rec_state.dtype == torch.float32 and rec_state.device.type == "cpu" and V == K and K <= MAX_HEAD_DIM
            and rec_state.stride()[1:] == (K * V, V, 1) and conv_state.stride()[1:] == (conv_state.shape[2], 1)
            and conv_state.shape[1] == W - 1)


@dataclass
class StepPlan:
    """One bfloat16 layer as a one-call step (:func:`kda_layer_step`, :func:`mlp_step`) hands it to
    C: the weights' addresses (in ``weights``; ``tensors`` keeps what they point into alive), the
    scratch floats per token, and a scratch buffer kept from step to step (one engine thread runs a
    layer at a time)."""

    weights: ctypes.Structure
    tensors: tuple[torch.Tensor, ...] = field(repr=False)
    scratch_per_token: int
    scratch: torch.Tensor = field(repr=False)
    keep: tuple[object, ...] = field(default=(), repr=False)  # what else the addresses point into

    def scratch_for(self, rows: int) -> torch.Tensor:
        if self.scratch.numel() < rows * self.scratch_per_token:
            self.scratch = torch.empty(rows * self.scratch_per_token, dtype=torch.float32)
        return self.scratch


def _plan_ok(plan: StepPlan) -> bool:
    """A plan's weights were checked (device, dtype, layout) when it was built, and a plan is rebuilt
    when one changes: only autograd can turn it away."""
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in plan.tensors)


def kda_step_plan(
    in_ws: list[torch.Tensor], f_b: torch.Tensor, g_b: torch.Tensor | None, o_w: torch.Tensor,
    conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
    o_norm_weight: torch.Tensor, eps: float,
) -> StepPlan | None:
    """The plan of a KDA layer whose projections are bfloat16 CPU weights with contiguous rows
    (in_ws: q, k, v, f_a, the output gate's first matrix, b; g_b None for a full-rank gate), or None
    where :func:`kda_layer_step` does not take it (the layer then runs its separate calls). Build it
    once per layer while the weights do not change (``tidal.model.layers.derived_weight``)."""
    kernels = kda_layer_step_kernels()
    mats = [*in_ws, f_b, o_w, *([g_b] if g_b is not None else [])]
    if kernels is None or len(in_ws) != 6 or any(
            w.device.type != "cpu" or w.dtype != torch.bfloat16 or w.dim() != 2 or w.stride(1) != 1 for w in mats):
        return None
    H = in_ws[5].shape[0]
    K = in_ws[3].shape[0]
    d, P = in_ws[0].shape[1], H * K
    R = 0 if g_b is None else g_b.shape[1]
    if (any(w.shape[1] != d for w in in_ws) or sum(w.shape[0] for w in in_ws[:3]) != 3 * P
            or in_ws[4].shape[0] != (R or P) or f_b.shape != (P, K) or o_w.shape != (d, P)
            or (g_b is not None and g_b.shape[0] != P) or A_log.shape not in ((H, 1), (1, K))
            or conv_weight.dtype != torch.float32 or not conv_weight.is_contiguous() or conv_weight.shape[0] != 3 * P):
        return None
    A_log, dt_bias, o_norm_weight = _float32(A_log), _float32(dt_bias), _float32(o_norm_weight)
    if dt_bias.numel() != P or o_norm_weight.numel() != K:
        return None
    weights = KdaLayerWeights(
        hidden=d, heads=H, head_dim=K, conv_kernel=conv_weight.shape[1], gate_rank=R,
        in_w=(ctypes.c_void_p * 6)(*(w.data_ptr() for w in in_ws)),
        in_stride=(ctypes.c_int64 * 6)(*(w.stride(0) for w in in_ws)),
        in_rows=(ctypes.c_int64 * 6)(*(w.shape[0] for w in in_ws)),
        f_b_w=f_b.data_ptr(), g_b_w=g_b.data_ptr() if g_b is not None else None, o_w=o_w.data_ptr(),
        f_b_stride=f_b.stride(0), g_b_stride=g_b.stride(0) if g_b is not None else 0, o_stride=o_w.stride(0),
        conv_w=conv_weight.data_ptr(), A_log=A_log.data_ptr(), dt_bias=dt_bias.data_ptr(),
        o_norm_w=o_norm_weight.data_ptr(), a_per_head=int(A_log.shape == (H, 1)), has_lb=int(lower_bound is not None),
        lower_bound=0.0 if lower_bound is None else lower_bound, eps=eps)
    per_token = kernels[1](ctypes.byref(weights))
    return StepPlan(weights, (*mats, conv_weight, A_log, dt_bias, o_norm_weight), per_token,
                       torch.empty(per_token, dtype=torch.float32))


def _kda_step_states_ok(plan: StepPlan, conv_state: torch.Tensor, rec_state: torch.Tensor) -> bool:
    """Whether a KDA layer step's plan takes these state tensors (see :func:`kda_layer_decode`)."""
    w = plan.weights
    return (rec_state.shape[1:3] == (w.heads, w.head_dim) and conv_state.shape[2] == 3 * w.heads * w.head_dim
            and _kda_states_ok(conv_state, rec_state, w.conv_kernel))


def kda_layer_step(plan: StepPlan, x: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor | None:
    """:meth:`tidal.model.kda.KimiDeltaAttention.forward` of a bfloat16 layer for one token per
    sequence, in one C call (x [T, hidden] bfloat16 -> [T, hidden] bfloat16; token t in state slot
    ``slots[t]``, all distinct; the states updated in place): the bits of the separate calls it
    replaces (the parts product, f_b, :func:`kda_layer_decode`, o_proj). None where it does not
    apply (see :func:`kda_layer_decode`)."""
    w = plan.weights
    T = x.shape[0]
    if (not _applies(x, conv_state) or not _plan_ok(plan) or x.dtype != torch.bfloat16 or not _rows_ok(x) or x.shape[1] != w.hidden
            or slots.shape != (T,) or not _kda_step_states_ok(plan, conv_state, rec_state)):
        return None
    kernels = kda_layer_step_kernels()
    if kernels is None:
        return None
    scratch = plan.scratch_for(T)
    if slots.dtype != torch.int32 or not slots.is_contiguous():
        slots = slots.to(torch.int32).contiguous()
    out = torch.empty(T, w.hidden, dtype=torch.bfloat16)
    if kernels[0](ctypes.byref(w), _ptr(x), x.stride(0), T, _ptr(conv_state), conv_state.stride(0),
                  int(conv_state.dtype == torch.bfloat16), _ptr(rec_state), rec_state.stride(0), _ptr(slots), _ptr(out),
                  _ptr(scratch), torch.get_num_threads()) != 0:
        raise ValueError("kda_layer_step: the layer's projection sizes do not fit its heads")
    return out


def kda_layer_chain(
    qkv: torch.Tensor, z: torch.Tensor, gate: torch.Tensor, b: torch.Tensor,
    conv_state: torch.Tensor, rec_state: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
    src: torch.Tensor, groups: torch.Tensor,
    conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
    o_norm_weight: torch.Tensor, eps: float,
) -> torch.Tensor | None:
    """:func:`kda_layer_decode` over groups of rows run in order (a verified chain's positions, each
    in the state block of the one before; a decode is a group of one): call row t is row
    ``rows[t]`` of qkv/z/gate/b and of the result, in slot ``slots[t]``, its state first copied from
    slot ``src[t]`` where that is >= 0; ``groups`` [G + 1] int64 are the groups' first call rows
    and the total. Returns o [qkv rows, P] float32 (the rows not named are left unwritten), or None
    where the kernel does not apply."""
    T = rows.shape[0]
    H, K, W = rec_state.shape[1], rec_state.shape[2], conv_weight.shape[1]
    if (slots.shape != (T,) or src.shape != (T,) or groups.dim() != 1
            or not _kda_rows_ok(qkv, z, gate, b, conv_state, rec_state, conv_weight, A_log)):
        return None
    fn = kda_layer_chain_kernel()
    if fn is None:
        return None
    rows, groups = rows.to(torch.int64).contiguous(), groups.to(torch.int64).contiguous()
    slots, src = slots.to(torch.int32).contiguous(), src.to(torch.int32).contiguous()
    A_log, dt_bias, o_norm_weight = _float32(A_log), _float32(dt_bias), _float32(o_norm_weight)
    out = torch.empty(qkv.shape[0], H * K, dtype=torch.float32)
    fn(_ptr(qkv), qkv.stride(0), _ptr(z), z.stride(0), _ptr(gate), gate.stride(0), _ptr(b), b.stride(0),
       int(qkv.dtype == torch.bfloat16), _ptr(conv_state), conv_state.stride(0),
       int(conv_state.dtype == torch.bfloat16), _ptr(rec_state), rec_state.stride(0), _ptr(rows), _ptr(slots),
       _ptr(src), _ptr(groups), groups.shape[0] - 1, _ptr(conv_weight), _ptr(A_log), int(A_log.shape == (H, 1)),
       _ptr(dt_bias), 0.0 if lower_bound is None else lower_bound, int(lower_bound is not None), _ptr(o_norm_weight),
       eps, _ptr(out), out.stride(0), H, K, W, torch.get_num_threads())
    return out


def _bf16_rows_weight(w: torch.Tensor) -> bool:
    return w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.dim() == 2 and w.stride(1) == 1


def mlp_step_plan(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                  situ_betas: tuple[float, float] | None) -> StepPlan | None:
    """The plan of a gated MLP with bfloat16 CPU weights of contiguous rows (gate, up [I, d], down
    [d, I]; ``situ_betas`` as :func:`gated_activation`'s), or None where :func:`mlp_step` does not
    take it. Build it once while the weights do not change (``tidal.model.layers.derived_weight``)."""
    kernels = mlp_step_kernels()
    (inter, d) = gate.shape
    if (kernels is None or not all(_bf16_rows_weight(w) for w in (gate, up, down)) or up.shape != (inter, d)
            or down.shape != (d, inter)):
        return None
    beta, linear_beta = situ_betas if situ_betas is not None else (1.0, 1.0)
    weights = MlpWeights(
        hidden=d, inter=inter, gate_up=(ctypes.c_void_p * 2)(gate.data_ptr(), up.data_ptr()),
        gate_up_stride=(ctypes.c_int64 * 2)(gate.stride(0), up.stride(0)), gate_up_rows=(ctypes.c_int64 * 2)(inter, inter),
        down=down.data_ptr(), down_stride=down.stride(0), kind=int(situ_betas is not None), beta=beta,
        linear_beta=linear_beta)
    per_row = kernels[1](ctypes.byref(weights))
    return StepPlan(weights, (gate, up, down), per_row, torch.empty(per_row, dtype=torch.float32))


def mlp_step(plan: StepPlan, x: torch.Tensor) -> torch.Tensor | None:
    """:meth:`tidal.model.moe.KimiMLP.forward` of bfloat16 rows x [T, d] -> [T, d] bfloat16 in one C
    call, with the bits of the separate calls it replaces (the gate|up parts product,
    :func:`gated_activation`, the down product); None where it does not apply: more rows than the
    activation kernel takes, rows that are not bfloat16, batch invariance, the kernels off."""
    w = plan.weights
    if (not _applies(x) or not _plan_ok(plan) or x.dtype != torch.bfloat16 or not _rows_ok(x) or x.shape[1] != w.hidden
            or x.shape[0] > FUSED_MAX_ROWS or batch_invariant.enabled()):
        return None
    kernels = mlp_step_kernels()
    if kernels is None:
        return None
    T = x.shape[0]
    scratch = plan.scratch_for(T)
    out = torch.empty(T, w.hidden, dtype=torch.bfloat16)
    if kernels[0](ctypes.byref(w), _ptr(x), x.stride(0), T, _ptr(out), _ptr(scratch), torch.get_num_threads()) != 0:
        raise ValueError("mlp_step: gate and up weights of different sizes")
    return out


def _router_ok(weight: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int) -> bool:
    """The routers :func:`router` takes (any row count aside)."""
    E = weight.shape[0] if weight.dim() == 2 else 0
    return (weight.dim() == 2 and weight.is_contiguous() and weight.dtype in _DTYPES and weight.device.type == "cpu"
            and bias.shape == (E,) and 0 < k <= E and (n_group <= 1 or (E % n_group == 0 and 0 < topk_group <= n_group)))


def moe_layer_plan(
    router_w: torch.Tensor, router_bias: torch.Tensor, k: int, n_group: int, topk_group: int, renormalize: bool,
    scale: float, latent: tuple[torch.Tensor, torch.Tensor] | None, norm: tuple[torch.Tensor, float] | None,
    w13: ExpertTable, w2: ExpertTable, situ_betas: tuple[float, float] | None, shared: StepPlan | None,
) -> StepPlan | None:
    """The plan of a bfloat16 MoE layer with packed MXFP4 routed experts for :func:`moe_layer_step`:
    the router (weight [E, d], correction bias [E], the routing of :func:`router`), K3's latent
    (down [de, d], up [d, de]) bfloat16 weights and norm (weight [de], eps), or None for both; the
    experts' (gate | up, down) tables (:func:`packed_experts`'s); the shared expert's
    :func:`mlp_step_plan`. None where the one call does not take the layer (its separate calls run
    instead). Build it once while no weight changes (``tidal.model.layers.derived_weight``)."""
    kernels = moe_layer_step_kernels()
    if kernels is None or not _router_ok(router_w, router_bias, k, n_group, topk_group) or w2.parts != 1:
        return None
    E, d = router_w.shape
    de, inter = w2.rows, w2.cols
    if latent is not None:
        down, up = latent
        if not (_bf16_rows_weight(down) and _bf16_rows_weight(up) and down.shape == (de, d) and up.shape == (d, de)):
            return None
    elif de != d or norm is not None:
        return None
    if norm is not None and (not norm[0].is_contiguous() or norm[0].numel() != de or norm[0].dtype not in _DTYPES
                             or norm[0].device.type != "cpu"):
        return None
    if (w13.num_experts != E or w2.num_experts != E or w13.rows != 2 * inter or w13.cols != de
            or (shared is not None and shared.weights.hidden != d)):
        return None
    bias = _float32(router_bias)
    beta, linear_beta = situ_betas if situ_betas is not None else (1.0, 1.0)
    weights = MoeLayerWeights(
        hidden=d, expert_hidden=de, num_experts=E, top_k=k, n_group=n_group, topk_group=topk_group,
        renormalize=int(renormalize), routed_scale=scale, router_w=router_w.data_ptr(),
        router_bf16=int(router_w.dtype == torch.bfloat16), router_bias=bias.data_ptr(),
        down_w=latent[0].data_ptr() if latent else None, up_w=latent[1].data_ptr() if latent else None,
        down_stride=latent[0].stride(0) if latent else 0, up_stride=latent[1].stride(0) if latent else 0,
        norm_w=norm[0].data_ptr() if norm else None, norm_bf16=int(norm is not None and norm[0].dtype == torch.bfloat16),
        norm_eps=norm[1] if norm else 0.0, w13=w13.packed.data_ptr(), w13_scales=w13.scales.data_ptr(),
        w13_parts=w13.parts, w13_stride=w13.packed_stride, w13_scale_stride=w13.scale_stride, inter=inter,
        w2=w2.packed.data_ptr(), w2_scales=w2.scales.data_ptr(), w2_stride=w2.packed_stride,
        w2_scale_stride=w2.scale_stride, act_kind=int(situ_betas is not None), beta=beta, linear_beta=linear_beta,
        shared=ctypes.pointer(shared.weights) if shared is not None else None)
    tensors = (router_w, bias, *(latent or ()), *([norm[0]] if norm else []), *(shared.tensors if shared else ()))
    per_row = kernels[1](ctypes.byref(weights))
    return StepPlan(weights, tensors, per_row, torch.empty(max(1, per_row), dtype=torch.float32),
                    keep=(w13, w2, shared))


def moe_layer_step(plan: StepPlan, x: torch.Tensor) -> torch.Tensor | None:
    """:meth:`tidal.model.moe.KimiMoE.forward` of bfloat16 rows x [T, d] -> [T, d] bfloat16 in one C
    call, with the bits of the separate calls it replaces (:func:`router`, the latent projections,
    :func:`packed_experts`, :func:`rms_norm`, :func:`mlp_step`, the bfloat16 sum); None where it does
    not apply: more rows than the router and the MLP step take, rows that are not bfloat16, batch
    invariance, the kernels off."""
    w = plan.weights
    T = x.shape[0]
    if (not _applies(x) or not _plan_ok(plan) or x.dtype != torch.bfloat16 or not _rows_ok(x) or x.shape[1] != w.hidden
            or T > FUSED_MAX_ROWS or T * w.top_k > PACKED_EXPERTS_MAX_SLOTS or batch_invariant.enabled()):
        return None
    kernels = moe_layer_step_kernels()
    if kernels is None:
        return None
    scratch = plan.scratch_for(T)
    out = torch.empty(T, w.hidden, dtype=torch.bfloat16)
    status = kernels[0](ctypes.byref(w), _ptr(x), x.stride(0), T, _ptr(out), _ptr(scratch), torch.get_num_threads())
    if status != 0:
        raise ValueError("moe_layer_step: expert ids outside the experts, or no scratch memory" if status == -1
                         else "moe_layer_step: the shared expert's gate and up weights differ in size")
    return out


def _norm_ok(w: torch.Tensor, n: int) -> bool:
    return w.device.type == "cpu" and w.dtype in _DTYPES and w.is_contiguous() and w.numel() == n


def mla_layer_plan(
    in_ws: list[torch.Tensor], q_b: torch.Tensor | None, q_norm: tuple[torch.Tensor, float] | None,
    kv_norm: tuple[torch.Tensor, float], kv_b: torch.Tensor, o_w: torch.Tensor, heads: int, nope: int, rope: int,
    v_dim: int, scale: float,
) -> StepPlan | None:
    """The plan of a bfloat16 MLA layer for :func:`mla_layer_step`: in_ws the input projections'
    weights (q_a, or q_proj without q-LoRA; kv_a; the output gate's, when gated), q_b (None without
    q-LoRA) with q_a_layernorm's (weight, eps), kv_a_layernorm's, kv_b [heads (nope + v_dim), rank]
    contiguous, o_proj. None where the one call does not take the layer. Build it once while no
    weight changes (``tidal.model.layers.derived_weight``)."""
    if mla_layer_step_kernel() is None or len(in_ws) not in (2, 3) or (q_b is None) != (q_norm is None):
        return None
    mats = [*in_ws, kv_b, o_w, *([q_b] if q_b is not None else [])]
    if not all(_bf16_rows_weight(w) for w in mats) or not kv_b.is_contiguous():
        return None
    d, rank = in_ws[0].shape[1], kv_b.shape[1]
    q_rank = in_ws[0].shape[0] if q_b is not None else 0
    if (any(w.shape[1] != d for w in in_ws) or in_ws[1].shape[0] != rank + rope or kv_b.shape[0] != heads * (nope + v_dim)
            or o_w.shape != (d, heads * v_dim) or (len(in_ws) == 3 and in_ws[2].shape[0] != heads * v_dim)
            or (q_b is not None and q_b.shape != (heads * (nope + rope), q_rank))
            or (q_b is None and in_ws[0].shape[0] != heads * (nope + rope))
            or not _norm_ok(kv_norm[0], rank) or (q_norm is not None and not _norm_ok(q_norm[0], q_rank))):
        return None
    ws = list(in_ws) + [in_ws[0]] * (3 - len(in_ws))  # the unused third part is never read
    weights = MlaLayerWeights(
        hidden=d, heads=heads, q_rank=q_rank, kv_rank=rank, nope=nope, rope=rope, v_dim=v_dim, gated=int(len(in_ws) == 3),
        in_w=(ctypes.c_void_p * 3)(*(w.data_ptr() for w in ws)), in_stride=(ctypes.c_int64 * 3)(*(w.stride(0) for w in ws)),
        in_rows=(ctypes.c_int64 * 3)(*(w.shape[0] for w in ws)), q_b_w=q_b.data_ptr() if q_b is not None else None,
        q_b_stride=q_b.stride(0) if q_b is not None else 0, q_norm_w=q_norm[0].data_ptr() if q_norm else None,
        kv_norm_w=kv_norm[0].data_ptr(), q_norm_bf16=int(q_norm is not None and q_norm[0].dtype == torch.bfloat16),
        kv_norm_bf16=int(kv_norm[0].dtype == torch.bfloat16), q_eps=q_norm[1] if q_norm else 0.0, kv_eps=kv_norm[1],
        scale=scale, kv_b_w=kv_b.data_ptr(), o_w=o_w.data_ptr(), o_stride=o_w.stride(0))
    tensors = (*mats, kv_norm[0], *([q_norm[0]] if q_norm else []))
    return StepPlan(weights, tensors, 0, torch.empty(1, dtype=torch.float32))


def _mla_pages_ok(plan: StepPlan, pages: torch.Tensor) -> bool:
    """Whether an MLA layer step's plan takes these pages (bfloat16 [P, page_size, C], rows contiguous)."""
    w = plan.weights
    return (pages.dtype == torch.bfloat16 and pages.dim() == 3 and pages.stride()[1:] == (pages.shape[2], 1)
            and pages.shape[2] == w.kv_rank + w.rope)


def mla_layer_step(plan: StepPlan, x: torch.Tensor, pages: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
                   write: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
    """:meth:`tidal.model.mla.KimiMLA.forward` of a decode step (one new token per sequence, row t of
    x [T, hidden] bfloat16 for sequence t) in one C call -> [T, hidden] bfloat16, with the bits of
    the separate calls it replaces; the new latents are written into their page rows ``write`` =
    (page ids [T], rows in the page [T]) of pages [P, page_size, C] (bfloat16, each page's rows
    contiguous), and attention reads ``lengths[t]`` rows of pages ``table[t]``. None where it does
    not apply (more rows than the small kernels take, batch invariance, the kernels off)."""
    w = plan.weights
    T = x.shape[0]
    if (not _applies(x, pages) or not _plan_ok(plan) or x.dtype != torch.bfloat16
            or not _rows_ok(x) or x.shape[1] != w.hidden or T > FUSED_MAX_ROWS or batch_invariant.enabled()
            or not _mla_pages_ok(plan, pages)
            or table.shape[0] != T or lengths.shape != (T,) or write[0].shape != (T,) or write[1].shape != (T,)):
        return None
    fn = mla_layer_step_kernel()
    if fn is None:
        return None
    table, lengths = table.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
    out = torch.empty(T, w.hidden, dtype=torch.bfloat16)
    status = fn(ctypes.byref(w), _ptr(x), x.stride(0), T, _ptr(pages), pages.stride(0), pages.shape[1], _ptr(table),
                table.shape[1], _ptr(lengths), _ptr(write[0]), _ptr(write[1]), _ptr(out), torch.get_num_threads())
    if status != 0:
        raise ValueError("mla_layer_step: no scratch memory" if status == -1
                         else "mla_layer_step: the projections' sizes do not fit the heads")
    return out


# ---- a whole decode step in one call (csrc/model_decode.c) ----------------------------------------

KDA, MLA = 0, 1  # a layer's attention
DENSE_MLP, MOE = 0, 1  # its feed-forward


@dataclass
class LayerSteps:
    """One decoder layer as :func:`model_decode_step` takes it: its attention's and feed-forward's
    one-call step plans (``attn_kind`` KDA or MLA, ``ffn_kind`` DENSE_MLP or MOE) and the AttnRes
    glue before each, (pseudo-query [d] float32, the sub-layer's input norm weight, its eps)."""

    attn: StepPlan
    attn_kind: int
    ffn: StepPlan
    ffn_kind: int
    attn_glue: tuple[torch.Tensor, torch.Tensor, float]
    ffn_glue: tuple[torch.Tensor, torch.Tensor, float]


@dataclass
class ModelStepPlan:
    """A bfloat16 model's decode step as csrc/model_decode.c takes it (the structures it reads, and
    what they point into)."""

    program: DecodeProgram
    layers: ctypes.Array = field(repr=False)
    steps: list[LayerSteps] = field(repr=False)
    out_glue: tuple[torch.Tensor, torch.Tensor, float] = field(repr=False)


def _glue_weights(glue: tuple[torch.Tensor, torch.Tensor, float], hidden: int) -> GlueWeights | None:
    query, norm_w, eps = glue
    if (query.dtype != torch.float32 or not query.is_contiguous() or query.numel() != hidden or not query.is_cpu
            or not _norm_ok(norm_w, hidden)):
        return None
    return GlueWeights(query=query.data_ptr(), norm_w=norm_w.data_ptr(), norm_bf16=int(norm_w.dtype == torch.bfloat16),
                       norm_eps=eps)


def model_step_plan(layers: list[LayerSteps], out_glue: tuple[torch.Tensor, torch.Tensor, float], hidden: int,
                    block_size: int, eps: float) -> ModelStepPlan | None:
    """The plan of :func:`model_decode_step` for a Block AttnRes model whose every layer takes its
    one-call step, or None (the kernel unavailable, a glue it does not take)."""
    if model_decode_kernel() is None or not layers or block_size < 1 or -(-len(layers) // block_size) + 1 > MAX_BLOCKS:
        return None  # (the blocks and the partial sum are the AttnRes kernels' values)
    arr = (DecodeLayer * len(layers))()
    for entry, step in zip(arr, layers):
        attn_glue, ffn_glue = _glue_weights(step.attn_glue, hidden), _glue_weights(step.ffn_glue, hidden)
        if attn_glue is None or ffn_glue is None or step.attn.weights.hidden != hidden or step.ffn.weights.hidden != hidden:
            return None
        entry.attn_kind, entry.attn_w = step.attn_kind, ctypes.addressof(step.attn.weights)
        entry.ffn_kind, entry.ffn_w = step.ffn_kind, ctypes.addressof(step.ffn.weights)
        entry.attn_glue, entry.ffn_glue = attn_glue, ffn_glue
    out = _glue_weights(out_glue, hidden)
    if out is None:
        return None
    program = DecodeProgram(num_layers=len(layers), hidden=hidden, block_size=block_size, eps=eps,
                            layers=ctypes.cast(arr, ctypes.POINTER(DecodeLayer)), out_glue=out)
    return ModelStepPlan(program, arr, layers, out_glue)


def model_decode_step(plan: ModelStepPlan, h: torch.Tensor, slots: torch.Tensor,
                      kda_states: list[tuple[torch.Tensor, torch.Tensor]], mla_pages: list[torch.Tensor],
                      table: torch.Tensor | None, lengths: torch.Tensor | None,
                      write: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
    """The decode step of :func:`model_step_plan`'s model from the embeddings h [T, d] bfloat16 (one new
    token per sequence) to the final-normed hidden states [T, d] bfloat16, in one C call with the
    bits of the layers' separate steps and glue; the KDA states (``kda_states``, per KDA layer in
    order: token t in slot ``slots[t]``) and MLA pages (``mla_pages`` per MLA layer; token t attends
    over ``lengths[t]`` rows of pages ``table[t]`` and writes its latent at ``write``) updated in
    place. None where a layer's step would not apply (see :func:`kda_layer_step`,
    :func:`mla_layer_step`, :func:`moe_layer_step`, :func:`mlp_step`)."""
    fn = model_decode_kernel()
    T = h.shape[0] if h.dim() == 2 else 0
    if (fn is None or not _applies(h) or h.dtype != torch.bfloat16 or not h.is_contiguous() or T == 0
            or T > FUSED_MAX_ROWS or batch_invariant.enabled() or slots.shape != (T,)
            or h.shape[1] != plan.program.hidden):
        return None
    kda, mla = iter(kda_states), iter(mla_pages)
    for entry, step in zip(plan.layers, plan.steps):
        if not _plan_ok(step.attn) or not _plan_ok(step.ffn):
            return None
        if step.attn_kind == KDA:
            conv_state, rec_state = next(kda)
            if not _applies(conv_state) or not _kda_step_states_ok(step.attn, conv_state, rec_state):
                return None
            entry.conv_state, entry.conv_stride = conv_state.data_ptr(), conv_state.stride(0)
            entry.conv_bf16, entry.rec_state, entry.rec_stride = (int(conv_state.dtype == torch.bfloat16),
                                                                  rec_state.data_ptr(), rec_state.stride(0))
            entry.attn_scratch = step.attn.scratch_for(T).data_ptr()
        else:
            pages = next(mla)
            if not _applies(pages) or not _mla_pages_ok(step.attn, pages) or table is None or write is None:
                return None
            entry.pages, entry.page_stride, entry.page_size = pages.data_ptr(), pages.stride(0), pages.shape[1]
        if step.ffn_kind == MOE and T * step.ffn.weights.top_k > PACKED_EXPERTS_MAX_SLOTS:
            return None
        entry.ffn_scratch = step.ffn.scratch_for(T).data_ptr()
    if table is not None:
        table, lengths = table.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
        if table.shape[0] != T or lengths.shape != (T,) or write[0].shape != (T,) or write[1].shape != (T,):
            return None
    if slots.dtype != torch.int32 or not slots.is_contiguous():
        slots = slots.to(torch.int32).contiguous()
    out = torch.empty(T, plan.program.hidden, dtype=torch.bfloat16)
    status = fn(ctypes.byref(plan.program), _ptr(h), T, _ptr(slots), _ptr(table) if table is not None else None,
                table.shape[1] if table is not None else 0, _ptr(lengths) if lengths is not None else None,
                _ptr(write[0]) if write is not None else None, _ptr(write[1]) if write is not None else None, _ptr(out),
                torch.get_num_threads())
    if status != 0:
        raise ValueError("model_decode_step: a layer's weights do not fit its kernel" if status == -2 else
                         "model_decode_step: no scratch memory, or expert ids outside the experts")
    return out
