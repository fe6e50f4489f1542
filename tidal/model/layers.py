"""Small building blocks shared by the Kimi layers."""

from __future__ import annotations

import functools
import itertools
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import torch
from torch import nn

from tidal.ops import dense, fused_decode


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision for norms, gates and routers: at least float32 (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm computed in at least float32, returned in x's dtype."""
    fused = fused_decode.rms_norm(x, weight, eps)
    if fused is not None:
        return fused
    xf = x.to(compute_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Linear):
    """A bias-free nn.Linear whose product goes through ``tidal.ops.dense`` (same state_dict); on
    the meta device (a model about to be loaded) it skips the random initialisation."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense.linear(x, self.weight)


class Embedding(nn.Embedding):
    """nn.Embedding whose initialisation skips meta tensors. A model built on the meta device to be
    loaded gets no values anyway, and ``normal_`` on a meta tensor runs through torch._refs, whose
    first use imports torch._dynamo: seconds of start-up (more from a cold disk) and ~75 MB of
    memory in a process that otherwise never needs it."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Conv1d(nn.Conv1d):
    """nn.Conv1d whose initialisation skips meta tensors, as :class:`Embedding` (on a meta tensor
    ``kaiming_uniform_`` cost a rank's load a third of a second, measured)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


def linear(in_features: int, out_features: int) -> nn.Linear:
    """Bias-free projection (every Kimi projection is bias-free)."""
    return Linear(in_features, out_features, bias=False)


Derived = TypeVar("Derived")


class _Frozen(threading.local):
    epoch = 0  # while nonzero: the weights frozen under this epoch (see frozen_weights)


_frozen = _Frozen()
_epochs = itertools.count(1)


def weights_epoch() -> int:
    """A new epoch for :func:`frozen_weights` (one per model runner)."""
    return next(_epochs)


@contextmanager
def frozen_weights(epoch: int) -> Iterator[None]:
    """Within the block the model's weights do not change (a model runner's steps: an engine's
    weights are final once loaded, and tidal writes them nowhere else): a derived weight checked
    once under ``epoch`` is then used without its key check (:func:`trusted_derived`; the key is a
    dozen parameters' addresses, dtypes, shapes and versions per layer, built at every call)."""
    before, _frozen.epoch = _frozen.epoch, epoch
    try:
        yield
    finally:
        _frozen.epoch = before


def trusted_derived(owner: nn.Module, name: str):
    """What :func:`derived_weight` keeps on ``owner`` under ``name``, without its key check, within
    :func:`frozen_weights` where it was checked under the same epoch; else None (check it)."""
    epoch = _frozen.epoch
    if epoch:
        cached = owner.__dict__.get(name)
        if cached is not None and cached[2] == epoch:
            return cached[1]
    return None


def kept_derived(name: str) -> Callable:
    """Decorates a method that returns ``derived_weight(self, name, ...)``: within
    :func:`frozen_weights` the value kept under ``name`` is returned without running the method
    (which gathers the parameters for the key from the module's children)."""

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def kept(self):
            value = trusted_derived(self, name)
            return value if value is not None else method(self)

        return kept

    return decorate


def derived_weight(owner: nn.Module, name: str, params: tuple[torch.Tensor, ...],
                   make: Callable[[], Derived]) -> Derived:
    """``make()`` (a tensor computed from ``params`` alone, e.g. a concatenation, or a kernel's plan
    of their addresses), kept on ``owner`` under ``name`` until one of the parameters changes
    (storage, dtype, shape or an in-place write; within :func:`frozen_weights` checked once)."""
    epoch = _frozen.epoch
    cached = owner.__dict__.get(name)
    if epoch and cached is not None and cached[2] == epoch:
        return cached[1]
    key = tuple([(p.data_ptr(), p.dtype, p.shape, -1 if p.is_inference() else p._version) for p in params])
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, make(), epoch)
    elif cached[2] != epoch:
        cached = (key, cached[1], epoch)
    owner.__dict__[name] = cached
    return cached[1]


def inference_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] with the same values, stored input-major on the CPU.

    CPU BLAS streams a weight stored [in, out] up to 2x faster at the small batches of decode
    (batch 1 reads every weight once per token): measured on one core, a 32000 x 512 head 7.3 -> 3.1
    ms, a 1796 x 512 projection 9 -> 17 GB/s; prefill-sized batches are unaffected. GPUs keep the
    checkpoint layout, and so do 16-bit weights (input-major bf16 measured slower on this CPU)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not weight.is_contiguous() or weight.dim() != 2:
        return weight
    return weight.detach().t().contiguous().t()


class FusedWeights:
    """Parameters that multiply the same input, kept as slices along dim -2 (their output rows) of
    one tensor, so one matmul computes them all. The parameters stay the same objects with the same
    names, shapes and values (state_dict and load_state_dict are unchanged); only their storage is
    shared. A later cast, move or relayout of a parameter gives it storage of its own: the fused
    tensor is then stale, dropped, and callers go back to the separate parameters."""

    def __init__(
        self, params: list[tuple[nn.Module, str]], layout: Callable[[torch.Tensor], torch.Tensor] = lambda w: w
    ) -> None:
        with torch.no_grad():
            fused = layout(torch.cat([getattr(m, name).detach() for m, name in params], dim=-2))
        start = 0
        for m, name in params:
            p = getattr(m, name)
            p.data = fused[..., start : start + p.shape[-2], :]
            start += p.shape[-2]
        self.params, self.sizes, self._tensor = params, [getattr(m, n).shape[-2] for m, n in params], fused
        # (byte offset into the fused tensor, stride) of each parameter's slice: what it must still
        # have to be that slice (fixed: the fused tensor never changes; a copy keeps the offsets).
        self._slices = [(getattr(m, n).data_ptr() - fused.data_ptr(), getattr(m, n).stride()) for m, n in params]

    @property
    def tensor(self) -> torch.Tensor | None:
        """The fused tensor while every parameter is still its slice, else None (from then on)."""
        fused = self._tensor
        if fused is None:
            return None
        base = fused.data_ptr()
        for p, (offset, stride) in zip(self._current(), self._slices):
            if p is None or p.data_ptr() - base != offset or p.stride() != stride or p.dtype != fused.dtype \
                    or p.device != fused.device:
                self._tensor = None
                return None
        return fused

    def for_forward(self) -> torch.Tensor | None:
        """:attr:`tensor`, unless autograd must reach the parameters (the fused tensor is outside
        the graph: training runs the separate parameters)."""
        if torch.is_grad_enabled() and any(p is not None and p.requires_grad for p in self._current()):
            return None
        return self.tensor

    def _current(self) -> list[torch.Tensor | None]:
        # _parameters, not getattr: a parametrised parameter (QAT) must not be recomputed here.
        return [m._parameters.get(name) for m, name in self.params]


# Weights of these dtypes stay apart on the CPU where serving would fuse the projections of one
# input: ``tidal.ops.dense.linear_parts`` multiplies them as one product whose every output has the
# fused tensor's bits (a float16 weight: each part's own product, the same per-output sums), so a
# fused copy would buy nothing and cost a copy of the weights out of the checkpoint's mapping into
# memory the process never touched before.
APART_DTYPES = (torch.bfloat16, torch.float16)


def keeps_apart(weight: torch.Tensor) -> bool:
    """Whether projections of one input with weights like ``weight`` stay apart (not fused) at serving."""
    return weight.device.type == "cpu" and weight.dtype in APART_DTYPES


def fuse_linears(linears: list[nn.Linear]) -> FusedWeights | None:
    """The weights of bias-free linears reading the same input as one :class:`FusedWeights`, stored
    in ``inference_layout`` (its views are then not contiguous and later relayouts leave them alone);
    None where they stay apart (:func:`keeps_apart`)."""
    if keeps_apart(linears[0].weight):
        return None
    return FusedWeights([(m, "weight") for m in linears], inference_layout)
