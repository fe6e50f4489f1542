"""Checkpoint files mapped into memory, so a weight can be a view of its bytes in the file.

Reading a weight into memory the process allocates costs a copy out of the page cache and the first
touch of every new page, which on a virtual machine is the slow part of a load (a fresh process
fills new memory at a fraction of the disk's rate). A weight whose bytes on disk are its bytes in
memory (same dtype: a whole tensor, a range of its rows, or one stacked expert weight as a strided
view over the experts' runs, ``checkpoint.map_experts``) is instead a view of the file's mapping: the load reads the file into the page
cache, as ``cat`` does, and maps those pages (``MADV_POPULATE_READ``), with no copy and no new
memory. This is llama.cpp's default (``--no-mmap`` turns it off there; ``use_mmap=False`` here).

The mapping is private and writable: a write to a weight copies that page for this process and
never reaches the file. Clean pages stay the page cache's, so a process under memory pressure may
drop them and read them back from the file later. The file must not be truncated or rewritten in
place while a model maps it (``save_model`` writes new files: it unlinks the old ones first).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22  # Linux 5.14
PAGE = mmap.PAGESIZE


class MappedFiles:
    """Each file mapped once, on first use, for as long as a view of it lives (a view holds a
    reference to its mapping; nothing is unmapped while a weight uses it)."""

    def __init__(self) -> None:
        self.maps: dict[Path, mmap.mmap] = {}
        self.populate_works = True
        self._populating = threading.Lock()

    def view(self, path: Path, offset: int, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The ``nbytes`` at ``offset`` of ``path`` as a tensor of ``shape`` and ``dtype`` sharing the
        mapping's pages, or None where the bytes cannot back such a tensor (misaligned for the
        dtype, or the file too short)."""
        count = 1
        for s in shape:
            count *= s
        if count * dtype.itemsize != nbytes or offset % dtype.itemsize or nbytes == 0:
            return None
        m = self._map(path)
        if offset + nbytes > len(m):
            return None
        return torch.frombuffer(m, dtype=dtype, count=count, offset=offset).view(shape)

    def populate(self, t: torch.Tensor) -> torch.Tensor:
        """Read ``t``'s pages from the file and map them now (not at the first forward pass);
        returns ``t``. Where the kernel has no MADV_POPULATE_READ, asks for read-ahead instead."""
        self.populate_span(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        return t

    def populate_span(self, start: int, end: int) -> None:
        """:meth:`populate` of the mapped addresses [start, end). The span's reads are first queued
        all at once (MADV_WILLNEED: asynchronous read-ahead of the whole span, which a caller on
        another thread issues while the span before is still being mapped), then its pages are
        mapped one span at a time: a fault alone would read one read-around window and wait."""
        start = start // PAGE * PAGE
        _madvise(start, end - start, _MADV_WILLNEED)
        if not self.populate_works:
            return
        with self._populating:
            if _madvise(start, end - start, _MADV_POPULATE_READ) != 0:
                self.populate_works = False

    def _map(self, path: Path) -> mmap.mmap:
        m = self.maps.get(path)
        if m is None:
            fd = os.open(path, os.O_RDONLY)
            try:
                m = self.maps[path] = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_PRIVATE,
                                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        return m


_LIBC: ctypes.CDLL | None = None


def _madvise(start: int, length: int, advice: int) -> int:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)


# A run of mapped weights is populated in spans of at most this many bytes (progress is reported per span).
SPAN_BYTES = 64 << 20

Job = tuple[object, int, Callable[[], object]]


def coalesce(jobs: Iterable[tuple[str, int, Callable[[], torch.Tensor] | torch.Tensor]], mapped: MappedFiles
             ) -> Iterator[Job]:
    """The read jobs ``(name, nbytes, read)`` of a load (``tidal.model.readahead.read_ahead``) where a
    job whose third item is a tensor (a contiguous view of ``mapped``: its pages to populate) joins the
    views before it that end where it starts: one job per run of adjacent views, keyed by the tuple
    of their names, whose result is the tuple of views (safetensors stores tensors back to back, so
    a file of mapped weights is a few spans, populated in file order)."""
    names: list[str] = []
    views: list[torch.Tensor] = []
    start = end = 0

    def flush() -> Job:
        span, kept = (start, end), tuple(views)
        names_now = tuple(names)
        names.clear()
        views.clear()

        def populate() -> tuple[torch.Tensor, ...]:
            mapped.populate_span(*span)
            return kept

        return names_now, 0, populate

    for name, nbytes, job in jobs:
        if not isinstance(job, torch.Tensor):
            if names:
                yield flush()
            yield name, nbytes, job
            continue
        lo = job.data_ptr()
        hi = lo + job.numel() * job.element_size()
        if names and not (lo == end and hi - start <= SPAN_BYTES):
            yield flush()
        if not names:
            start = lo
        names.append(name)
        views.append(job)
        end = hi
    if names:
        yield flush()
