"""Dense MLP, sigmoid-routed MoE with shared experts, and K3's latent MoE (spec §3).

Speed on the CPU (benchmarks/bench_moe.py): decode multiplies each expert's weights by a few rows,
where the weights come from memory and the layout of the product decides the speed; :func:`project`
picks it. ``fuse_weights()`` (called before serving) makes gate+up one matmul.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from tidal.config import ModelConfig
from tidal.model.layers import (FusedWeights, RMSNorm, compute_dtype, derived_weight, fuse_linears, keeps_apart, linear,
                                 kept_derived)
from tidal.ops import backends, batch_invariant
from tidal.ops.activation import can_overwrite, situ, swiglu
from tidal.ops import dense, fused_decode, mxfp4_moe
from tidal.ops.cpu_kernels import grouped_gemm_for
from tidal.ops.mxfp import BLOCK, quantize_mxfp4
from tidal.ops.mxfp4_table import ExpertTable, Matrices
from tidal.ops.triton import use_triton

# With the C grouped matmul, decode batches whose experts get at most this many rows each use it.
FEW_ROWS = 16
# x @ w.t() with MKL in float32/float64 runs ~2x faster as (w @ x.t()).t() for a few rows whose
# block is small (1 row is computed as 2, which is also ~2x faster than the matrix-vector product).
# Measured on 192..3584-wide weights: faster up to 10 rows and 12 KiB of rows, slower beyond.
FEATURE_MAJOR_MAX_ROWS = 10
FEATURE_MAJOR_MAX_BYTES = 12 * 1024


def activate(config: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if config.hidden_act == "situ":
        return situ(gate, up, config.situ_beta, config.situ_linear_beta)
    return swiglu(gate, up)


def feature_major(rows: int, w: torch.Tensor) -> bool:
    """Whether ``rows`` rows times w.t() are cheaper computed with the output feature-major. Only for
    a row-major w: stored input-major (``inference_layout``) that product is ~10x slower, while the
    plain one is already fast."""
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.float64) or not w.is_contiguous():
        return False  # bfloat16 goes through oneDNN, where the token-major product is as fast or faster
    padded = max(rows, 2)
    return padded <= FEATURE_MAJOR_MAX_ROWS and padded * w.shape[-1] * w.element_size() <= FEATURE_MAJOR_MAX_BYTES


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` (x [n, K], w [N, K] -> [n, N]), for a few rows computed as (w @ x.t()).t().
    The result may then be a transposed view; rows are independent either way."""
    if x.dim() != 2 or x.shape[0] == 0 or not feature_major(x.shape[0], w) or batch_invariant.enabled():
        return dense.linear(x, w)
    x = x.contiguous()  # x.t() must be a transposed contiguous matrix, else MKL takes a slow path
    if x.shape[0] == 1:
        return (w @ torch.cat([x, x]).t())[:, :1].t()
    return (w @ x.t()).t()


def project_each(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """Row j of x [k, K] (or x's one row, for every j) times ws[j].t() -> [len(ws), N]: the single-row
    products of :func:`project`, bit for bit, with fewer operations per weight."""
    if not feature_major(1, ws[0]):
        rows = [x] * len(ws) if x.shape[0] == 1 else x.split(1)
        return torch.cat([F.linear(r, w) for r, w in zip(rows, ws)])
    pairs = x.unsqueeze(1).expand(x.shape[0], 2, x.shape[1]).contiguous().transpose(1, 2)  # [k, K, 2]
    cols = [pairs[0]] * len(ws) if x.shape[0] == 1 else pairs.unbind(0)
    # contiguous: element-wise ops then vectorise as they do on project's rows (same rounding)
    return torch.stack([w @ c for c, w in zip(cols, ws)])[:, :, 0].contiguous()


class KimiMLP(nn.Module):
    """gate/up/down MLP: the dense first layer(s) and the shared experts."""

    def __init__(self, config: ModelConfig, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.config = config
        self.gate_proj = linear(hidden, intermediate)
        self.up_proj = linear(hidden, intermediate)
        self.down_proj = linear(intermediate, hidden)
        self._gate_up: FusedWeights | None = None  # set by fuse_weights (serving)

    def fuse_weights(self) -> None:
        """Keep gate_proj and up_proj weights as the two row halves of one [2I, d] tensor, so
        forward runs them as one matmul (see :class:`FusedWeights`; a stale one is fused again)."""
        if self.gate_up is None:
            self._gate_up = fuse_linears([self.gate_proj, self.up_proj])

    def decode_step_plan(self) -> fused_decode.StepPlan | None:
        """The plan of the one-call step where it takes the weights (kept apart), else None."""
        return self._step_plan() if keeps_apart(self.gate_proj.weight) else None

    @kept_derived("_step_plan_cached")
    def _step_plan(self) -> fused_decode.StepPlan | None:
        """The weights as the one-call step takes them (kept while none changes), or None."""
        c, ws = self.config, (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        betas = (c.situ_beta, c.situ_linear_beta) if c.hidden_act == "situ" else None
        return derived_weight(self, "_step_plan_cached", ws, lambda: fused_decode.mlp_step_plan(*ws, betas))

    @property
    def gate_up(self) -> torch.Tensor | None:
        return self._gate_up.tensor if self._gate_up is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and keeps_apart(self.gate_proj.weight):  # a few bfloat16 rows: one kernel call
            plan = self._step_plan()
            out = fused_decode.mlp_step(plan, x) if plan is not None else None
            if out is not None:
                return out
        gate_up = self._gate_up.for_forward() if self._gate_up is not None else None
        if gate_up is not None:
            gu = project(x, gate_up)
            inter = gate_up.shape[0] // 2
            gate, up = gu[..., :inter], gu[..., inter:]
        elif keeps_apart(self.gate_proj.weight):  # one product of both, as fused (tidal.ops.dense.linear_parts)
            gate, up = dense.linear_parts(x, [self.gate_proj.weight, self.up_proj.weight]).tensor_split(2, dim=-1)
        else:
            gate, up = project(x, self.gate_proj.weight), project(x, self.up_proj.weight)
        return project(activate(self.config, gate, up), self.down_proj.weight).contiguous()


class Router(nn.Module):
    """DeepSeek-V3 "noaux_tc" routing: fp32 sigmoid scores; the correction bias only chooses."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (expert ids [T, k], weights [T, k] in float32 or wider)."""
        c = self.config
        fused = fused_decode.router(x, self.weight, self.e_score_correction_bias, c.num_experts_per_token,
                                    c.num_expert_group, c.topk_group, c.moe_renormalize, c.routed_scaling_factor)
        if fused is not None:
            return fused
        ct = compute_dtype(x.dtype)
        if batch_invariant.enabled():
            scores = batch_invariant.rowwise(torch.sigmoid, batch_invariant.linear(x.to(ct), self.weight))
        else:
            scores = torch.sigmoid(x.to(ct) @ self._weight_in(ct).t())
        key = scores + self.e_score_correction_bias.to(ct)
        if c.num_expert_group > 1 and c.topk_group < c.num_expert_group:
            grouped = key.view(key.shape[0], c.num_expert_group, -1)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = group_score.topk(c.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            key = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view_as(key)
        ids = key.topk(c.num_experts_per_token, dim=-1).indices
        weights = scores.gather(1, ids)
        if c.moe_renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * c.routed_scaling_factor

    def _weight_in(self, ct: torch.dtype) -> torch.Tensor:
        """The router weight in ``ct``: a cast kept while the weight does not change (not under autograd)."""
        w = self.weight
        if w.dtype == ct or (torch.is_grad_enabled() and w.requires_grad):
            return w.to(ct)
        return derived_weight(self, f"_weight_{ct}", (w,), lambda: w.to(ct))


def group_by_expert(
    ids: torch.Tensor, local: tuple[int, int] | None = None
) -> tuple[torch.Tensor, list[int], list[int]]:
    """ids [T, k] -> (slot order sorted by expert, stable; active experts ascending; their slot
    counts). One host sync, for the two lists. ``local`` = (first, count): only the slots routed to
    experts first .. first + count - 1 (a rank's experts under EP), numbered from 0."""
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    if local is not None:
        keep = (sorted_ids >= local[0]) & (sorted_ids < local[0] + local[1])
        sorted_ids, order = sorted_ids[keep] - local[0], order[keep]
        if not sorted_ids.numel():
            return order, [], []
    experts, counts = torch.stack(torch.unique_consecutive(sorted_ids, return_counts=True)).tolist()
    return order, experts, counts


def blocks(counts: list[int], max_rows: int) -> list[tuple[int, int]]:
    """Consecutive runs [i, j) of the groups with at most max_rows rows in all (a bigger group alone)."""
    out: list[tuple[int, int]] = []
    i, rows = 0, 0
    for j, n in enumerate(counts):
        if rows and rows + n > max_rows:
            out.append((i, j))
            i, rows = j, 0
        rows += n
    if counts:
        out.append((i, len(counts)))
    return out


class Experts(nn.Module):
    """All routed experts of a layer, stacked: w1/w3 [E, I, d_e], w2 [E, d_e, I].

    The checkpoint stores them one by one (``experts.{e}.w1.weight``); the loader stacks them."""

    # Rows per block of experts in forward: a decode batch is one block; prefill is cut so that each
    # block's intermediates stay in cache (measured: unblocked prefill is ~40% slower).
    BLOCK_ROWS = 512

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        E, d, inter = config.num_experts, config.expert_hidden_size, config.moe_intermediate_size
        self.w1 = nn.Parameter(torch.zeros(E, inter, d))
        self.w3 = nn.Parameter(torch.zeros(E, inter, d))
        self.w2 = nn.Parameter(torch.zeros(E, d, inter))
        self._w13: FusedWeights | None = None  # set by fuse_weights (serving)
        # (first, count): the router's experts this module holds, as experts 0..count-1 (a rank's
        # share under expert parallelism, tidal.parallel); None: all of them.
        self.local_experts: tuple[int, int] | None = None
        # Where expert e's matrices lie along dim 0 of w1/w2/w3: slots[e] (a load that maps the
        # checkpoint keeps them in the file's order, tidal.model.checkpoint); None: at e. Routing,
        # grouping and the order of every sum stay by expert number: only the weight lookup moves.
        # state_dict() and load_state_dict() speak expert order.
        self.slots: list[int] | None = None

    def _at(self, e: int) -> int:
        return e if self.slots is None else self.slots[e]

    def model_order(self, leaf: str) -> torch.Tensor:
        """Stacked weight ``leaf`` (w1/w2/w3) with expert e at index e (a copy when slots are set)."""
        w = getattr(self, leaf)
        return w if self.slots is None else w.detach()[self.slots]

    def in_model_order(self) -> None:
        """Give w1/w2/w3 storage of their own in expert order (before a parametrisation, which sees
        the stacked tensors whole)."""
        if self.slots is not None:
            for leaf in ("w1", "w2", "w3"):
                old = self._parameters[leaf]
                self._parameters[leaf] = nn.Parameter(self.model_order(leaf), requires_grad=old.requires_grad)
            self.slots, self._w13 = None, None

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.slots is not None:
            for leaf in ("w1", "w2", "w3"):
                if prefix + leaf in destination:
                    destination[prefix + leaf] = self.model_order(leaf)

    def _load_from_state_dict(self, state_dict, prefix, *args):  # type: ignore[no-untyped-def]
        if self.slots is not None:
            order = sorted(range(len(self.slots)), key=self.slots.__getitem__)  # expert at each index
            state_dict = {k: v[order] if k in {prefix + "w1", prefix + "w2", prefix + "w3"} else v
                          for k, v in state_dict.items()}
        super()._load_from_state_dict(state_dict, prefix, *args)

    def fuse_weights(self) -> None:
        """Keep w1 and w3 as the two halves of one [E, 2I, d_e] tensor, so each expert's gate and up
        projections are one matmul (see :class:`FusedWeights`; w1/w3 become strided views; a stale
        one is fused again), where a kernel wants them so: on the GPU and for the float32 C grouped
        matmul. 16-bit experts on the CPU stay apart (``layers.keeps_apart``: the file keeps each
        expert's w2 between its w1 and w3, so fusing would copy 2/3 of the experts' bytes out of
        the checkpoint's mapping). Parametrised (QAT) experts are left alone."""
        if self.w13 is None and not parametrize.is_parametrized(self) and not keeps_apart(self.w1):
            self._w13 = FusedWeights([(self, "w1"), (self, "w3")])

    @property
    def w13(self) -> torch.Tensor | None:
        return self._w13.tensor if self._w13 is not None else None

    def _fused(self) -> torch.Tensor | None:
        """The fused w1|w3 when forward may use it."""
        return self._w13.for_forward() if self._w13 is not None else None

    def _gate_up_weights(self) -> list[torch.Tensor]:
        """[w13] when fused, else [w1, w3] (read once: under a parametrisation each read recomputes)."""
        w13 = self._fused()
        return [w13] if w13 is not None else [self.w1, self.w3]

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts of weight * expert(h), in float32 or wider.

        Token slots are sorted by expert and cut into blocks of experts with up to BLOCK_ROWS rows.
        In a block each expert runs its matmuls on its rows and the activation runs once for all.
        Each token's outputs are added in ascending expert order, so a token's result does not
        depend on which other tokens are in the batch, beyond the matmul rounding for the number of
        rows its experts get."""
        T, k = ids.shape
        out = torch.zeros(T, h.shape[-1], dtype=compute_dtype(h.dtype), device=h.device)
        if T == 0:
            return out
        w13 = self._fused()
        if use_triton(h) and not (torch.is_grad_enabled() and h.requires_grad) and self.local_experts is None \
                and self.slots is None:
            # the GPU's grouped kernel: no host sync, no per-expert loop
            gate_up = w13 if w13 is not None else torch.cat([self.w1, self.w3], dim=1)
            return backends.routed_experts(h, ids, weights, (gate_up, None), (self.w2, None),
                                           lambda g, u: activate(self.config, g, u))
        kernel = grouped_gemm_for(h, w13, self.w2) if w13 is not None else None
        if T == 1 and kernel is None and self.local_experts is None and not batch_invariant.enabled():
            return self._one_token(h, ids, weights, out)
        order, experts, counts = group_by_expert(ids, self.local_experts)
        if not experts:
            return out
        token_of = order // k
        w_sorted = weights.reshape(-1)[order]
        if kernel is not None and (max(counts) <= FEW_ROWS or batch_invariant.enabled()):
            return self._few_rows(kernel, h, token_of, w_sorted, experts, counts, w13, out)
        gate_up, w2 = self._gate_up_weights(), self.w2
        start = 0
        for i, j in blocks(counts, self.BLOCK_ROWS):
            end = start + sum(counts[i:j])
            rows = token_of[start:end]
            y = self._block(h.index_select(0, rows), experts[i:j], counts[i:j], gate_up, w2)
            self._add_weighted(out, rows, y, w_sorted[start:end])
            start = end
        return out

    def _block(
        self, x: torch.Tensor, experts: list[int], counts: list[int], gate_up: list[torch.Tensor], w2: torch.Tensor
    ) -> torch.Tensor:
        """The experts' outputs for x, whose rows are sorted by expert (counts[i] rows of experts[i])."""
        rows = x.split(counts)
        at = [self._at(e) for e in experts]
        if len(gate_up) == 2 and keeps_apart(gate_up[0]):  # each expert's gate and up as one product, as fused
            gate_up = [torch.cat([dense.linear_parts(r, [gate_up[0][s], gate_up[1][s]]) for s, r in zip(at, rows)])]
        else:
            gate_up = [torch.cat([project(r, w[s]) for s, r in zip(at, rows)]) for w in gate_up]
        gate, up = gate_up[0].tensor_split(2, dim=1) if len(gate_up) == 1 else gate_up
        act = activate(self.config, gate, up).split(counts)
        return torch.cat([project(a, w2[s]) for s, a in zip(at, act)])

    def _few_rows(
        self, kernel: Callable[..., torch.Tensor], h: torch.Tensor, token_of: torch.Tensor, w_sorted: torch.Tensor,
        experts: list[int], counts: list[int], w13: torch.Tensor, out: torch.Tensor,
    ) -> torch.Tensor:
        """Decode: every active expert has a few rows; the C grouped matmul streams each expert's
        weights once for its rows (``tidal.ops.cpu_kernels``), the activation runs once for all."""
        offsets = torch.tensor([0, *counts], dtype=torch.int64).cumsum_(0)
        ids = torch.tensor([self._at(e) for e in experts], dtype=torch.int64)
        gate_up = kernel(h.index_select(0, token_of), offsets, ids, w13)
        gate, up = gate_up.tensor_split(2, dim=1)
        y = kernel(activate(self.config, gate, up), offsets, ids, self.w2)
        return self._add_weighted(out, token_of, y, w_sorted)

    def _one_token(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """forward for T == 1, without the grouping: the same products, added in the same order."""
        chosen, slot = ids[0].sort()
        experts = [self._at(e) for e in chosen.tolist()]
        parts = [project_each(h, [w[e] for e in experts]) for w in self._gate_up_weights()]
        gate, up = parts[0].tensor_split(2, dim=1) if len(parts) == 1 else parts
        w2 = self.w2
        y = project_each(activate(self.config, gate, up), [w2[e] for e in experts])
        return self._add_weighted(out, ids.new_zeros(len(experts)), y, weights[0, slot])

    @staticmethod
    def _add_weighted(out: torch.Tensor, token_of: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """out[token_of[i]] += w[i] * y[i] in out's dtype, in the order of i."""
        y, w = y.to(out.dtype), w.to(out.dtype)[:, None]
        return out.index_add_(0, token_of, y.mul_(w) if can_overwrite(y, w) else y * w)


class PackedExperts(nn.Module):
    """The routed experts kept in MXFP4 as the checkpoint stores them (compressed-tensors layout,
    ``tidal.ops.mxfp``), gate and up stacked: ``w13_weight_packed`` [E, 2I, d_e/2] (rows :I are w1,
    I: are w3), ``w13_weight_scale`` [E, 2I, d_e/32], ``w2_weight_packed`` [E, d_e, I/2],
    ``w2_weight_scale`` [E, d_e, I/32], all uint8. Same routing sums as :class:`Experts`; the products
    run in ``tidal.ops.mxfp4_moe`` (float32 accumulation of the exact weight values).

    Or each expert's matrices apart (:meth:`use_matrices`: the loader leaves them in the checkpoint's
    mapping, where the file holds w1, w2 and w3 of each expert one after the other): the four stacked
    buffers are then None, every matrix is a non-persistent buffer of its own (``w1_packed_0`` ...,
    so ``buffers()`` counts their bytes), the kernels read them through
    :class:`~tidal.ops.mxfp4_table.ExpertTable` s, and ``state_dict()`` still speaks the stacked names
    (stacked copies). The CPU only; :meth:`own_storage` stacks them back."""

    PARTS = ("packed", "scale")

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        E, d, inter = config.num_experts, config.expert_hidden_size, config.moe_intermediate_size
        u8 = dict(dtype=torch.uint8, device=device)
        self.register_buffer("w13_weight_packed", torch.zeros(E, 2 * inter, d // 2, **u8))
        self.register_buffer("w13_weight_scale", torch.zeros(E, 2 * inter, d // BLOCK, **u8))
        self.register_buffer("w2_weight_packed", torch.zeros(E, d, inter // 2, **u8))
        self.register_buffer("w2_weight_scale", torch.zeros(E, d, inter // BLOCK, **u8))
        self.local_experts: tuple[int, int] | None = None  # as Experts.local_experts
        # (gate | up, down) tables of the matrices apart (use_matrices); None: the stacked buffers
        self._apart: tuple[ExpertTable, ExpertTable] | None = None

    @property
    def apart(self) -> bool:
        """Whether the experts' matrices are apart (:meth:`use_matrices`) rather than stacked."""
        return self._apart is not None

    def use_matrices(self, matrices: dict[str, list[Matrices]]) -> None:
        """Hold each expert's matrices where they are: ``matrices[leaf][e]`` = (packed [out, in/2],
        scales [out, in/32]) of weight ``leaf`` (w1, w3: [I, ...]; w2: [d_e, ...]) of local expert e,
        CPU uint8 with unit column stride and, per leaf, one row stride (views of a mapped file).
        The stacked buffers are dropped."""
        E, d, inter = self.config.num_experts, self.config.expert_hidden_size, self.config.moe_intermediate_size
        want = {"w1": (inter, d), "w3": (inter, d), "w2": (d, inter)}
        for leaf, (out_f, in_f) in want.items():
            got = matrices.get(leaf, [])
            if len(got) != E or any(tuple(p.shape) != (out_f, in_f // 2) or tuple(sc.shape) != (out_f, in_f // BLOCK)
                                    for p, sc in got):
                raise ValueError(f"use_matrices: {leaf} needs {E} experts of packed [{out_f}, {in_f // 2}] and scales "
                                 f"[{out_f}, {in_f // BLOCK}]")
        tables = (ExpertTable.of_parts([[matrices["w1"][e], matrices["w3"][e]] for e in range(E)]),
                  ExpertTable.of_parts([[matrices["w2"][e]] for e in range(E)]))
        for name in ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale"):
            self._buffers[name] = None
        for leaf, pairs in matrices.items():
            for e, pair in enumerate(pairs):
                for part, t in zip(self.PARTS, pair):
                    self.register_buffer(f"{leaf}_{part}_{e}", t, persistent=False)
        self._apart = tables

    def own_storage(self) -> None:
        """Stacked buffers of this module's own again (a copy of matrices held apart)."""
        if self._apart is None:
            return
        stacked = {name: self.stacked(name) for name in ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed",
                                                         "w2_weight_scale")}
        for name in [n for n in self._buffers if n.startswith(("w1_", "w2_", "w3_"))]:
            del self._buffers[name]
            self._non_persistent_buffers_set.discard(name)
        self._buffers.update(stacked)
        self._apart = None

    def tables(self) -> tuple[ExpertTable, ExpertTable]:
        """(gate | up, down) as the packed kernels read them (of the stacked buffers: kept while
        those do not change)."""
        if self._apart is not None:
            return self._apart
        bufs = (self.w13_weight_packed, self.w13_weight_scale, self.w2_weight_packed, self.w2_weight_scale)
        return derived_weight(self, "_stacked_tables", bufs, lambda: (ExpertTable.stacked(*bufs[:2]),
                                                                        ExpertTable.stacked(*bufs[2:])))

    def expert_matrices(self, leaf: str, e: int) -> Matrices:
        """(packed, scales) of weight ``leaf`` (w1/w2/w3) of local expert e, stacked or apart."""
        if self._apart is not None:
            return self._buffers[f"{leaf}_packed_{e}"], self._buffers[f"{leaf}_scale_{e}"]
        return self.target(leaf, "packed")[e], self.target(leaf, "scale")[e]

    def weights(self, leaf: str, part: str) -> torch.Tensor:
        """Weight ``leaf`` (w1/w2/w3) of every expert as its ``part`` ("packed" or "scale") to read:
        :meth:`target`, or a stacked copy of the matrices held apart."""
        if self._apart is None:
            return self.target(leaf, part)
        i = self.PARTS.index(part)
        return torch.stack([self.expert_matrices(leaf, e)[i] for e in range(self.config.num_experts)])

    def stacked(self, name: str) -> torch.Tensor:
        """Buffer ``name`` (w13_weight_packed, ...) stacked: the buffer itself, or a stacked copy of
        the matrices held apart."""
        if self._apart is None:
            return getattr(self, name)
        part = 0 if name.endswith("packed") else 1
        leaves = ("w1", "w3") if name.startswith("w13") else ("w2",)
        return torch.stack([torch.cat([self.expert_matrices(leaf, e)[part] for leaf in leaves])
                            for e in range(self.config.num_experts)])

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._apart is not None:
            for name in ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale"):
                destination[prefix + name] = self.stacked(name)

    def _load_from_state_dict(self, state_dict, prefix, *args):  # type: ignore[no-untyped-def]
        self.own_storage()
        super()._load_from_state_dict(state_dict, prefix, *args)

    @classmethod
    def from_dense(cls, experts: Experts) -> "PackedExperts":
        """Quantise dense experts (the rounding of ``tidal quantize``: from their float32 values)."""
        w = experts.w1
        packed = cls(experts.config, w.device)
        if not w.is_meta:
            for leaf in ("w1", "w3", "w2"):
                packed.set_expert_weights(leaf, slice(None), experts.model_order(leaf).detach().float())
        packed.local_experts = experts.local_experts
        return packed

    def target(self, leaf: str, part: str) -> torch.Tensor:
        """The slice of a buffer that holds checkpoint weight ``leaf`` (w1/w2/w3) of every expert,
        as its ``part`` ("packed" or "scale"): [E, out, ...]. Stacked buffers only."""
        if self._apart is not None:
            raise ValueError("PackedExperts.target: the experts' matrices are held apart (use_matrices); "
                             "call own_storage() before writing them")
        suffix = "weight_packed" if part == "packed" else "weight_scale"
        if leaf == "w2":
            return getattr(self, f"w2_{suffix}")
        inter = self.config.moe_intermediate_size
        buf = getattr(self, f"w13_{suffix}")
        return buf[:, :inter] if leaf == "w1" else buf[:, inter:]

    def set_expert_weights(self, leaf: str, expert: int | slice, weight: torch.Tensor) -> None:
        """Quantise float weight(s) [out, in] (or [E, out, in]) into expert(s) ``expert`` of ``leaf``."""
        packed, scales = quantize_mxfp4(weight)
        self.target(leaf, "packed")[expert].copy_(packed)
        self.target(leaf, "scale")[expert].copy_(scales)

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """As :meth:`Experts.forward`; a row's result in decode-sized batches does not depend on the
        other rows at all (bitwise: see ``tidal.ops.mxfp4_moe``)."""
        T, k = ids.shape
        if self._apart is not None and h.device.type != "cpu":
            raise ValueError(f"packed experts held apart in CPU memory (use_matrices) cannot run on {h.device}; "
                             "call own_storage() and move the model")
        if T and use_triton(h) and self.local_experts is None:  # the GPU: the grouped kernel decodes E2M1 itself, no host sync
            return backends.routed_experts(h, ids, weights, (self.w13_weight_packed, self.w13_weight_scale),
                                           (self.w2_weight_packed, self.w2_weight_scale),
                                           lambda g, u: activate(self.config, g, u))
        if T and self.local_experts is None:  # one C call on the CPU (the same bits as below)
            c = self.config
            situ_betas = (c.situ_beta, c.situ_linear_beta) if c.hidden_act == "situ" else None
            fused = fused_decode.packed_experts(h, ids, weights, *self.tables(), situ_betas)
            if fused is not None:
                return fused
        out = torch.zeros(T, h.shape[-1], dtype=compute_dtype(h.dtype), device=h.device)
        if T == 0:
            return out
        if T == 1 and self.local_experts is None:  # one token: its experts ascending, one row each
            expert_ids, order = ids[0].sort()
            experts, counts = expert_ids.tolist(), [1] * k
            offsets = torch.arange(k + 1, dtype=torch.int64)
        else:
            order, experts, counts = group_by_expert(ids, self.local_experts)
            if not experts:
                return out
            offsets = torch.tensor([0, *counts], dtype=torch.int64).cumsum_(0)
            expert_ids = torch.tensor(experts, dtype=torch.int64)
        token_of = order // k
        w13, w2 = self.tables()

        def matmul(x: torch.Tensor, weight: ExpertTable) -> torch.Tensor:
            return mxfp4_moe.grouped_matmul(x, offsets, expert_ids, counts, experts, weight,
                                            bf16_rows=h.dtype == torch.bfloat16)

        x = h.index_select(0, token_of)
        gate, up = matmul(x, w13).tensor_split(2, dim=1)
        y = matmul(activate(self.config, gate, up), w2)
        return Experts._add_weighted(out, token_of, y, weights.reshape(-1)[order])


def pack_experts(model: nn.Module) -> nn.Module:
    """Replace every dense :class:`Experts` in ``model`` by :class:`PackedExperts` (quantising their
    values; on the meta device only the shapes)."""
    for module in model.modules():
        if isinstance(module, KimiMoE) and isinstance(module.experts, Experts):
            module.experts = PackedExperts.from_dense(module.experts)
    return model


class KimiMoE(nn.Module):
    """``block_sparse_moe``: router on x, routed experts (at the latent width for K3), shared
    experts on the original x."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.gate = Router(config)
        self.experts = Experts(config)
        if config.num_shared_experts:
            self.shared_experts = KimiMLP(config, d, config.moe_intermediate_size * config.num_shared_experts)
        if config.is_latent_moe:
            de = config.expert_hidden_size
            self.routed_expert_down_proj = linear(d, de)
            self.routed_expert_up_proj = linear(de, d)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(de, config.rms_norm_eps)

    def decode_step_plan(self) -> fused_decode.StepPlan | None:
        """The plan of the layer's one-call decode step (packed experts, all local), else None."""
        return self._step_plan()

    @kept_derived("_step_plan_cached")
    def _step_plan(self) -> fused_decode.StepPlan | None:
        """The layer as the one-call step takes it (kept while no weight changes), or None."""
        experts, c = self.experts, self.config
        if not isinstance(experts, PackedExperts) or experts.local_experts is not None:
            return None
        w13, w2 = experts.tables()
        latent = (self.routed_expert_down_proj.weight, self.routed_expert_up_proj.weight) if c.is_latent_moe else None
        norm = self.routed_expert_norm if c.is_latent_moe and c.latent_moe_use_norm else None
        shared = self.shared_experts if c.num_shared_experts else None
        shared_ws = (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight) if shared else ()
        params = (self.gate.weight, self.gate.e_score_correction_bias, *(latent or ()),
                  *([norm.weight] if norm is not None else []), *shared_ws, w13.packed, w2.packed)

        def plan() -> fused_decode.StepPlan | None:
            shared_plan = shared._step_plan() if shared is not None else None
            if shared is not None and shared_plan is None:
                return None
            return fused_decode.moe_layer_plan(
                self.gate.weight, self.gate.e_score_correction_bias, c.num_experts_per_token, c.num_expert_group,
                c.topk_group, c.moe_renormalize, c.routed_scaling_factor, latent,
                (norm.weight, norm.eps) if norm is not None else None, w13, w2,
                (c.situ_beta, c.situ_linear_beta) if c.hidden_act == "situ" else None, shared_plan)

        return derived_weight(self, "_step_plan_cached", params, plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_cpu and isinstance(self.experts, PackedExperts):
            plan = self._step_plan()  # a few bfloat16 rows: the whole layer in one kernel call
            out = fused_decode.moe_layer_step(plan, x) if plan is not None else None
            if out is not None:
                return out
        ids, weights = self.gate(x)
        h = project(x, self.routed_expert_down_proj.weight) if self.config.is_latent_moe else x
        y = self.experts(h, ids, weights).to(x.dtype)
        if self.config.is_latent_moe:
            if self.config.latent_moe_use_norm:
                y = self.routed_expert_norm(y)
            y = project(y, self.routed_expert_up_proj.weight).contiguous()
        if self.config.num_shared_experts:
            y = y + self.shared_experts(x)
        return y
