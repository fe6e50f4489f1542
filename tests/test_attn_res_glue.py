"""The glue between two sub-layers in one C call (csrc/attn_res.c's attn_res_glue through
tidal.ops.fused_decode.attn_res_glue and tidal.model.attn_res.attn_res_glue): the residual add, Block
AttnRes and the next RMSNorm have the bits of the three separate ops, a row's bits do not depend on
the other rows or the thread count, and all three match float64 within the dtype's rounding. (The
engine's greedy tokens with the glue on and off: test_fused_decode's bf16 engine test.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tidal.model.attn_res import attn_res, attn_res_glue, attn_res_params
from tidal.model.layers import RMSNorm, rms_norm
from tidal.ops import cpu_kernels, fused_decode
from tidal.ops.fused_decode import BlockCache

from test_fused_decode import reference_attn_res, threads

D, EPS = 96, 1e-6


@pytest.fixture(autouse=True)
def kernels_built():
    if cpu_kernels.attn_res_glue_kernel() is None or cpu_kernels.rms_norm_kernel() is None:
        pytest.skip("no C compiler here: the separate ops run")


def owner_and_norm(dtype: torch.dtype, seed: int) -> tuple[nn.Module, RMSNorm]:
    """An AttnRes owner with random pseudo-query weights, and a norm with random weights."""
    gen = torch.Generator().manual_seed(seed)
    owner = nn.Module()
    attn_res_params(owner, "res", D)
    norm = RMSNorm(D, 1e-5)
    with torch.no_grad():
        owner.res_norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
        owner.res_proj.weight.copy_(torch.randn(1, D, generator=gen) * D**-0.5)
        norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
    return owner.to(dtype), norm.to(dtype)


def rows(T: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """T rows of D values at a row stride wider than D (views, as a sub-layer's outputs can be)."""
    return (torch.randn(T, D + 5, generator=gen) * 3).to(dtype)[:, 2 : 2 + D]


def separate(owner, norm, partial, add, blocks):
    """The three ops as the torch form of the model runs them (their own C kernels where they take the rows)."""
    total = partial if add is None else partial + add
    a = attn_res(total, blocks, owner.res_norm.weight, owner.res_proj.weight, EPS, BlockCache())
    return total, a, norm(a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_blocks", [0, 1, 3])
@pytest.mark.parametrize("with_add", [True, False])
def test_glue_has_the_bits_of_the_separate_ops_and_matches_float64(dtype, n_blocks, with_add):
    """1, 5 and 700 rows (a prefill chunk: the threaded add): (s, a, norm(a)) == the separate ops',
    bitwise; a row alone == in the batch and 1 thread == 2; each against float64 from the same inputs,
    within the dtype's rounding."""
    owner, norm = owner_and_norm(dtype, seed=60 + n_blocks)
    gen = torch.Generator().manual_seed(61)
    for T in (1, 5, 700):
        partial, add = rows(T, dtype, gen), rows(T, dtype, gen) if with_add else None
        blocks = [rows(T, dtype, gen) for _ in range(n_blocks)]
        calls = []
        real = fused_decode.attn_res_glue
        with torch.inference_mode():
            fused_decode.attn_res_glue = lambda *a: (lambda r: calls.append(r is not None) or r)(real(*a))
            try:
                got = attn_res_glue(owner, "res", partial, add, blocks, EPS, BlockCache(), norm)
                with threads(1):
                    one = attn_res_glue(owner, "res", partial, add, blocks, EPS, BlockCache(), norm)
                alone = [attn_res_glue(owner, "res", partial[t : t + 1], None if add is None else add[t : t + 1],
                                       [b[t : t + 1] for b in blocks], EPS, BlockCache(), norm) for t in range(T)]
            finally:
                fused_decode.attn_res_glue = real
            want = separate(owner, norm, partial, add, blocks)
        assert calls and all(calls)
        for g, o, w, k in zip(got, one, want, range(3)):
            assert torch.equal(g, w) and torch.equal(g, o), k
            assert torch.equal(g, torch.cat([r[k] for r in alone])), k
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        s64 = partial.double() + (add.double() if add is not None else 0)
        torch.testing.assert_close(got[0].double(), s64, rtol=tol, atol=tol)
        a64 = reference_attn_res(got[0], blocks, owner.res_norm.weight, owner.res_proj.weight, EPS)
        torch.testing.assert_close(got[1].double(), a64, rtol=tol, atol=tol)
        x = got[1].double()
        x64 = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
        torch.testing.assert_close(got[2].double(), x64, rtol=tol, atol=tol)


def test_glue_without_the_kernels_runs_the_separate_ops(monkeypatch):
    """TIDAL_CPU_KERNELS=0: no kernel, and the glue's torch form still matches float64."""
    owner, norm = owner_and_norm(torch.float32, seed=62)
    gen = torch.Generator().manual_seed(63)
    partial, add, blocks = rows(3, torch.float32, gen), rows(3, torch.float32, gen), [rows(3, torch.float32, gen)]
    cached = [fn for fn in vars(cpu_kernels).values() if hasattr(fn, "cache_clear")]
    try:
        monkeypatch.setenv("TIDAL_CPU_KERNELS", "0")
        for fn in cached:
            fn.cache_clear()
        assert fused_decode.attn_res_glue(partial, add, blocks, BlockCache(), torch.ones(D), EPS, norm.weight, 1e-5) is None
        with torch.inference_mode():
            total, a, x = attn_res_glue(owner, "res", partial, add, blocks, EPS, BlockCache(), norm)
    finally:
        monkeypatch.delenv("TIDAL_CPU_KERNELS")
        for fn in cached:
            fn.cache_clear()
    torch.testing.assert_close(total.double(), partial.double() + add.double())
    want = reference_attn_res(total, blocks, owner.res_norm.weight, owner.res_proj.weight, EPS)
    torch.testing.assert_close(a.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x, rms_norm(a.double(), norm.weight.double(), norm.eps).float(), rtol=1e-5, atol=1e-5)


def test_glue_declines_rows_it_does_not_take():
    """Mismatched dtypes, shapes or a norm weight of another width: None (the separate ops run)."""
    gen = torch.Generator().manual_seed(64)
    partial, add = rows(2, torch.float32, gen), rows(2, torch.float32, gen)
    w, q = torch.ones(D), torch.ones(D)
    assert fused_decode.attn_res_glue(partial, add.bfloat16(), [], BlockCache(), q, EPS, w, 1e-5) is None
    assert fused_decode.attn_res_glue(partial, add[:1], [], BlockCache(), q, EPS, w, 1e-5) is None
    assert fused_decode.attn_res_glue(partial, add, [], BlockCache(), q, EPS, torch.ones(D + 1), 1e-5) is None
    assert fused_decode.attn_res_glue(partial, add, [partial.double()], BlockCache(), q, EPS, w, 1e-5) is None
    assert fused_decode.attn_res_glue(partial, add, [], BlockCache(), q, EPS, w, 1e-5) is not None
