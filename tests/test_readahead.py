"""Checkpoint reads ahead of their use: slices read with plain file reads equal the tensor's slices,
and the read-ahead hands tensors back in order, within its byte budget, errors included."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import json
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tidal.model.readahead import JOBS_PER_THREAD, EarlyReads, read_ahead, read_block


def test_read_block_equals_slicing(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(6, 5, 4, generator=g), "b": torch.randn(7, 3, generator=g).to(torch.bfloat16),
               "c": torch.tensor(2.5), "d": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
               "e": torch.randn(3, 8192, generator=g)}  # runs of 16 KiB and more: read one by one
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    for name, t in tensors.items():
        info = header[name]
        offset = 8 + n + info["data_offsets"][0]
        assert torch.equal(read_block(path, offset, tuple(t.shape), t.dtype), t), name
        for dim in range(t.dim()):
            size = t.shape[dim]
            for start, stop in ((0, size), (1, size), (0, 1), (size // 2, size - 1), (size - 1, size)):
                got = read_block(path, offset, tuple(t.shape), t.dtype, dim, start, stop)
                assert torch.equal(got, t.narrow(dim, start, stop - start)), (name, dim, start, stop)
                into = torch.full_like(t.narrow(dim, start, stop - start), 7).contiguous()
                assert read_block(path, offset, tuple(t.shape), t.dtype, dim, start, stop, out=into) is into
                assert torch.equal(into, t.narrow(dim, start, stop - start)), ("into", name, dim, start, stop)
    with pytest.raises(ValueError, match="does not take"):
        read_block(path, 8 + n, (6, 5, 4), torch.float32, out=torch.empty(6, 5, 3))
    with pytest.raises(ValueError, match="does not take"):
        read_block(path, 8 + n, (6, 5, 4), torch.float32, out=torch.empty(6, 5, 4, dtype=torch.float64))
    with pytest.raises(EOFError):
        read_block(path, len(raw) - 4, (4,), torch.float32)


def test_read_ahead_keeps_order_and_budget_and_raises() -> None:
    ahead, most, lock = [0], [0], threading.Lock()

    def read(i: int) -> torch.Tensor:
        with lock:
            ahead[0] += 1
            most[0] = max(most[0], ahead[0])
        return torch.full((i + 1,), float(i))

    jobs = [(i, 100, functools.partial(read, i)) for i in range(20)]
    got = []
    for key, t in read_ahead(jobs, budget_bytes=300):
        with lock:
            ahead[0] -= 1
        got.append(key)
        assert torch.equal(t, torch.full((key + 1,), float(key)))
    assert got == list(range(20))
    assert most[0] <= 3  # never more than the budget's worth read and not yet taken

    def bad() -> torch.Tensor:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        list(read_ahead([(0, 1, lambda: torch.zeros(1)), (1, 1, bad)]))


def test_read_ahead_takes_jobs_only_as_it_starts_them() -> None:
    """Jobs that read into their destination (nbytes 0) are started at most JOBS_PER_THREAD per
    thread ahead of the caller, and pulled from the generator only then (so a loader allocates each
    destination as late as that)."""
    made, taken = [0], []

    def jobs():
        for i in range(40):
            made[0] += 1
            yield i, 0, functools.partial(torch.full, (1,), float(i))

    for key, t in read_ahead(jobs(), budget_bytes=0, threads=2):
        taken.append(key)
        assert made[0] <= key + 1 + JOBS_PER_THREAD * 2
        assert t.item() == key
    assert taken == list(range(40))


@pytest.mark.parametrize("build", ["KimiForCausalLM(config)",
                                   "build_rank_model(config, RankPlace(1, 2, 2), Collectives(RankPlace(1, 2, 2), None, None))"])
def test_a_meta_model_is_not_initialised(build) -> None:
    """Building the model, or a rank's (vocabulary-parallel lm_head included), on the meta device
    (every load does) runs none of torch.nn.init: on a meta tensor it goes through torch._refs,
    whose first use imports torch._dynamo (seconds and ~75 MB), and through code of libtorch a
    process has not run yet (a tenth of a second of a rank's load when the page cache is cold)."""
    code = ("import sys, torch\nfrom tidal.model.kimi import KimiForCausalLM\nfrom tidal.config import ModelConfig\n"
            "from tidal.parallel.groups import Collectives, RankPlace\nfrom tidal.parallel.shard import build_rank_model\n"
            "from tidal.presets import tiny_k3_dict\nconfig = ModelConfig.from_dict(tiny_k3_dict())\ncalls = []\n"
            "for name in ('kaiming_uniform_', 'uniform_', 'normal_', 'zeros_', 'ones_'):\n"
            "    f = getattr(torch.nn.init, name)\n"
            "    setattr(torch.nn.init, name, lambda *a, f=f, name=name, **k: calls.append(name) or f(*a, **k))\n"
            f"with torch.device('meta'):\n    {build}\n"
            "print('torch._dynamo' in sys.modules, sorted(set(calls)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False []"


def test_mapped_views_are_populated_in_ranges_of_a_few_jobs(tmp_path, monkeypatch):
    """coalesce: consecutive views become one job (names and views in order) of at least
    SPAN_BYTES, views that continue one another one range (a strided view: its first to last
    element); a read job ends a job early and passes unchanged."""
    from tidal.model import mapped
    from tidal.model.mapped import MappedFiles, coalesce

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 64)  # 16 KiB
    files = MappedFiles()
    whole = files.view(path, 0, 16384, (16384,), torch.uint8)
    jobs_ranges = []
    monkeypatch.setattr(files, "populate_ranges",
                        lambda rs: jobs_ranges.append([(lo - whole.data_ptr(), hi - whole.data_ptr()) for lo, hi in rs]))
    monkeypatch.setattr(mapped, "SPAN_BYTES", 8000)
    read = lambda: torch.zeros(1)  # noqa: E731
    columns = whole[9000:12000].view(30, 100)[:, :40]  # 30 rows of 40 at a stride of 100
    jobs = [("a", 0, whole[0:1000]), ("b", 0, whole[1000:3000]), ("r", 4, read), ("c", 0, whole[3000:4000]),
            ("d", 0, whole[4096:8192]), ("e", 0, columns), ("f", 0, whole[12000:16384])]
    out = list(coalesce(jobs, files))
    assert [key for key, _, _ in out] == [("a", "b"), "r", ("c", "d", "e"), ("f",)]
    assert out[1][1:] == (4, read)
    results = [job() for _, _, job in out]
    assert jobs_ranges == [[(0, 3000)], [(3000, 4000), (4096, 8192), (9000, 9000 + 29 * 100 + 40)], [(12000, 16384)]]
    assert results[2][2] is columns and [t.data_ptr() for t in results[0]] == [whole[0:1].data_ptr(), whole[1000:1001].data_ptr()]


def _cached_pages(path: Path) -> list[bool]:
    """Which pages of ``path`` are in the page cache (mincore over a mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size = path.stat().st_size
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    fd = os.open(path, os.O_RDONLY)
    try:
        at = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert libc.mincore(ctypes.c_void_p(at), ctypes.c_size_t(size), vec) == 0
        libc.munmap(ctypes.c_void_p(at), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return [bool(b & 1) for b in vec]


def _uncached(path: Path, nbytes: int) -> Path:
    """A file of ``nbytes`` random bytes, written through and dropped from the page cache."""
    path.write_bytes(os.urandom(nbytes))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path


@pytest.mark.parametrize("sendfile", [True, False])
def test_early_reads_bring_the_pieces_into_the_page_cache(tmp_path, monkeypatch, sendfile) -> None:
    """EarlyReads reads its pieces into the page cache (by sendfile, or plain reads where sendfile
    fails), at most limit_bytes of them, and a piece that cannot be read ends them without raising."""
    if not sendfile:
        def no_sendfile(*args):
            raise OSError("sendfile unavailable")
        monkeypatch.setattr(os, "sendfile", no_sendfile)
    page, mb = mmap.PAGESIZE, 1 << 20
    a, b = _uncached(tmp_path / "a", 8 * mb), _uncached(tmp_path / "b", 64 * mb)
    if any(_cached_pages(a)) or sum(_cached_pages(b)) > len(_cached_pages(b)) // 4:
        pytest.skip("this file system keeps written files in the page cache (tmpfs?)")
    EarlyReads([(a, 2 * mb, 4 * mb), (b, 0, 48 * mb)], limit_bytes=12 * mb).join()
    got_a, got_b = _cached_pages(a), _cached_pages(b)
    assert all(got_a[2 * mb // page : 6 * mb // page])
    assert all(got_b[: 8 * mb // page])  # the rest of the 12 MB limit
    assert sum(got_b) * page < 40 * mb  # not all 48 MB asked for (the kernel reads a little ahead)
    EarlyReads([(tmp_path / "missing", 0, mb), (a, 0, mb)]).join()  # no error: the load reports it
