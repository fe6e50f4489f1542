"""Tiled MLA attention over pages (tidal.ops.mla_tiled) against the float64 reference kernels, and
its memory: a step's extra memory does not grow with the cached context, and a decode batch with
one long sequence reads no copy padded to it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tidal.cache.pool import MemoryPool
from tidal.model.context import ForwardBatch, SimpleCache, simple_batch
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.ops import mla_tiled
from tidal.ops.mla import mla_absorbed_attention, mla_naive_attention, pad_latents
from tidal.ops.mla_tiled import mla_tiled_attention, use_absorbed
from tidal.plan import pool_layout

ROOT = Path(__file__).resolve().parents[1]
N, DN, DR, DV, R, PS = 4, 16, 8, 16, 32, 4


def paged(gen, lengths, pages_total=160):
    """Pages full of NaN (what unused rows may hold) and each sequence's random rows in its own
    shuffled pages; the table pads short sequences with their first page."""
    pages = torch.full((pages_total, PS, R + DR), float("nan"))
    free = torch.randperm(pages_total, generator=gen).tolist()
    tables, rows = [], []
    for L in lengths:
        ids = [free.pop() for _ in range(-(-L // PS))]
        x = torch.randn(L, R + DR, generator=gen)
        flat = pages[ids].view(-1, R + DR)
        flat[:L] = x
        pages[ids] = flat.view(-1, PS, R + DR)
        tables.append(ids)
        rows.append(x)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + t[:1] * (width - len(t)) for t in tables])
    return pages, table, rows


@pytest.mark.parametrize("absorbed", [True, False])
@pytest.mark.parametrize("L,T", [(37, 37), (50, 5), (129, 64), (16, 16), (9, 1)])
def test_prefill_matches_float64_naive(monkeypatch, absorbed, L, T):
    gen = torch.Generator().manual_seed(L * 100 + T)
    pages, table, [rows] = paged(gen, [L])
    w = torch.randn(N * (DN + DV), R, generator=gen) * 0.2
    qn, qp = torch.randn(T, N, DN, generator=gen), torch.randn(T, N, DR, generator=gen)
    want = mla_naive_attention(qn.double(), qp.double(), rows.double(), w.double(), 0.3)
    monkeypatch.setattr(mla_tiled, "SCORE_BUDGET", N * 8 * 7)  # query blocks of 7 at tile 8
    for tile in (4, 8, 1024):
        got = mla_tiled_attention(qn[None], qp[None], pages, table, [L], w, 0.3, absorbed=absorbed, tile=tile)[0]
        assert got.isfinite().all()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_decode_batch_matches_float64_absorbed_reference():
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 70, 1, 33, 200, 4]
    pages, table, rows = paged(gen, lengths)
    w = torch.randn(N * (DN + DV), R, generator=gen) * 0.2
    qn, qp = torch.randn(6, 1, N, DN, generator=gen), torch.randn(6, 1, N, DR, generator=gen)
    latents, lens = pad_latents([r.double() for r in rows])
    want = mla_absorbed_attention(qn.double(), qp.double(), latents, lens, w.double(), 0.3)
    for tile in (4, 16, 1024):
        for absorbed in (True, False):
            got = mla_tiled_attention(qn, qp, pages, table, lengths, w, 0.3, tile=tile, absorbed=absorbed)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="whole number"):
        mla_tiled_attention(qn, qp, pages, table, lengths, w, 0.3, tile=6)


def test_absorbed_for_decode_expanded_for_long_chunks():
    assert use_absorbed(1, 512, 64, 128, 128) and not use_absorbed(2048, 512, 64, 128, 128)


def test_model_over_pool_pages_equals_naive_reference(monkeypatch):
    """The wide-MLA model prefilled over the pool in chunks (tiled kernel, several tiles) gives the
    logits of the same model over a SimpleCache (the naive reference)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_mla_memory import wide_mla_config

    config = wide_mla_config(max_len=4096)
    model = init_weights(KimiForCausalLM(config), seed=0).to_dtype(torch.float32).eval()
    monkeypatch.setattr(mla_tiled, "KEY_TILE_TOKENS", 32)
    layout = pool_layout(config, 1 << 26, page_size=16, kv_dtype_bytes=4, conv_dtype_bytes=4)
    pool = MemoryPool(config, layout, torch.float32)
    ids = torch.randint(0, config.vocab_size, (150,), generator=torch.Generator().manual_seed(2))
    assert pool.alloc_state("r") and pool.reserve("r", 150)
    ref_cache = SimpleCache(config, 1, torch.float32)
    got, want = [], []
    with torch.inference_mode():
        for c0, c1 in ((0, 70), (70, 150)):
            view = pool.cache_view(["r"], [c1 - c0], [c0])
            got.append(model.compute_logits(model(ids[c0:c1], ForwardBatch([c1 - c0], [c0], view))))
            want.append(model.compute_logits(model(ids[c0:c1], simple_batch(config, [c1 - c0], ref_cache, [c0]))))
    torch.testing.assert_close(torch.cat(got), torch.cat(want), rtol=1e-5, atol=1e-5)


def probe(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


DECODE_PROBE = """
import json, resource, torch
from tidal.ops.mla import mla_absorbed_attention, mla_paged_decode, gather_pages
torch.manual_seed(0)
n, dn, dr, dv, r, ps, long, short = 8, 64, 16, 64, 64, 16, 65536, 31
pages = torch.randn(long // ps + short, ps, r + dr).to(torch.bfloat16)
table = torch.zeros(1 + short, long // ps, dtype=torch.long)
table[0] = torch.arange(long // ps)
table[1:, 0] = torch.arange(long // ps, long // ps + short)
lengths = torch.tensor([long] + [ps] * short)
w = torch.randn(n * (dn + dv), r).to(torch.bfloat16)
qn, qp = torch.randn(1 + short, n, dn).to(torch.bfloat16), torch.randn(1 + short, n, dr).to(torch.bfloat16)
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = peak()
if KERNEL == "padded":
    out = mla_absorbed_attention(qn[:, None], qp[:, None], gather_pages(pages, table, lengths), lengths, w, 0.1)
else:
    out = mla_paged_decode(qn, qp, pages, table, lengths, w, 0.1)  # bf16: the torch path
print(json.dumps(dict(growth=peak() - base, padded=(1 + short) * long * (r + dr) * 4, pages=pages.numel() * 2)))
"""


def test_decode_of_one_long_and_many_short_reads_no_padded_copy():
    tiled = probe('KERNEL = "tiled"' + DECODE_PROBE)
    padded = probe('KERNEL = "padded"' + DECODE_PROBE)  # the reference: what the bound rules out
    bound = tiled["padded"] // 8
    assert padded["growth"] > bound, padded  # the probe sees a padded copy when there is one
    assert tiled["growth"] < bound, tiled


def test_prefill_chunk_memory_does_not_grow_with_the_context():
    """One 256-token chunk over 12k and over 24k cached tokens (wide MLA, fresh processes): peak
    memory grows by less than a few times the KV the extra 12k tokens hold, where expanding k/v
    over the context (the naive kernel) would add 12k x 8 heads x 128 x 4 B per MLA layer."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_mla_memory import measure

    small, large = measure(12288, chunk=256), measure(24576, chunk=256)
    extra_kv = large["context_kv_bytes"] - small["context_kv_bytes"]
    expansion = 12288 * 8 * 128 * 4
    assert expansion > 10 * extra_kv
    assert large["peak_rss_growth"] - small["peak_rss_growth"] < 4 * extra_kv + (8 << 20), (small, large)
