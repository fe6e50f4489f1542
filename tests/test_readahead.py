"""Checkpoint reads ahead of their use: slices read with plain file reads equal the tensor's slices,
and the read-ahead hands tensors back in order, within its byte budget, errors included."""

from __future__ import annotations

import functools
import json
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tidal.model.readahead import JOBS_PER_THREAD, read_ahead, read_block


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


def test_a_meta_model_does_not_import_torch_dynamo() -> None:
    """Building the model on the meta device (every load does) never initialises a meta tensor
    through torch._refs, whose first use imports torch._dynamo (seconds and ~75 MB)."""
    code = ("import sys, torch\nfrom tidal.model.kimi import KimiForCausalLM\nfrom tidal.config import ModelConfig\n"
            "from tidal.presets import tiny_k3_dict\n"
            "with torch.device('meta'):\n    KimiForCausalLM(ModelConfig.from_dict(tiny_k3_dict()))\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False"


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
