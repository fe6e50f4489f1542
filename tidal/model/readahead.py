"""Checkpoint reads ahead of their use, straight into the model's tensors.

A loader that reads a tensor into a buffer and then copies it into the model pays twice for every
byte: the read's copy out of the page cache and the copy into the model, each at memory speed, with
the first touch of every fresh page on top. Here a tensor whose bytes on disk are the bytes it will
hold (same dtype, a contiguous destination) is read directly into its destination's storage with
``os.preadv`` (no intermediate buffer, no second copy); only tensors that must be converted (another
dtype, MXFP4 dequantised or quantised, a vector cut to length) go through a buffer. The reads run on
READ_THREADS threads (file reads release the GIL) while the caller converts, at most ``budget_bytes``
of buffers ahead, so a load runs at the slower of the disk and the conversions, not their sum.
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

K = TypeVar("K")

DEFAULT_BUDGET_BYTES = 256 << 20
READ_THREADS = 2
JOBS_PER_THREAD = 4
# A slice whose contiguous runs are shorter than this is read as one span (its runs share the
# file's pages, which the disk reads whole) and picked in memory; longer runs are read one by one.
SMALL_RUN_BYTES = 16 << 10


def read_ahead(jobs: Iterable[tuple[K, int, Callable[[], torch.Tensor]]],
               budget_bytes: int | None = None, threads: int | None = None) -> Iterator[tuple[K, torch.Tensor]]:
    """``(key, tensor)`` for each ``(key, nbytes, read)`` job, in order; the reads run on ``threads``
    (default READ_THREADS) threads, at most ``budget_bytes`` of job bytes and JOBS_PER_THREAD jobs
    per thread ahead (always at least the next one). A job that reads into its destination holds no
    buffer and says nbytes 0. Jobs are taken from ``jobs`` only as they are started (a generator
    can allocate each destination as late as that). A read that raises raises here."""
    threads = threads or READ_THREADS
    if budget_bytes is None:
        jobs = list(jobs)
        budget_bytes = read_budget(sum(nbytes for _, nbytes, _ in jobs))
    todo = iter(jobs)
    nxt = next(todo, None)
    running: collections.deque = collections.deque()
    ahead = 0
    with ThreadPoolExecutor(threads, thread_name_prefix="tidal-read") as pool:
        try:
            while nxt is not None or running:
                while nxt is not None and (not running or (ahead + nxt[1] <= budget_bytes
                                                            and len(running) < JOBS_PER_THREAD * threads)):
                    key, nbytes, read = nxt
                    running.append((key, nbytes, pool.submit(read)))
                    ahead += nbytes
                    nxt = next(todo, None)
                key, nbytes, future = running.popleft()
                ahead -= nbytes
                yield key, future.result()
        finally:
            for _, _, future in running:
                future.cancel()


# A load's first bytes are read while its model is built, EARLY_CHUNK_BYTES a call, at most
# EARLY_BYTES (the load's own reads take over sooner on any model that takes less to build).
EARLY_BYTES = 512 << 20
EARLY_CHUNK_BYTES = 16 << 20


class EarlyReads:
    """Reads ``pieces`` ((file, offset, bytes), in the order the load will read them) into the page
    cache on a thread of its own, from before the files are opened or the model is built (neither
    needs the data), so the disk is busy from the load's first millisecond. ``stop()`` when the
    load's own reads start (from then on a second reader would only compete with them); ``close()``
    (stop, and wait for the call in flight) when the load ends.

    Each call is ``sendfile`` to /dev/null: the kernel reads the pages into the page cache and copies
    nothing, and the thread holds no GIL for the whole call (a reader through a buffer of its own
    needs the GIL every few MB, and a main thread busy in Python hands it over only every
    switch interval: both stall). Where sendfile cannot (another OS), plain reads into one small
    buffer. A piece that cannot be read (a missing file) ends the reads: the load reports it."""

    def __init__(self, pieces: Iterable[tuple[Path, int, int]], limit_bytes: int = EARLY_BYTES) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pieces, limit_bytes), name="tidal-read-early",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def join(self) -> None:
        """Wait until the reads end: all read, the limit reached, or stopped."""
        self._thread.join()

    def close(self) -> None:
        self.stop()
        self.join()

    def _run(self, pieces: Iterable[tuple[Path, int, int]], left: int) -> None:
        fds: dict[Path, int] = {}
        sink = os.open(os.devnull, os.O_WRONLY)
        buf: memoryview | None = None
        try:
            for path, offset, nbytes in pieces:
                end = offset + min(nbytes, left)
                left -= end - offset
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                while offset < end and not self._stopped.is_set():
                    want = min(EARLY_CHUNK_BYTES, end - offset)
                    if buf is None:
                        try:
                            n = os.sendfile(sink, fds[path], offset, want)
                        except OSError:
                            buf = memoryview(bytearray(1 << 20))
                            continue
                    else:
                        n = os.preadv(fds[path], [buf[: min(len(buf), want)]], offset)
                    if n <= 0:
                        break
                    offset += n
                if left <= 0 or self._stopped.is_set():
                    return
        except OSError:
            return
        finally:
            for fd in (sink, *fds.values()):
                os.close(fd)


def read_budget(total_bytes: int) -> int:
    """Bytes of buffers a load keeps in flight: a 64th of the checkpoint, at most DEFAULT_BUDGET_BYTES
    (so a load's peak memory stays within 1.2x of the tensors it makes)."""
    return min(DEFAULT_BUDGET_BYTES, total_bytes // 64)


def read_block(path: str | os.PathLike, offset: int, shape: tuple[int, ...], dtype: torch.dtype,
               dim: int | None = None, start: int = 0, stop: int = 0, out: torch.Tensor | None = None,
               fd: int | None = None) -> torch.Tensor:
    """The tensor of ``shape`` stored at ``offset`` of ``path`` (row-major), or its ``[start, stop)``
    along ``dim``: read into ``out`` (a contiguous tensor of the slice's dtype and element count,
    returned as it is) or else into a fresh buffer. Plain reads (never a memory map, whose pages would
    count as this process's memory on top of the copy), one per contiguous run of the slice, or one
    for the span of short runs (see SMALL_RUN_BYTES). ``fd``: ``path`` already open (kept open across
    reads, the kernel's sequential read-ahead follows the whole file)."""
    es = dtype.itemsize
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
    if out is None:
        out = torch.empty(out_shape, dtype=dtype)
    elif out.dtype != dtype or out.numel() * es != outer * run or not out.is_contiguous():
        raise ValueError(f"read_block: destination {out.dtype} {tuple(out.shape)} does not take {dtype} {out_shape}")
    if outer * run == 0:
        return out
    view = _bytes_of(out)
    own = fd is None
    if own:
        fd = os.open(path, os.O_RDONLY)
    try:
        first = offset + start * inner * es
        if outer == 1 or run == stride:  # one contiguous range
            _pread_all(fd, view, first)
        elif run < SMALL_RUN_BYTES:  # the runs share pages anyway: one read of the span, then pick
            span = torch.empty((outer - 1) * stride + run, dtype=torch.uint8)
            _pread_all(fd, _bytes_of(span), first)
            rows = span.as_strided((outer, run), (stride, 1))
            out.reshape(-1).view(torch.uint8).view(outer, run).copy_(rows)
        else:
            for i in range(outer):
                _pread_all(fd, view[i * run:(i + 1) * run], first + i * stride)
    finally:
        if own:
            os.close(fd)
    return out


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t``, writable, without a copy (and without numpy, whose
    first use costs a process about a megabyte)."""
    return memoryview((ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise EOFError(f"the file ends {len(view) - done} bytes before the tensor does")
        done += n
