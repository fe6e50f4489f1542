"""Checkpoint reads ahead of their use.

A loader that reads a tensor and then copies (or converts) it into the model leaves the disk idle
during every copy and the CPU idle during every read. Here one thread reads the next tensors' bytes
with plain file reads (which release the GIL) while the caller copies the previous ones, at most
``budget_bytes`` ahead, so a load runs at the slower of the two rates instead of their sum. By
default the budget is a 64th of the checkpoint (at most DEFAULT_BUDGET_BYTES), so the buffers in
flight keep a load's peak memory within 1.2x of the tensors it makes.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

K = TypeVar("K")

DEFAULT_BUDGET_BYTES = 256 << 20
# A slice whose contiguous runs are shorter than this is read as one span (its runs share the
# file's pages, which the disk reads whole) and picked in memory; longer runs are read one by one.
SMALL_RUN_BYTES = 16 << 10


def read_ahead(jobs: Iterable[tuple[K, int, Callable[[], torch.Tensor]]],
               budget_bytes: int | None = None) -> Iterator[tuple[K, torch.Tensor]]:
    """``(key, tensor)`` for each ``(key, nbytes, read)`` job, in order; the reads run on a thread,
    ``budget_bytes`` ahead at most (always at least the next one). A read that raises raises here."""
    todo = collections.deque(jobs)
    if budget_bytes is None:
        budget_bytes = min(DEFAULT_BUDGET_BYTES, sum(nbytes for _, nbytes, _ in todo) // 64)
    running: collections.deque = collections.deque()
    ahead = 0
    with ThreadPoolExecutor(1, thread_name_prefix="tidal-read") as pool:
        try:
            while todo or running:
                while todo and (not running or ahead + todo[0][1] <= budget_bytes):
                    key, nbytes, read = todo.popleft()
                    running.append((key, nbytes, pool.submit(read)))
                    ahead += nbytes
                key, nbytes, future = running.popleft()
                ahead -= nbytes
                yield key, future.result()
        finally:
            for _, _, future in running:
                future.cancel()


def read_block(path: str | os.PathLike, offset: int, shape: tuple[int, ...], dtype: torch.dtype,
               dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
    """The tensor of ``shape`` stored at ``offset`` of ``path`` (row-major), or its ``[start, stop)``
    along ``dim``, in a fresh buffer: plain reads (never a memory map, whose pages would count as
    this process's memory on top of the copy), one per contiguous run of the slice, or one for the
    span of short runs (see SMALL_RUN_BYTES)."""
    es = torch.empty(0, dtype=dtype).element_size()
    if dim is None:
        dim, start, stop = 0, 0, shape[0] if shape else 1
    outer = 1
    for s in shape[:dim]:
        outer *= s
    inner = 1
    for s in shape[dim + 1:]:
        inner *= s
    run = (stop - start) * inner * es  # bytes of one contiguous run
    stride = (shape[dim] if shape else 1) * inner * es
    out_shape = (*shape[:dim], stop - start, *shape[dim + 1:]) if shape else ()
    buf = bytearray(outer * run)
    if buf:
        view = memoryview(buf)
        fd = os.open(path, os.O_RDONLY)
        try:
            first = offset + start * inner * es
            if outer == 1 or run == stride:  # one contiguous range
                _pread_all(fd, view, first)
            elif run < SMALL_RUN_BYTES:  # the runs share pages anyway: one read of the span, then pick
                span = torch.empty((outer - 1) * stride + run, dtype=torch.uint8)
                _pread_all(fd, memoryview(span.numpy()), first)
                rows = span.as_strided((outer, run), (stride, 1))
                torch.frombuffer(buf, dtype=torch.uint8).view(outer, run).copy_(rows)
            else:
                for i in range(outer):
                    _pread_all(fd, view[i * run:(i + 1) * run], first + i * stride)
        finally:
            os.close(fd)
    if not buf:
        return torch.empty(out_shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(out_shape)


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise EOFError(f"the file ends {len(view) - done} bytes before the tensor does")
        done += n
