"""The greedy sampler's argmax of logits rows (``torch.argmax(dim=-1)``), in C on the CPU.

torch's CPU argmax reduces a row in a scalar loop, on one thread, and a step's logits are B rows of
the whole vocabulary; csrc/argmax_rows.c picks the same index (the first maximum, the first NaN
where there is one) with vector compares (benchmarks/bench_argmax.py has the figures)."""

from __future__ import annotations

import torch

from tidal.ops.cpu_kernels import argmax_rows_kernel, fused_decode_enabled


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> the index of each row's largest value [B] (int64), as ``x.argmax(dim=-1)``."""
    if (x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] > 0 and x.shape[1] > 0
            and x.stride(1) == 1 and not x.requires_grad and fused_decode_enabled()):
        fn = argmax_rows_kernel()
        if fn is not None:
            out = torch.empty(x.shape[0], dtype=torch.long)
            fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
            return out
    return x.argmax(dim=-1)
