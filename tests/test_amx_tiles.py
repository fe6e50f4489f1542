"""The AMX-BF16 tile path of the bf16 trunk's products (tidal/ops/csrc/amx_tiles.h) and of the packed
MXFP4 experts' gate|up product (csrc/mxfp4_gemm.c) on fresh random inputs: float64 within float32
accumulation, row- and thread-invariant bitwise, off under deterministic inference (per thread) and
with TIDAL_CPU_AMX=0, TIDAL_CPU_KERNELS=0 and TIDAL_CPU_PORTABLE=1. Skipped where the CPU (or
Linux) gives no AMX tiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tidal.ops import batch_invariant, cpu_kernels

from test_mxfp4_moe import SCALE_CLASSES, check, groups, random_experts

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def values():
    """bf16_values_kernel: float32 rows of bfloat16 values in, float32 sums out (the layer steps' form)."""
    gemm = cpu_kernels.bf16_values_kernel()
    if gemm is None:
        pytest.skip("no C compiler here: the torch form runs")
    with cpu_kernels.amx_rows(1) as rows:
        if rows == 0:
            pytest.skip("no AMX-BF16 tiles on this CPU (or Linux refused them)")
    return gemm


def case(gen: torch.Generator, M: int, K: int, ns: tuple[int, ...], gap: int = 0):
    """M rows of bfloat16 values (float32) and weights [n, K] of bfloat16 at row stride K + gap."""
    x = torch.randn(M, K, generator=gen).bfloat16().float()
    ws = [torch.randn(n, K + gap, generator=gen).bfloat16()[:, gap:] for n in ns]
    return x, ws


def absolute(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    return x.double().abs() @ torch.cat(ws).double().abs().t()


@pytest.mark.parametrize("M", [8, 9, 16, 17, 31, 33, 64, 100])
def test_tiles_match_float64_and_differ_from_the_fma_tiles(values, M):
    """Odd part widths (a last weight tile of fewer than 16 rows), several parts at row strides: each
    sum within float32 accumulation of float64; the bits are not the FMA tiles' (the path ran)."""
    gen = torch.Generator().manual_seed(M)
    x, ws = case(gen, M, 768 if M % 2 else 384, (6, 77, 64, 130), gap=32)
    ref = x.double() @ torch.cat(ws).double().t()
    with cpu_kernels.amx_rows(8):
        got = values(x, ws)
    with cpu_kernels.amx_rows(0):
        fma = values(x, ws)
    assert got.shape == ref.shape
    assert ((got.double() - ref).abs() <= 1e-5 * absolute(x, ws) + 1e-30).all()
    assert ((fma.double() - ref).abs() <= 1e-5 * absolute(x, ws) + 1e-30).all()
    assert not torch.equal(got, fma)


def test_bf16_rows_have_the_bits_of_the_values_kernel_rounded(values):
    """bfloat16 rows at a stride through the parts kernel == the float32-values product rounded once."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20, 256 + 7, generator=gen).bfloat16()[:, 5:261]
    ws = [torch.randn(n, 256, generator=gen).bfloat16() for n in (33, 100)]
    with cpu_kernels.amx_rows(8):
        got = cpu_kernels.bf16_parts_kernel()(x, ws)
        single = cpu_kernels.bf16_rows_kernel()(x, ws[1])
        want = values(x.float(), ws)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    assert torch.equal(single, got[:, 33:])


def test_a_row_has_the_same_bits_alone_in_any_batch_and_on_any_thread_count(values):
    """Every row of a 100-row product == the same row in sub-batches of 8 to 53 rows at any offset
    and == the row alone (threshold 1), bitwise; 1 thread == 2 threads (the product is big enough
    for both)."""
    gen = torch.Generator().manual_seed(5)
    x, ws = case(gen, 100, 768, (771, 13), gap=64)
    threads = torch.get_num_threads()
    try:
        with cpu_kernels.amx_rows(8):
            torch.set_num_threads(2)
            full = values(x, ws)
            for start, m in ((0, 8), (3, 13), (40, 16), (47, 53), (90, 10)):
                assert torch.equal(values(x[start : start + m], ws), full[start : start + m]), (start, m)
            torch.set_num_threads(1)
            assert torch.equal(values(x, ws), full)
        with cpu_kernels.amx_rows(1):
            alone = torch.cat([values(x[i : i + 1], ws) for i in range(0, 100, 7)])
        assert torch.equal(alone, full[::7])
    finally:
        torch.set_num_threads(threads)


def test_deterministic_mode_never_takes_the_tiles_on_its_thread(values):
    """Under deterministic inference a product of many rows has the FMA tiles' bits; another thread
    outside the mode meanwhile takes the tiles; on leaving the mode they are back."""
    gen = torch.Generator().manual_seed(7)
    x, ws = case(gen, 40, 512, (96, 5))
    with cpu_kernels.amx_rows(8):
        tiles = values(x, ws)
        with cpu_kernels.amx_rows(0):
            fma = values(x, ws)
        other = []
        with batch_invariant.deterministic_mode():
            assert torch.equal(values(x, ws), fma)
            worker = threading.Thread(target=lambda: other.append(values(x, ws)))
            worker.start()
            worker.join()
            with batch_invariant.deterministic_mode(False):
                assert torch.equal(values(x, ws), tiles)
            assert torch.equal(values(x, ws), fma)
        assert torch.equal(other[0], tiles)
        assert torch.equal(values(x, ws), tiles)
    assert not torch.equal(tiles, fma)


SCRIPT = """
import json, torch
from tidal.ops import cpu_kernels, dense
gen = torch.Generator().manual_seed(11)
x = torch.randn(24, 256, generator=gen).bfloat16()
w = torch.randn(40, 256, generator=gen).bfloat16()
lib = cpu_kernels._library("bf16_gemm")
out = dense.linear(x, w)
ref = x.double() @ w.double().t()
print(json.dumps({"setting": cpu_kernels.amx_rows_setting(), "in_force": cpu_kernels.set_amx_rows(cpu_kernels.amx_rows_setting()),
                  "kernels": lib is not None, "bind": lib is not None and hasattr(lib, "tidal_amx_bind"),
                  "bits": out.view(torch.int16).tolist(), "close": bool(torch.allclose(out.double(), ref, rtol=1e-2, atol=1e-1))}))
"""


def run_with(env: dict[str, str]) -> dict:
    switches = ("TIDAL_CPU_AMX", "TIDAL_CPU_KERNELS", "TIDAL_CPU_PORTABLE")  # this run's own, not the caller's
    full = {**{k: v for k, v in os.environ.items() if k not in switches}, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=full, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_fma_path_runs_when_the_tiles_are_switched_off(values):
    """TIDAL_CPU_AMX=0: the FMA tiles' bits (those of the switch at 0 here); TIDAL_CPU_PORTABLE=1: no
    tile path in the library, within rounding; TIDAL_CPU_KERNELS=0: torch's product, no switch."""
    default, off = run_with({}), run_with({"TIDAL_CPU_AMX": "0"})
    portable, none = run_with({"TIDAL_CPU_PORTABLE": "1"}), run_with({"TIDAL_CPU_KERNELS": "0"})
    assert default["in_force"] == cpu_kernels.AMX_MIN_ROWS and default["bind"]
    assert off["setting"] == off["in_force"] == 0 and off["bind"]
    assert portable["kernels"] and not portable["bind"]
    assert not none["kernels"] and none["in_force"] == 0
    assert all(r["close"] for r in (default, off, portable, none))
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(24, 256, generator=gen).bfloat16(), torch.randn(40, 256, generator=gen).bfloat16()
    with cpu_kernels.amx_rows(0):
        fma = cpu_kernels.bf16_rows_kernel()(x, w).view(torch.int16).tolist()
    with cpu_kernels.amx_rows(cpu_kernels.AMX_MIN_ROWS):
        tiles = cpu_kernels.bf16_rows_kernel()(x, w).view(torch.int16).tolist()
    assert off["bits"] == fma and default["bits"] == tiles


@pytest.mark.parametrize("K", [48, 200])
def test_widths_that_are_no_multiple_of_32_keep_the_fma_tiles(values, K):
    gen = torch.Generator().manual_seed(K)
    x, ws = case(gen, 32, K, (50,))
    with cpu_kernels.amx_rows(8):
        got = values(x, ws)
    with cpu_kernels.amx_rows(0):
        assert torch.equal(got, values(x, ws))


@pytest.fixture()
def experts_gemm(values):
    """csrc/mxfp4_gemm.c's grouped product of packed MXFP4 experts (bfloat16 rows: groups of a few
    rows on the tiles)."""
    kernels = cpu_kernels.mxfp4_kernels()
    if kernels is None:
        pytest.skip("no C compiler here")
    return kernels[0]


def test_expert_groups_on_the_tiles_match_float64_and_are_row_invariant(experts_gemm):
    """Groups of 1 to 33 bfloat16 rows (odd N, K of several k steps): within float32 accumulation of
    float64; groups of AMX_GROUP_MIN_ROWS (4) rows or more take the tiles (other bits than the FMA
    tiles); a row's bits do not depend on the rows beside it once every group takes them (threshold
    1), nor on the thread count; deterministic mode keeps the FMA tiles."""
    gen = torch.Generator().manual_seed(17)
    packed, scales = random_experts(gen, 6, 70, 256)
    counts = [5, 1, 17, 4, 33]
    experts, offsets, ids = groups(gen, 6, counts)
    x = torch.randn(sum(counts), 256, generator=gen).bfloat16()
    with cpu_kernels.amx_rows(8):
        tiles = experts_gemm(x, offsets, ids, packed, scales)
        with batch_invariant.deterministic_mode():
            deterministic = experts_gemm(x, offsets, ids, packed, scales)
    with cpu_kernels.amx_rows(0):
        fma = experts_gemm(x, offsets, ids, packed, scales)
    check(tiles, x.float(), counts, experts, packed, scales)
    assert torch.equal(deterministic, fma)
    one_row = slice(5, 6)  # the group of one row stays on the FMA tiles
    assert torch.equal(tiles[one_row], fma[one_row]) and not torch.equal(tiles[6:23], fma[6:23])
    threads = torch.get_num_threads()
    try:
        with cpu_kernels.amx_rows(1):
            every = experts_gemm(x, offsets, ids, packed, scales)
            torch.set_num_threads(1 if threads > 1 else 2)
            assert torch.equal(experts_gemm(x, offsets, ids, packed, scales), every)
            starts = offsets.tolist()
            for g, e in enumerate(experts):  # each group's rows alone, two rows at a time
                for t in range(starts[g], starts[g + 1], 2):
                    m = min(2, starts[g + 1] - t)
                    alone = experts_gemm(x[t : t + m], torch.tensor([0, m]), torch.tensor([e]), packed, scales)
                    assert torch.equal(alone, every[t : t + m]), (g, t)
    finally:
        torch.set_num_threads(threads)


def test_expert_groups_on_the_tiles_take_every_scale_byte_class(experts_gemm):
    """Subnormal, tiny, unit and huge scales (the bfloat16 decode's exponent shortcut and its float32
    fallback): within float32 accumulation of float64 (bfloat16 subnormal weights, which the tiles
    read as zero, only where a whole sum is that small)."""
    gen = torch.Generator().manual_seed(19)
    packed, scales = random_experts(gen, 3, 40, 256, SCALE_CLASSES)
    counts = [6, 9, 16]
    experts, offsets, ids = groups(gen, 3, counts)
    x = (torch.randn(31, 256, generator=gen) * 2.0**-20).bfloat16()
    with cpu_kernels.amx_rows(8):
        tiles = experts_gemm(x, offsets, ids, packed, scales)
    with cpu_kernels.amx_rows(0):
        assert not torch.equal(tiles, experts_gemm(x, offsets, ids, packed, scales))
    check(tiles, x.float(), counts, experts, packed, scales)
