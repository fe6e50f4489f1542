"""A bfloat16 MLA layer's decode step over the engine's pages in one C call (csrc/mla_layer_decode.c
through tidal.ops.fused_decode.mla_layer_step): the output and the written latents have the bits
of the separate calls, a sequence's bits do not depend on the others or the thread count, and both
match the float64 layer within the bfloat16 roundings the model holds; the MLA output gate's C
kernel matches float64 too."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tidal.cache.pool import MemoryPool
from tidal.model.context import ForwardBatch
from tidal.model.mla import KimiMLA
from tidal.ops import cpu_kernels, fused_decode
from tidal.plan import pool_layout
from tidal.presets import tiny_k3

from test_fused_decode import threads


@pytest.fixture(autouse=True)
def kernels_built():
    if cpu_kernels.mla_layer_step_kernel() is None or cpu_kernels.sigmoid_gate_kernel() is None:
        pytest.skip("no C compiler here: the separate calls run")


def bf16_mla(config, seed: int) -> KimiMLA:
    torch.manual_seed(seed)
    mla = KimiMLA(config, 0)
    with torch.no_grad():
        for name, p in mla.named_parameters():
            p.data.normal_(0.0, 2.0 * p.shape[-1] ** -0.5)
            if name.endswith("layernorm.weight"):
                p.data.add_(1.0)
            p.data = p.data.bfloat16()
    return mla


class Pages:
    """A bfloat16 pool whose pages hold random latents, with sequences of the given cached lengths."""

    def __init__(self, config, cached: list[int], seed: int) -> None:
        layout = pool_layout(config, 1 << 22, page_size=4, kv_dtype_bytes=2, conv_dtype_bytes=2)
        self.pool = MemoryPool(config, layout, torch.bfloat16)
        self.owners, self.cached = [f"s{i}" for i in range(len(cached))], cached
        for o, c in zip(self.owners, cached):
            assert self.pool.alloc_state(o) and self.pool.reserve(o, c + 1)
        pages = self.pool.storage.latent_pages(0)
        pages.copy_(torch.randn(pages.shape, generator=torch.Generator().manual_seed(seed)).bfloat16())
        self.initial = pages.clone()

    def batch(self, seqs: list[int]) -> ForwardBatch:
        owners, cached = [self.owners[b] for b in seqs], [self.cached[b] for b in seqs]
        return ForwardBatch(query_lens=[1] * len(seqs), cached_lens=cached,
                            cache=self.pool.cache_view(owners, [1] * len(seqs), cached))

    def pages(self) -> torch.Tensor:
        return self.pool.storage.latent_pages(0)

    def reset(self) -> None:
        self.pages().copy_(self.initial)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return bf16(x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double())


def reference_layer(mla: KimiMLA, x: torch.Tensor, contexts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """KimiMLA.forward of a decode step in float64 (bfloat16 where the model holds it): x [T, d], the
    rows each sequence had before -> (out [T, d], the new latents [T, r + d_rope])."""
    c = mla.config
    n, dn, dr, dv, r = mla.num_heads, mla.qk_nope, mla.qk_rope, mla.v_dim, mla.kv_lora_rank
    xd = x.double()
    if c.q_lora_rank is None:
        q = bf16(xd @ mla.q_proj.weight.double().t()).view(-1, n, dn + dr)
    else:
        q_a = rms(bf16(xd @ mla.q_a_proj.weight.double().t()), mla.q_a_layernorm.weight, mla.q_a_layernorm.eps)
        q = bf16(q_a @ mla.q_b_proj.weight.double().t()).view(-1, n, dn + dr)
    kv = bf16(xd @ mla.kv_a_proj_with_mqa.weight.double().t())
    latent = torch.cat([rms(kv[:, :r], mla.kv_a_layernorm.weight, mla.kv_a_layernorm.eps), kv[:, r:]], dim=-1)
    w = mla.kv_b_proj.weight.double().view(n, dn + dv, r)
    outs = []
    for t, ctx in enumerate(contexts):
        rows = torch.cat([ctx.double(), latent[t : t + 1]])  # [L, r + dr]
        o = []
        for h in range(n):
            k = rows[:, :r] @ w[h, :dn].t()  # [L, dn]
            s = (k @ q[t, h, :dn] + rows[:, r:] @ q[t, h, dn:]) * mla.scale
            o.append(w[h, dn:] @ (torch.softmax(s, 0) @ rows[:, :r]))
        outs.append(bf16(torch.cat(o)))
    out = torch.stack(outs)
    if c.mla_use_output_gate:
        out = bf16(out * torch.sigmoid(bf16(xd @ mla.g_proj.weight.double().t())))
    return out @ mla.o_proj.weight.double().t(), latent


def contexts_of(pages: Pages, seqs: list[int]) -> list[torch.Tensor]:
    """Each sequence's cached rows as the pool holds them (before the step writes its new one)."""
    view = pages.batch(seqs).cache
    return [view.mla_read(0, i)[: pages.cached[b]] for i, b in enumerate(seqs)]


def wide_config():
    """An MLA layer whose input projections reach the parts product's threaded size at 4 rows."""
    return replace(tiny_k3(hidden_size=512), num_attention_heads=4, q_lora_rank=128, kv_lora_rank=128,
                   qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)


CONFIGS = {
    "gated": lambda: tiny_k3(),
    "ungated": lambda: replace(tiny_k3(), mla_use_output_gate=False),
    "no_q_lora": lambda: replace(tiny_k3(), q_lora_rank=None),
    "wide": wide_config,
}


def count_calls(monkeypatch, name: str = "mla_layer_step") -> list[bool]:
    """Record, for each call of fused_decode's ``name``, whether the one call ran."""
    calls: list[bool] = []
    real = getattr(fused_decode, name)

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fused_decode, name, counted)
    return calls


@pytest.mark.parametrize("amx", [0, 1])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_mla_layer_step_has_the_bits_of_the_separate_calls_and_matches_float64(monkeypatch, name, amx):
    """Decode steps of 1 and 4 sequences (cached 0 to 9 rows, over page boundaries) on fresh random
    pages and rows: the one call's output and written latents == the separate calls', a sequence
    alone == in the batch and 1 thread == 2, bitwise; the float64 layer within bf16 roundings. The
    bf16 products on the FMA tiles (amx 0) and on the AMX tiles at every row count (amx 1)."""
    with cpu_kernels.amx_rows(amx) as in_force:
        if in_force != amx:
            pytest.skip("no AMX-BF16 tiles on this CPU")
        mla_layer_step_against_separate_calls(monkeypatch, name)


def mla_layer_step_against_separate_calls(monkeypatch, name) -> None:
    config = CONFIGS[name]()
    mla = bf16_mla(config, seed=51)
    pages = Pages(config, [9, 0, 4, 7], seed=52)
    calls = count_calls(monkeypatch)
    gen = torch.Generator().manual_seed(53)
    for seqs in ([2], [0, 1, 2, 3]):
        x = torch.randn(len(seqs), config.hidden_size + 4, generator=gen).bfloat16()[:, 1 : 1 + config.hidden_size]
        contexts = contexts_of(pages, seqs)
        runs = {}
        with torch.inference_mode():
            for name, n_threads, off in (("two", 2, False), ("one", 1, False), ("separate", 2, True)):
                pages.reset()
                with threads(n_threads), monkeypatch.context() as m:
                    if off:
                        m.setattr(fused_decode, "mla_layer_step", lambda *a: None)
                    runs[name] = (mla(x, pages.batch(seqs)), pages.pages().clone())
            alone = []
            for i, b in enumerate(seqs):
                pages.reset()
                alone.append(mla(x[i : i + 1], pages.batch([b])))
        assert calls and all(calls)
        got, written = runs["two"]
        for name in ("one", "separate"):
            assert torch.equal(got, runs[name][0]) and torch.equal(written, runs[name][1]), name
        assert torch.equal(got, torch.cat(alone))
        want, latents = reference_layer(mla, x, contexts)
        assert (got.double() - want).abs().max() / want.abs().max() < 0.01
        view = pages.batch(seqs).cache
        pages.pages().copy_(written)
        for i, b in enumerate(seqs):
            new_row = view.mla_read(0, i)[pages.cached[b]].double()
            assert (new_row - latents[i]).abs().max() / latents[i].abs().max() < 0.01


def test_mla_layer_step_declines_what_it_does_not_take(monkeypatch):
    config = tiny_k3()
    mla = bf16_mla(config, seed=54)
    pages = Pages(config, [3, 5], seed=55)
    plan = mla._step_plan()
    assert plan is not None and mla._step_plan() is plan
    batch = pages.batch([0, 1])
    pages_t, table, lengths = batch.cache.mla_pages(0, [0, 1])
    write = batch.cache.mla_write_rows()
    x = torch.randn(2, config.hidden_size).bfloat16()
    assert fused_decode.mla_layer_step(plan, x.float(), pages_t, table, lengths, write) is None  # float32 rows
    assert fused_decode.mla_layer_step(plan, x[:1], pages_t, table, lengths, write) is None  # rows != sequences
    monkeypatch.setenv("TIDAL_FUSED_DECODE", "0")
    assert fused_decode.mla_layer_step(plan, x, pages_t, table, lengths, write) is None
    monkeypatch.delenv("TIDAL_FUSED_DECODE")
    float_mla = bf16_mla(config, seed=54).float()
    assert float_mla._step_plan() is None


def clear_kernel_caches() -> None:
    for fn in vars(cpu_kernels).values():
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


def test_kernels_off_the_layer_runs_its_torch_form(monkeypatch):
    """TIDAL_CPU_KERNELS=0: no plan, no gate kernel, and the layer's torch form still writes the
    latents and matches the float64 layer."""
    config = tiny_k3()
    mla = bf16_mla(config, seed=57)
    pages = Pages(config, [6, 2], seed=58)
    x = torch.randn(2, config.hidden_size, generator=torch.Generator().manual_seed(59)).bfloat16()
    contexts = contexts_of(pages, [0, 1])
    try:
        monkeypatch.setenv("TIDAL_CPU_KERNELS", "0")
        clear_kernel_caches()
        assert mla._step_plan() is None and fused_decode.sigmoid_gate(x, x) is None
        with torch.inference_mode():
            got = mla(x, pages.batch([0, 1]))
    finally:
        monkeypatch.delenv("TIDAL_CPU_KERNELS")
        clear_kernel_caches()
    want, latents = reference_layer(mla, x, contexts)
    assert (got.double() - want).abs().max() / want.abs().max() < 0.01
    view = pages.batch([0, 1]).cache
    for i in range(2):
        new_row = view.mla_read(0, i)[pages.cached[i]].double()
        assert (new_row - latents[i]).abs().max() / latents[i].abs().max() < 0.01


def test_sigmoid_gate_matches_float64_and_is_row_invariant():
    """o * sigmoid(g) of strided bf16 and float32 rows (a width no multiple of 8: the scalar tail too),
    across sigmoid's range, within float32 rounding of float64; a row alone == in the batch."""
    gen = torch.Generator().manual_seed(56)
    for dtype in (torch.float32, torch.bfloat16):
        base = torch.randn(7, 2 * 203 + 3, generator=gen) * 12
        o, g = base[:, 1:204].to(dtype), base[:, 205:408].to(dtype)
        got = fused_decode.sigmoid_gate(o, g)
        assert got is not None and got.dtype == dtype
        want = o.double() * torch.sigmoid(g.double())
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=tol, atol=tol * 1e-3)
        assert torch.equal(got, torch.cat([fused_decode.sigmoid_gate(o[i : i + 1], g[i : i + 1]) for i in range(7)]))
