"""The C decode kernel (tidal/ops/csrc/kda_decode.c) against the token-by-token float64 reference,
on states that sit in pool-like strided blocks; its batch and thread invariance; the fallback."""

from __future__ import annotations

import pytest
import torch

from tidal.ops import cpu_kernels
from tidal.ops.kda import kda_decode_step_, kda_gate, kda_recurrent, l2_normalize

H, K, V = 3, 32, 48


def decode_inputs(gen: torch.Generator, B: int, T: int, bound: float | None):
    q = l2_normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)) * K**-0.5
    k = l2_normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64))
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    z = 3 * torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    g = kda_gate(z, torch.zeros(H, 1, dtype=torch.float64), torch.zeros(H * K, dtype=torch.float64), bound)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    state = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, state


def pool_like(state: torch.Tensor, gap: int = 1000) -> torch.Tensor:
    """A float32 copy of state [B, H, K, V] inside a bigger buffer: sequence b's block starts
    H*K*V + gap floats after sequence b-1's (like consecutive blocks of the engine's pool)."""
    B = state.shape[0]
    buf = torch.full((B, H * K * V + gap), float("nan"))
    view = buf[:, :H * K * V].unflatten(1, (H, K, V))
    view.copy_(state)
    return view


@pytest.fixture()
def kernel():
    step = cpu_kernels.kda_decode_kernel()
    if step is None:
        pytest.skip("no C compiler here: the torch form runs (tested in test_kda.py)")
    return step


@pytest.mark.parametrize("bound", [-5.0, None])
def test_kernel_chain_matches_float64_reference(kernel, bound):
    """12 decode tokens through the kernel on strided float32 states == kda_recurrent in float64."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, g, beta, state = decode_inputs(gen, 5, 12, bound)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, state)
    s = pool_like(state)
    outs = [kernel(*(t[:, i].float() for t in (q, k, v, g, beta)), s) for i in range(12)]
    torch.testing.assert_close(torch.stack(outs, 1).double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-4, atol=1e-4)
    assert s.untyped_storage().nbytes() > s.numel() * 4  # it really was a strided view


def test_kernel_matches_torch_form_and_is_what_decode_step_runs(kernel):
    gen = torch.Generator().manual_seed(8)
    q, k, v, g, beta, state = (t.float() for t in decode_inputs(gen, 6, 1, -5.0))
    inputs = [t[:, 0] for t in (q, k, v, g, beta)]
    s_c, s_t, s_d = pool_like(state), pool_like(state), pool_like(state)
    o_c = kernel(*inputs, s_c)
    o_t = kda_decode_step_(*inputs, s_t, use_kernel=False)
    o_d = kda_decode_step_(*inputs, s_d)
    torch.testing.assert_close(o_c, o_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_c, s_t, rtol=1e-5, atol=1e-5)
    assert torch.equal(o_d, o_c) and torch.equal(s_d, s_c)


def test_kernel_is_bitwise_batch_and_thread_invariant(kernel):
    """Each (sequence, head) is one thread's fixed-order loop: alone == in a batch, 1 == 2 threads."""
    gen = torch.Generator().manual_seed(9)
    q, k, v, g, beta, state = (t.float() for t in decode_inputs(gen, 9, 1, None))
    inputs = [t[:, 0] for t in (q, k, v, g, beta)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        s_all = pool_like(state)
        o_all = kernel(*inputs, s_all)
        torch.set_num_threads(1)
        for b in (0, 4, 8):
            s_b = pool_like(state[b : b + 1])
            o_b = kernel(*(t[b : b + 1] for t in inputs), s_b)
            assert torch.equal(o_b[0], o_all[b]) and torch.equal(s_b[0], s_all[b])
    finally:
        torch.set_num_threads(threads)


def test_fallback_when_disabled_or_the_build_fails(monkeypatch, tmp_path):
    state = torch.zeros(2, H, K, V)
    try:
        for env in ({"TIDAL_CPU_KERNELS": "0"}, {"CC": "/bin/false", "TIDAL_CACHE_DIR": str(tmp_path)}):
            cpu_kernels._library.cache_clear()
            cpu_kernels.kda_decode_kernel.cache_clear()
            with monkeypatch.context() as m:
                for name, value in env.items():
                    m.setenv(name, value)
                assert cpu_kernels.kda_decode_for(state) is None
                q = torch.randn(2, H, K)
                o = kda_decode_step_(q, q, torch.randn(2, H, V), -torch.rand(2, H, K), torch.rand(2, H), state)
                assert o.shape == (2, H, V) and torch.isfinite(o).all()
    finally:
        cpu_kernels._library.cache_clear()
        cpu_kernels.kda_decode_kernel.cache_clear()
    assert cpu_kernels.kda_decode_for(torch.zeros(2, H, K, V, dtype=torch.float64)) is None


# ---- paged MLA decode ----------------------------------------------------------------------------

N_HEADS, D_NOPE, D_ROPE, D_V, RANK, PAGE = 3, 16, 8, 12, 20, 4


def paged_case(gen: torch.Generator, lengths: list[int], dtype: torch.dtype):
    """Latents of len(lengths) sequences scattered over the pages of a pool-like buffer (pages of
    other layers interleaved), the page tables (padded with page 0) and decode queries."""
    C = RANK + D_ROPE
    num_pages = sum(-(-n // PAGE) for n in lengths) + 5
    store = torch.full((num_pages, 2, PAGE, C), float("nan"), dtype=dtype)  # 2 layers; we read layer 1
    pages = store[:, 1]
    free = torch.randperm(num_pages, generator=gen).tolist()
    tables, rows = [], []
    for n in lengths:
        table = [free.pop() for _ in range(-(-n // PAGE))]
        seq = torch.randn(n, C, generator=gen).to(dtype)
        for i, p in enumerate(table):
            part = seq[i * PAGE : (i + 1) * PAGE]
            pages[p, : len(part)] = part
        tables.append(table)
        rows.append(seq)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q_nope = torch.randn(len(lengths), N_HEADS, D_NOPE, generator=gen)
    q_pe = torch.randn(len(lengths), N_HEADS, D_ROPE, generator=gen)
    kv_b = torch.randn(N_HEADS * (D_NOPE + D_V), RANK, generator=gen) * 0.3
    return pages, table, torch.tensor(lengths), rows, q_nope, q_pe, kv_b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_mla_decode_matches_float64_reference(dtype):
    from tidal.ops.mla import mla_absorbed_attention, mla_paged_decode, pad_latents

    if cpu_kernels.mla_decode_kernel() is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(10)
    lengths = [1, 7, 4, 13, 30]
    pages, table, lens, rows, q_nope, q_pe, kv_b = paged_case(gen, lengths, dtype)
    assert cpu_kernels.mla_decode_for(pages, torch.zeros(1, 1, pages.shape[-1])) is not None
    got = mla_paged_decode(q_nope, q_pe, pages, table, lens, kv_b, 0.3)
    latents, _ = pad_latents([r.double() for r in rows])
    want = mla_absorbed_attention(q_nope[:, None].double(), q_pe[:, None].double(), latents, lens, kv_b.double(), 0.3)
    torch.testing.assert_close(got.double(), want[:, 0], rtol=1e-4, atol=1e-4)
    # the gather fallback (what runs without a compiler) gives the same
    cpu_kernels.mla_decode_kernel.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(cpu_kernels, "mla_decode_kernel", lambda: None)
            m.setenv("TIDAL_FUSED_DECODE", "0")  # nor the absorbed kernel (csrc/mla_decode.c)
            fallback = mla_paged_decode(q_nope, q_pe, pages, table, lens, kv_b, 0.3)
    finally:
        cpu_kernels.mla_decode_kernel.cache_clear()
    torch.testing.assert_close(fallback, got, rtol=1e-4, atol=1e-4)


def test_paged_mla_kernel_is_bitwise_batch_and_thread_invariant():
    """One thread per sequence, fixed order: alone == in a batch, 1 thread == 2 threads."""
    attend = cpu_kernels.mla_decode_kernel()
    if attend is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(11)
    pages, table, lens, _, _, _, _ = paged_case(gen, [9, 2, 17, 5], torch.float32)
    query = torch.randn(4, N_HEADS, pages.shape[-1], generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = attend(pages, table, lens, query, RANK, 0.5)
        torch.set_num_threads(1)
        for b in range(4):
            alone = attend(pages, table[b : b + 1], lens[b : b + 1], query[b : b + 1], RANK, 0.5)
            assert torch.equal(alone[0], together[b])
    finally:
        torch.set_num_threads(threads)


def absorbed_case(gen: torch.Generator, lengths: list[int], dtype: torch.dtype):
    """paged_case in ``dtype`` throughout, the queries as views of one projection row (q_nope and
    q_pe interleaved per head, as MLA.forward splits them)."""
    pages, table, lens, rows, _, _, kv_b = paged_case(gen, lengths, dtype)
    q = torch.randn(len(lengths), N_HEADS, D_NOPE + D_ROPE, generator=gen).to(dtype)
    q_nope, q_pe = q.split([D_NOPE, D_ROPE], dim=-1)
    return pages, table, lens, rows, q_nope, q_pe, kv_b.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_mla_decode_reads_kv_b_in_place_and_matches_float64(dtype):
    """The whole absorbed decode in C (query absorption, paged attention, output absorption) with
    kv_b_proj's weight in its own dtype: == the float64 reference within the rounding of its dtype,
    and == the torch path (kernel off) within float32 rounding."""
    from tidal.ops.mla import mla_absorbed_attention, mla_paged_decode, pad_latents

    if cpu_kernels.mla_absorbed_kernel() is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(13)
    lengths = [1, 7, 4, 13, 30]
    pages, table, lens, rows, q_nope, q_pe, kv_b = absorbed_case(gen, lengths, dtype)
    assert cpu_kernels.mla_absorbed_for(pages, q_nope, q_pe, kv_b) is not None
    got = mla_paged_decode(q_nope, q_pe, pages, table, lens, kv_b, 0.3)
    assert got.dtype == dtype and got.shape == (len(lengths), N_HEADS, D_V)
    latents, _ = pad_latents([r.double() for r in rows])
    want = mla_absorbed_attention(q_nope[:, None].double(), q_pe[:, None].double(), latents, lens, kv_b.double(),
                                  0.3)[:, 0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TIDAL_FUSED_DECODE", "0")
        assert cpu_kernels.mla_absorbed_for(pages, q_nope, q_pe, kv_b) is None
        torch_path = mla_paged_decode(q_nope, q_pe, pages, table, lens, kv_b, 0.3)
    torch.testing.assert_close(got.double(), torch_path.double(), rtol=tol, atol=tol)


def test_absorbed_mla_decode_is_bitwise_batch_and_thread_invariant():
    decode = cpu_kernels.mla_absorbed_kernel()
    if decode is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(14)
    for dtype in (torch.float32, torch.bfloat16):
        pages, table, lens, _, q_nope, q_pe, kv_b = absorbed_case(gen, [9, 2, 17, 5, 1, 8, 3, 12], dtype)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            together = decode(q_nope, q_pe, pages, table, lens, kv_b, 0.5)
            torch.set_num_threads(1)
            for b in range(len(lens)):
                alone = decode(q_nope[b : b + 1], q_pe[b : b + 1], pages, table[b : b + 1], lens[b : b + 1], kv_b, 0.5)
                assert torch.equal(alone[0], together[b])
        finally:
            torch.set_num_threads(threads)


def test_absorbed_mla_decode_declines_what_it_does_not_cover():
    gen = torch.Generator().manual_seed(15)
    pages, _, _, _, q_nope, q_pe, kv_b = absorbed_case(gen, [3], torch.float32)
    assert cpu_kernels.mla_absorbed_for(pages.double(), q_nope, q_pe, kv_b) is None
    assert cpu_kernels.mla_absorbed_for(pages, q_nope.double(), q_pe.double(), kv_b) is None
    assert cpu_kernels.mla_absorbed_for(pages, q_nope, q_pe.to(torch.bfloat16), kv_b) is None
    assert cpu_kernels.mla_absorbed_for(pages, q_nope, q_pe, kv_b.t()) is None  # not contiguous
    assert cpu_kernels.mla_absorbed_for(pages, q_nope, q_pe, kv_b[:, :-1].contiguous()) is None  # rank != pages
    with torch.enable_grad():
        assert cpu_kernels.mla_absorbed_for(pages, q_nope.clone().requires_grad_(), q_pe, kv_b) is None


# ---- grouped few-rows matmul (routed experts at decode) ---------------------------------------------


def test_grouped_gemm_matches_float64_and_is_bitwise_row_invariant():
    gemm = cpu_kernels.grouped_gemm_kernel()
    if gemm is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(12)
    E, N, K = 6, 40, 70
    w = torch.randn(E, N, K + 3, generator=gen)[:, :, :K]  # rows contiguous, matrices strided
    w = w.contiguous() if w.stride()[1:] != (K, 1) else w
    experts, counts = [0, 2, 3, 5], [3, 1, 5, 2]
    x = torch.randn(sum(counts), K, generator=gen)
    offsets = torch.tensor([0, *counts]).cumsum(0)
    out = gemm(x, offsets, torch.tensor(experts), w)
    want = torch.cat([xs.double() @ w[e].double().t() for e, xs in zip(experts, x.split(counts))])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    # a row alone (its expert's group of one) gives the same bits as inside the batch
    for row, e in [(0, 0), (3, 2), (8, 3), (10, 5)]:
        alone = gemm(x[row : row + 1], torch.tensor([0, 1]), torch.tensor([e]), w)
        assert torch.equal(alone[0], out[row])


def test_experts_use_the_grouped_kernel_at_decode_and_match_the_torch_path(monkeypatch):
    from tidal.model import moe
    from tidal.presets import tiny_kimi_linear

    if cpu_kernels.grouped_gemm_kernel() is None:
        pytest.skip("no C compiler here")
    config = tiny_kimi_linear()
    torch.manual_seed(0)
    layer = moe.Experts(config)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    layer.fuse_weights()
    gen = torch.Generator().manual_seed(13)
    h = torch.randn(9, config.expert_hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(config.num_experts, generator=gen)[: config.num_experts_per_token]
                       for _ in range(9)])
    weights = torch.rand(9, config.num_experts_per_token, generator=gen)
    calls = []
    real = moe.grouped_gemm_for
    monkeypatch.setattr(moe, "grouped_gemm_for", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        fast = layer(h, ids, weights)
        one = layer(h[4:5], ids[4:5], weights[4:5])
        monkeypatch.setattr(moe, "grouped_gemm_for", lambda *a: None)
        slow = layer(h, ids, weights)
    assert calls and real(h, layer.w13, layer.w2) is None  # outside inference mode: autograd, torch path
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
    assert torch.equal(one[0], fast[4])  # a token alone == in the batch, bit for bit
