"""Turning the inference model into a trainable one, without touching its state-dict names.

Two changes, both training-side only:

- KDA layers run :class:`TrainableKDA`: every training sequence starts from an empty cache, so the
  short conv and the chunked delta rule run for the whole batch at once from zero states, and
  nothing is written back into cache tensors in place. (The inference layer advances the cache's
  state in place, which autograd rejects: the kernel saved that state for its backward.)
- Routed experts are fake-quantised to MXFP4 in the forward pass with a straight-through
  gradient (quantisation-aware training, as K3 itself was trained): a parametrisation of
  ``experts.w1/w2/w3``, computed once per step inside :func:`qat_cached`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from tidal.model.context import ForwardBatch
from tidal.model.kda import KimiDeltaAttention
from tidal.model.kimi import KimiForCausalLM
from tidal.model.layers import compute_dtype
from tidal.model.moe import Experts
from tidal.ops.kda import kda_chunked
from tidal.ops.mxfp import fake_quantize_mxfp4

EXPERT_WEIGHTS = ("w1", "w2", "w3")
KDA_CHUNK = 32  # measured faster than 64 for training on CPU (fewer exponentials per token)


class TrainableKDA(KimiDeltaAttention):
    """KDA for batches of fresh sequences (every ``cached_lens`` 0): same parameters, same math."""

    def _check(self, batch: ForwardBatch) -> None:
        if any(batch.cached_lens):
            raise ValueError("TrainableKDA runs fresh sequences only (cached_lens must all be 0)")

    def _short_conv(self, qkv: torch.Tensor, state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Causal depthwise conv + SiLU from a zero state, all sequences in one conv call."""
        self._check(batch)
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])  # [C, 1, W]
        cdt = compute_dtype(qkv.dtype)
        W = self.conv_kernel
        outs = []
        for rows, x in _grouped(batch, qkv):  # x [n, T, C]
            x = F.pad(x.to(cdt), (0, 0, W - 1, 0))
            T = x.shape[1] - (W - 1)
            # W shifted multiply-adds: cheaper than a depthwise conv1d on CPU, forward and backward.
            y = sum(x[:, j : j + T] * weight[:, 0, j].to(cdt) for j in range(W))
            outs.append(F.silu(y).to(qkv.dtype))
        return _ungroup(outs, batch)

    def _delta_rule(
        self, inputs: tuple[torch.Tensor, ...], state: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Chunked KDA from a zero state, equal-length sequences batched; the cache is not touched."""
        self._check(batch)
        H, K, V = self.num_heads, self.head_dim, state.shape[-1]
        groups = [_grouped(batch, t) for t in inputs]
        outs = []
        for parts in zip(*groups):
            n = len(parts[0][0])
            zero = torch.zeros(n, H, K, V, dtype=state.dtype, device=state.device)
            o, _ = kda_chunked(*(x for _, x in parts), zero, chunk_size=KDA_CHUNK)
            outs.append(o)
        return _ungroup(outs, batch)


def _groups(batch: ForwardBatch) -> list[list[int]]:
    """Batch rows grouped by query length (each group runs as one batched call), first-seen order."""
    groups: dict[int, list[int]] = {}
    for b, n in enumerate(batch.query_lens):
        groups.setdefault(n, []).append(b)
    return list(groups.values())


def _grouped(batch: ForwardBatch, x: torch.Tensor) -> list[tuple[list[int], torch.Tensor]]:
    """The flat run x [T_total, ...] as (rows, [n, T, ...]) per equal-length group. One group in
    batch order (the usual training batch) is a view: no copies, no scatter in the backward."""
    groups = _groups(batch)
    if len(groups) == 1:
        return [(groups[0], x.view(batch.num_seqs, batch.query_lens[0], *x.shape[1:]))]
    return [(rows, torch.stack([x[batch.token_slice(b)] for b in rows])) for rows in groups]


def _ungroup(outs: list[torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
    """Per-group outputs [n, T, ...] -> the flat token run in batch order."""
    groups = _groups(batch)
    if len(groups) == 1:
        return outs[0].flatten(0, 1)
    by_row = {b: o for rows, out in zip(groups, outs) for b, o in zip(rows, out.unbind(0))}
    return torch.cat([by_row[b] for b in range(batch.num_seqs)])


class FakeQuantizeMXFP4(nn.Module):
    """Parametrisation: the weight the forward sees is MXFP4-rounded; gradients pass straight through."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return fake_quantize_mxfp4(w)


def make_trainable(model: KimiForCausalLM, qat: bool = True) -> KimiForCausalLM:
    """Switch KDA layers to :class:`TrainableKDA` and (with ``qat``) fake-quantise routed experts.
    In place; returns the model."""
    for module in model.modules():
        if type(module) is KimiDeltaAttention:
            module.__class__ = TrainableKDA
        if qat and isinstance(module, Experts):
            module.in_model_order()
            for name in EXPERT_WEIGHTS:
                parametrize.register_parametrization(module, name, FakeQuantizeMXFP4())
    return model


@contextlib.contextmanager
def qat_cached() -> Iterator[None]:
    """Quantise each expert tensor once per forward (the expert loop reads it once per expert)."""
    with parametrize.cached():
        yield


def plain_name(name: str) -> str:
    """State-dict name without the parametrisation wrapper (``experts.parametrizations.w1.original``
    -> ``experts.w1``)."""
    return name.replace("parametrizations.", "").replace(".original", "")


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The master weights under the inference model's names (unquantised experts)."""
    return {plain_name(k): v for k, v in model.state_dict().items()}


def load_plain_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load master weights saved by :func:`plain_state_dict` into a (possibly parametrised) model."""
    own = {plain_name(k): k for k in model.state_dict()}
    if set(own) != set(state):
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
    model.load_state_dict({own[k]: v for k, v in state.items()})
