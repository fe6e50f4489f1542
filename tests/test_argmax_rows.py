"""The greedy sampler's row argmax in C (csrc/argmax_rows.c through tidal.ops.argmax.argmax_rows) picks
torch.argmax(dim=-1)'s index: the first maximum, the first NaN of a row holding one, -0.0 == +0.0,
rows of -inf; on widths around the vector width, strided rows, a row alone == in a batch; the
portable build and the kernels off give the same."""

from __future__ import annotations

import pytest
import torch

from tidal.ops import cpu_kernels
from tidal.ops.argmax import argmax_rows


@pytest.fixture(autouse=True)
def kernel_built():
    if cpu_kernels.argmax_rows_kernel() is None:
        pytest.skip("no C compiler here: torch's argmax runs")


def tied_rows(B: int, V: int, gen: torch.Generator, trial: int) -> torch.Tensor:
    """Small integers (many ties), with NaN, +inf or -inf sprinkled in on some trials."""
    x = torch.randint(-3, 4, (B, V), generator=gen).float()
    for every, frac, value in ((3, 0.01, float("nan")), (5, 0.1, float("-inf")), (7, 0.05, float("inf"))):
        if trial % every == 0:
            x[torch.rand(B, V, generator=gen) < frac] = value
    return x


@pytest.mark.parametrize("V", [1, 5, 15, 16, 17, 31, 32, 33, 47, 100, 32000])
def test_argmax_rows_picks_torchs_index(V):
    gen = torch.Generator().manual_seed(70 + V)
    for trial in range(60):
        x = tied_rows(5, V, gen, trial)
        got = argmax_rows(x)
        assert got.dtype == torch.long and torch.equal(got, x.argmax(dim=-1)), trial


def test_argmax_rows_edge_rows():
    nan, inf = float("nan"), float("inf")
    x = torch.full((6, 40), -inf)
    x[1, 39] = nan  # a NaN in the tail after the vector part
    x[2, 3], x[2, 20] = nan, nan
    x[3, 17], x[3, 5] = -0.0, 0.0  # every other value -inf: +0.0 and -0.0 tie, the first wins
    x[4, 0], x[4, 38] = inf, inf
    x[5] = torch.arange(40.0)  # the maximum in the tail
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [0, 39, 3, 5, 0, 39]


def test_argmax_rows_strided_rows_alone_and_in_a_batch():
    gen = torch.Generator().manual_seed(71)
    base = torch.randn(33, 32000 + 7, generator=gen)
    x = base[:, 3 : 3 + 32000]  # rows at a stride wider than the row
    want = x.argmax(dim=-1)
    assert torch.equal(argmax_rows(x), want)
    assert torch.equal(torch.cat([argmax_rows(x[b : b + 1]) for b in range(33)]), want)


def test_argmax_rows_falls_back_where_the_kernel_does_not_apply(monkeypatch):
    """Other dtypes, columns, empty rows (torch's error), TIDAL_FUSED_DECODE=0 and TIDAL_CPU_KERNELS=0."""
    gen = torch.Generator().manual_seed(72)
    x = torch.randn(4, 300, generator=gen)
    assert torch.equal(argmax_rows(x.double()), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x.t()), x.t().argmax(dim=-1))
    with pytest.raises((IndexError, RuntimeError)):
        argmax_rows(torch.empty(2, 0))
    monkeypatch.setenv("TIDAL_FUSED_DECODE", "0")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    monkeypatch.delenv("TIDAL_FUSED_DECODE")
    try:
        monkeypatch.setenv("TIDAL_CPU_KERNELS", "0")
        cpu_kernels._library.cache_clear()
        cpu_kernels.argmax_rows_kernel.cache_clear()
        assert cpu_kernels.argmax_rows_kernel() is None
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    finally:
        monkeypatch.delenv("TIDAL_CPU_KERNELS")
        cpu_kernels._library.cache_clear()
        cpu_kernels.argmax_rows_kernel.cache_clear()
