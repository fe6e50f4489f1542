"""Triton kernels of the CUDA path, each the fast form of a torch reference in ``tidal.ops``.

Importing this package never imports triton; :func:`use_triton` says whether a tensor's op may
take a Triton kernel (a CUDA tensor and triton importable). The tests run every kernel against its
reference on the CPU under ``TRITON_INTERPRET=1`` in a separate environment (``tests_triton/``):
triton stays out of the main test environment.
"""

from __future__ import annotations

from functools import cache

import torch

from tidal.ops.switches import getenv


@cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Whether the op on ``t`` runs a Triton kernel: CUDA tensors with triton installed, or any
    tensor under the interpreter (how the tests run the model's GPU path on the CPU)."""
    return (t.is_cuda or interpreting()) and triton_available()


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def interpreting() -> bool:
    """Under triton's CPU interpreter (TRITON_INTERPRET=1), whose tl.dot on 16-bit operands is wrong
    (it multiplies their bit patterns): kernels then multiply in float32 (see ``dot_dtype``)."""
    return getenv("TRITON_INTERPRET", "0") == "1"


def dot_dtype(dtype: torch.dtype):
    """The operand type of a kernel's tl.dot for data stored in ``dtype``: the storage type on the
    GPU (bf16 tensor cores), float32 under the interpreter."""
    import triton.language as tl

    if interpreting() or dtype == torch.float32:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]
