"""The bf16 trunk's product (tidal.ops.dense, csrc/bf16_gemm.c) against float64 on fresh random
inputs at one, few and many rows (every tile shape, K and N tails, several row blocks), its row
independence, and where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.ops import cpu_kernels, dense


@pytest.fixture()
def kernel():
    k = cpu_kernels.bf16_gemm_kernel()
    if k is None:
        pytest.skip("no C compiler here: torch's F.linear runs")
    return k


@pytest.mark.parametrize("n,N,K", [(1, 7, 32), (1, 65, 768), (2, 13, 9), (3, 130, 100), (8, 33, 1), (5, 96, 64),
                                   (37, 101, 200), (150, 50, 2000)])
def test_kernel_matches_float64(kernel, n, N, K):
    gen = torch.Generator().manual_seed(n * N + K)
    x = torch.randn(n, K, generator=gen).bfloat16()
    w = torch.randn(N, K, generator=gen).bfloat16()
    ref = x.double() @ w.double().t()
    bound = 1e-6 * K * (x.double().abs() @ w.double().abs().t()) + 1e-30
    out = kernel(x, w)
    assert out.dtype == torch.float32 and bool(((out.double() - ref).abs() <= bound).all())
    got = dense.linear(x, w)
    assert got.dtype == torch.bfloat16 and torch.equal(got, out.bfloat16())


def test_row_alone_equals_row_in_a_batch_bitwise(kernel):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(70, 203, generator=gen).bfloat16()
    w = torch.randn(90, 400, generator=gen).bfloat16()[:, :203]  # a strided weight (rows contiguous)
    batch = kernel(x, w)
    for t in range(7):
        assert torch.equal(kernel(x[t : t + 1], w)[0], batch[t])
    # every tile height and row-block cut: the first rows of any batch size are the same bits
    for n in (2, 3, 4, 5, 9, 33):
        assert torch.equal(kernel(x[:n], w), batch[:n])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)  # the other thread count: the same bits
    try:
        assert torch.equal(kernel(x, w), batch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("N,K", [(384, 768), (2048, 768)])  # one row below and above the kernel's parallel cut
def test_one_row_has_the_same_bits_on_one_and_two_threads(kernel, N, K):
    gen = torch.Generator().manual_seed(N + K)
    x, w = torch.randn(1, K, generator=gen), torch.randn(N, K, generator=gen).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x, w)
        torch.set_num_threads(2)
        assert torch.equal(kernel(x, w), one)
    finally:
        torch.set_num_threads(threads)


def test_bf16_rows_take_the_kernel_at_every_count(monkeypatch):
    """(With torch's matmul for many rows off: tests/test_bf16_blas.py covers that one.)"""
    monkeypatch.setenv("TIDAL_BF16_BLAS_MIN_ROWS", "0")
    calls = []
    real = cpu_kernels.bf16_rows_kernel()
    if real is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(dense, "bf16_rows_kernel", lambda: lambda x, w: calls.append(x.shape) or real(x, w))
    w = torch.randn(16, 64).bfloat16()
    for x in (torch.randn(2, 64).bfloat16(), torch.randn(20, 64).bfloat16(), torch.randn(2, 64)):
        torch.testing.assert_close(dense.linear(x, w.to(x.dtype)), F.linear(x, w.to(x.dtype)), rtol=2e-2, atol=2e-2)
    assert calls == [torch.Size([2, 64]), torch.Size([20, 64])]


@pytest.mark.parametrize("rows", [2, 3, 5, 16, 17])
def test_float32_few_rows_against_a_large_weight(rows):
    """Few float32 rows times a large input-major weight (an LM head): every row equals its batch-1
    product bitwise (they run row by row), and the result matches float64."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(dense.ROW_BY_ROW_MIN_WEIGHT // 128, 128, generator=gen).t().contiguous().t()  # input-major
    x = torch.randn(rows, 128, generator=gen)
    got = dense.linear(x, w)
    ref = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and torch.allclose(got.double(), ref, rtol=0, atol=1e-4)
    alone = torch.cat([F.linear(x[i : i + 1], w) for i in range(rows)])
    assert dense._few_rows(x, w) == (rows <= dense.ROW_BY_ROW_MAX_ROWS)
    if rows <= dense.ROW_BY_ROW_MAX_ROWS:
        assert torch.equal(got, alone)
    assert torch.equal(dense.linear(x[None], w)[0], got)  # leading dims are flattened the same way
    assert not dense._few_rows(x, w.contiguous())  # output-major: torch's product


def test_float32_rows_times_a_bf16_weight(kernel):
    """The DSPARK drafter's products: float32 rows, a bf16 weight, a float32 result from the C
    kernel, matching float64; leading dims flattened."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 200, generator=gen)
    w = torch.randn(70, 200, generator=gen).bfloat16()
    got = dense.linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 70)
    assert torch.equal(got.reshape(6, 70), kernel(x.reshape(6, 200), w))
    ref = x.double() @ w.double().t()
    assert torch.allclose(got.double(), ref, rtol=0, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 3, 4, 9, 130])
def test_parts_product_has_the_concatenated_weights_bits(kernel, rows):
    """linear_parts(x, ws) == linear(x, cat(ws)) bit for bit (float32 and bf16 rows, parts of odd
    sizes, strided parts, 1 and 2 threads), against float64 within rounding; without the C kernel,
    past 8 parts or under batch invariance, each part's product concatenated."""
    gen = torch.Generator().manual_seed(rows)
    K, sizes = 203, [48, 7, 130, 1, 50, 3]
    base = torch.randn(sum(sizes) + 9, K + 5, generator=gen).bfloat16()
    ws, at = [], 0
    for n in sizes:
        ws.append(base[at:at + n, 2:K + 2])  # rows contiguous, row stride K + 5
        at += n
    threads = torch.get_num_threads()
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, K, generator=gen).to(dtype)
        want = dense.linear(x, torch.cat(ws))
        ref = x.double() @ torch.cat(ws).double().t()
        assert torch.allclose(want.double(), ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            try:
                assert torch.equal(dense.linear_parts(x, ws), want), (dtype, n_threads)
            finally:
                torch.set_num_threads(threads)
        assert torch.equal(dense.linear_parts(x.unsqueeze(0), ws)[0], want)
    x = torch.randn(rows, K, generator=gen)
    many = ws + ws[:3]  # 9 parts: past the kernel's limit, product by product
    assert torch.equal(dense.linear_parts(x, many), dense.linear(x, torch.cat(many)))


def test_prepared_parts_give_the_bits_of_the_list(kernel):
    """weight_parts(ws), built once, in place of the list: the same bits, rows of either dtype;
    weights the kernel does not take have no prepared form."""
    gen = torch.Generator().manual_seed(7)
    ws = [torch.randn(n, 96, generator=gen).bfloat16() for n in (40, 9, 33)]
    prepared = dense.weight_parts(ws)
    assert prepared is not None and prepared.total == 82
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 96, generator=gen).to(dtype)
        assert torch.equal(dense.linear_parts(x, prepared), dense.linear_parts(x, ws))
        assert torch.equal(dense.linear_parts(x, prepared), dense.linear(x, torch.cat(ws)))
    assert dense.weight_parts([w.float() for w in ws]) is None
    assert dense.weight_parts(ws[:1]) is None
    assert dense.weight_parts([ws[0], torch.randn(4, 95).bfloat16()]) is None


def test_parts_product_declines_what_the_kernel_does_not_take(monkeypatch):
    calls = []
    monkeypatch.setattr(dense, "bf16_parts_kernel", lambda: calls.append(1) or None)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 16, generator=gen)
    for ws in ([torch.randn(4, 16, generator=gen), torch.randn(5, 16, generator=gen)],  # float32 weights
               [torch.randn(4, 16, generator=gen).half(), torch.randn(5, 16, generator=gen).half()]):
        assert torch.equal(dense.linear_parts(x.to(ws[0].dtype), ws),
                           torch.cat([dense.linear(x.to(ws[0].dtype), w) for w in ws], dim=-1))
    assert not calls
    bf = [torch.randn(4, 16, generator=gen).bfloat16(), torch.randn(5, 16, generator=gen).bfloat16()]
    got = dense.linear_parts(x, bf)  # the kernel "unavailable": each part's product
    assert calls and torch.equal(got, torch.cat([dense.linear(x, w) for w in bf], dim=-1))


@pytest.mark.parametrize("rows", [1, 2, 7, 16])
def test_float32_few_rows_against_a_bf16_valued_large_weight(kernel, rows):
    """An LM head loaded from a bf16 checkpoint in float32 (input-major): its few-row products run on
    the exact bf16 copy in the C kernel, every row bitwise its batch-1 result (a verified chain's
    logits are the decode's), matching float64; a write to the weight makes a new copy, and a
    weight with a value bf16 cannot hold keeps the row-by-row product."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(dense.ROW_BY_ROW_MIN_WEIGHT // 128, 128, generator=gen).bfloat16().float().t().contiguous().t()
    x = torch.randn(rows, 128, generator=gen)
    got = dense.linear(x, w)
    assert torch.equal(got, kernel(x, w.to(torch.bfloat16).contiguous()))
    assert torch.allclose(got.double(), x.double() @ w.double().t(), rtol=0, atol=1e-4)
    assert all(torch.equal(got[i], dense.linear(x[i : i + 1], w)[0]) for i in range(rows))
    with torch.no_grad():
        w.mul_(2.0)  # still bf16 values
    assert torch.equal(dense.linear(x, w), 2 * got)
    with torch.no_grad():
        w[0, 0] = 1.0 + 2.0 ** -20  # not a bf16 value
    assert dense.bf16_twin(w) is None
    assert torch.equal(dense.linear(x, w), torch.cat([F.linear(x[i : i + 1], w) for i in range(rows)]))
