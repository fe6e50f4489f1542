"""``F.linear`` for the trunk's bias-free projections, behind one seam: float rows times a bfloat16
weight on the CPU go to the C kernel (``csrc/bf16_gemm.c``: bf16 widened in registers, fp32 sums in
register tiles; torch's bf16 matmul on CPUs without bf16 dot products runs at a fraction of its
float32 speed, at one row and at many), and so do float32 rows times a bfloat16 weight (a float32
result: a small model kept in bf16, like the DSPARK drafter, read at half the bytes). Every row's result there is bitwise independent of the
other rows (one summation order at every row count), so the bf16 trunk is batch-invariant on the
CPU; on CPUs with AMX, bfloat16 rows from ``cpu_kernels.AMX_MIN_ROWS`` rows up take the tiles'
order instead (a row's bits then differ below and above that count), except under deterministic
inference. A few float32 rows times a large input-major float32 weight (the LM head of a verified chain
or a small decode batch, one row included) are read through a bfloat16 copy of the weight
where its values are all bfloat16 ones (a bf16 checkpoint loaded in float32: the copy is exact and
half the bytes; :func:`bf16_twin`), by the C kernel: the weight is read once for all the rows, and
each row's result is its batch-1 result bit for bit (the kernel's row-invariant order), so a
verified chain's logits are the decode's. Other such weights go one row at a time: the rows'
products cost that many batch-1 products, and each row's result is the batch-1 result bit for bit.
Many bfloat16 rows on a CPU with AMX tiles (a prefill chunk) go to torch's matmul instead, outside
deterministic inference (``tidal.ops.bf16_blas``). Everything else is torch's.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from tidal.ops import batch_invariant, bf16_blas
from tidal.ops.cpu_kernels import WeightParts, bf16_gemm_kernel, bf16_parts_kernel, bf16_rows_kernel


# A float32 product of at most this many rows against a weight of at least this many elements
# runs row by row (see the module docstring).
ROW_BY_ROW_MAX_ROWS = 16
ROW_BY_ROW_MIN_WEIGHT = 1 << 20


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w.t() (w [N, K]) in x's dtype."""
    if batch_invariant.enabled():
        return batch_invariant.linear(x, w)
    if (not w.is_cpu or w.dim() != 2 or x.numel() == 0
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return F.linear(x, w)
    flat = x.dim() == 2  # decode's rows: no reshape around the call
    rows = x if flat else x.reshape(-1, x.shape[-1])
    dtype = x.dtype
    if dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and bf16_blas.takes(rows.shape[0]):
        return F.linear(x, w)
    if w.dtype == torch.bfloat16 and (dtype == torch.bfloat16 or dtype == torch.float32) and w.stride(1) == 1:
        kernel = bf16_rows_kernel() if dtype == torch.bfloat16 else bf16_gemm_kernel()
        if kernel is None:
            return F.linear(x, w.to(dtype))
        out = kernel(rows, w)  # float32 rows: float32 out, the bf16 weight read once
    elif _few_rows(x, w):
        twin = bf16_twin(w)
        kernel = bf16_gemm_kernel() if twin is not None else None
        if kernel is not None:
            out = kernel(rows, twin)
        elif rows.shape[0] == 1:
            return F.linear(x, w)
        else:
            out = torch.cat([F.linear(rows[i : i + 1], w) for i in range(rows.shape[0])])
    else:
        return F.linear(x, w)
    return out if flat else out.reshape(*x.shape[:-1], w.shape[0])


# At most this many weights go to one parts product (csrc/bf16_gemm.c's MAX_PARTS).
MAX_PARTS = 8


def weight_parts(ws: list[torch.Tensor]) -> WeightParts | None:
    """The weights as :func:`linear_parts` hands them to the C kernel, to keep per module while they
    do not change; None for weights it would not hand over (each weight's product runs instead)."""
    if (len(ws) < 2 or len(ws) > MAX_PARTS or any(w.device.type != "cpu" or w.dtype != torch.bfloat16 or w.dim() != 2
                                                  or w.stride(1) != 1 or w.shape[1] != ws[0].shape[1] for w in ws)):
        return None
    return WeightParts(tuple(ws))


def linear_parts(x: torch.Tensor, ws: list[torch.Tensor] | WeightParts) -> torch.Tensor:
    """``linear(x, torch.cat(ws))`` -> [..., sum of the ws' rows] without concatenating the weights
    (they may stay in a checkpoint's mapping): bfloat16 CPU weights with contiguous rows go to the C
    kernel as one product, whose every output is the concatenation's sum bit for bit; otherwise
    each weight's :func:`linear`, concatenated (the same per-output sums wherever ``linear``'s are
    independent of the other weight rows: the C kernel, batch invariance). ``ws`` may be the
    :func:`weight_parts` of the weights, kept by the caller."""
    prepared = ws if isinstance(ws, WeightParts) else None
    weights = prepared.weights if prepared is not None else ws
    if len(weights) == 1:
        return linear(x, weights[0])
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if (x.dtype == torch.bfloat16 and bf16_blas.takes(rows.shape[0])
            and all(w.dtype == torch.bfloat16 for w in weights)):
        # one product on the concatenation: oneDNN's bits depend on the weight's rows too, and a
        # layout that keeps the parts apart must give the bits of one that fused them
        return F.linear(x, torch.cat(weights))
    kernel = None
    if (not batch_invariant.enabled() and x.dtype in (torch.float32, torch.bfloat16) and x.numel()
            and weights[0].shape[1] == x.shape[-1]
            and not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)))):
        prepared = prepared if prepared is not None else weight_parts(weights)
        kernel = bf16_parts_kernel() if prepared is not None else None
    if kernel is None:
        return torch.cat([linear(x, w) for w in weights], dim=-1)
    out = kernel(rows, prepared)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])


def _few_rows(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Few float32 rows (one included) against a large input-major (inference_layout) float32 CPU
    weight."""
    rows = x.numel() // max(1, x.shape[-1])
    return (w.dtype == x.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2 and w.stride(0) == 1
            and w.numel() >= ROW_BY_ROW_MIN_WEIGHT and 1 <= rows <= ROW_BY_ROW_MAX_ROWS)


# weight id -> (a weak reference to it, what identifies its values, its bf16 copy or None)
_TWINS: dict[int, tuple[weakref.ref, tuple, torch.Tensor | None]] = {}


def bf16_twin(w: torch.Tensor) -> torch.Tensor | None:
    """A row-major bfloat16 copy of float32 ``w`` [N, K] whose values are all bfloat16 ones (so
    the copy is exact), kept while ``w`` lives and its storage, shape and in-place write count
    stay; None where some value is not a bfloat16 one (found once per weight)."""
    key = (w.data_ptr(), w.shape, w.stride(), -1 if w.is_inference() else w._version)
    got = _TWINS.get(id(w))
    if got is not None and got[0]() is w and got[1] == key:
        return got[2]
    with torch.no_grad():
        twin = w.detach().to(torch.bfloat16).contiguous()
        twin = twin if torch.equal(twin.to(torch.float32), w) else None
    ident = id(w)
    _TWINS[ident] = (weakref.ref(w, lambda _, i=ident: _TWINS.pop(i, None)), key, twin)
    return twin
