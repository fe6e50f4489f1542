"""MLA: absorbed vs expanded kernels, and the layer vs a per-head loop written from spec §2.1."""

from __future__ import annotations

import math

import pytest
import torch

import tidal.ops.mla as mla_ops
from tidal.model.context import SimpleCache, simple_batch
from tidal.model.mla import KimiMLA
from tidal.ops.mla import mla_absorbed_attention, mla_naive_attention, pad_latents
from tidal.presets import tiny_k3, tiny_kimi_linear

F64 = torch.float64
N_HEADS, D_NOPE, D_ROPE, D_V, RANK = 3, 8, 4, 6, 10
SCALE = (D_NOPE + D_ROPE) ** -0.5
CONFIGS = {"k3": tiny_k3, "kimi_linear": tiny_kimi_linear}


def kernel_inputs(gen: torch.Generator, batch: int, queries: int, length: int):
    q_nope = torch.randn(batch, queries, N_HEADS, D_NOPE, dtype=F64, generator=gen) * 2
    q_pe = torch.randn(batch, queries, N_HEADS, D_ROPE, dtype=F64, generator=gen) * 2
    latents = torch.randn(batch, length, RANK + D_ROPE, dtype=F64, generator=gen)
    w = torch.randn(N_HEADS * (D_NOPE + D_V), RANK, dtype=F64, generator=gen) / math.sqrt(RANK)
    return q_nope, q_pe, latents, w


# ---- kernels ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("length", "queries"), [(1, 1), (2, 1), (7, 1), (33, 1), (3, 3), (7, 3), (33, 5)])
def test_absorbed_matches_naive(length: int, queries: int) -> None:
    gen = torch.Generator().manual_seed(length * 10 + queries)
    q_nope, q_pe, latents, w = kernel_inputs(gen, 1, queries, length)
    naive = mla_naive_attention(q_nope[0], q_pe[0], latents[0], w, SCALE)
    absorbed = mla_absorbed_attention(q_nope, q_pe, latents, torch.tensor([length]), w, SCALE)
    torch.testing.assert_close(absorbed[0], naive, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("queries", [1, 2, 4])
def test_absorbed_batch_of_different_lengths(queries: int) -> None:
    """One padded call over sequences of different lengths == each sequence through the naive kernel."""
    gen = torch.Generator().manual_seed(7 + queries)
    lengths = [5, 17, queries, 11]
    q_nope, q_pe, _, w = kernel_inputs(gen, len(lengths), queries, 1)
    rows = [torch.randn(n, RANK + D_ROPE, dtype=F64, generator=gen) for n in lengths]
    padded, lens = pad_latents(rows)
    # Garbage in the padding must not leak into any output.
    for b, n in enumerate(lengths):
        padded[b, n:] = 1e3
    absorbed = mla_absorbed_attention(q_nope, q_pe, padded, lens, w, SCALE)
    for b, n in enumerate(lengths):
        naive = mla_naive_attention(q_nope[b], q_pe[b], rows[b], w, SCALE)
        torch.testing.assert_close(absorbed[b], naive, rtol=1e-10, atol=1e-10)


def test_naive_query_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A score budget that forces query chunks (and a ragged last chunk) changes nothing."""
    gen = torch.Generator().manual_seed(3)
    q_nope, q_pe, latents, w = kernel_inputs(gen, 1, 9, 14)
    whole = mla_naive_attention(q_nope[0], q_pe[0], latents[0], w, SCALE)
    monkeypatch.setattr(mla_ops, "NAIVE_SCORE_BUDGET", N_HEADS * 14 * 2)
    chunked = mla_naive_attention(q_nope[0], q_pe[0], latents[0], w, SCALE)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)


def test_kernels_causal() -> None:
    """Changing a latent after a query's position leaves that query's output unchanged."""
    gen = torch.Generator().manual_seed(5)
    q_nope, q_pe, latents, w = kernel_inputs(gen, 1, 4, 6)
    base = mla_naive_attention(q_nope[0], q_pe[0], latents[0], w, SCALE)
    changed = latents.clone()
    changed[0, 4] += 1.0  # position 4 = query 2 (queries sit at 2..5)
    naive = mla_naive_attention(q_nope[0], q_pe[0], changed[0], w, SCALE)
    absorbed = mla_absorbed_attention(q_nope, q_pe, changed, torch.tensor([6]), w, SCALE)[0]
    torch.testing.assert_close(naive[:2], base[:2], rtol=0, atol=0)
    assert not torch.allclose(naive[2:], base[2:])
    torch.testing.assert_close(absorbed, naive, rtol=1e-10, atol=1e-10)


# ---- the layer -------------------------------------------------------------------------------


def make_layer(name: str, seed: int, dtype: torch.dtype = F64) -> KimiMLA:
    config = CONFIGS[name]()
    layer = KimiMLA(config, mla_index=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in layer.named_parameters():
            if pname.endswith("layernorm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 1.5 / math.sqrt(p.shape[1]))
    return layer.to(dtype)


def reference_mla(layer: KimiMLA, x: torch.Tensor) -> torch.Tensor:
    """Spec §2.1 for one sequence starting at position 0, head by head with an explicit mask."""
    cfg = layer.config
    p = dict(layer.named_parameters())
    eps = cfg.rms_norm_eps
    n, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                        cfg.v_head_dim, cfg.kv_lora_rank)

    def rms(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * weight

    if cfg.q_lora_rank is None:
        q = x @ p["q_proj.weight"].T
    else:
        q = rms(x @ p["q_a_proj.weight"].T, p["q_a_layernorm.weight"]) @ p["q_b_proj.weight"].T
    kv_a = x @ p["kv_a_proj_with_mqa.weight"].T
    c = rms(kv_a[:, :r], p["kv_a_layernorm.weight"])
    k_pe = kv_a[:, r:]
    kv = c @ p["kv_b_proj.weight"].T
    T = x.shape[0]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    heads = []
    for h in range(n):
        q_h = q[:, h * (dn + dr):(h + 1) * (dn + dr)]
        kv_h = kv[:, h * (dn + dv):(h + 1) * (dn + dv)]
        k_h = torch.cat([kv_h[:, :dn], k_pe], dim=-1)  # q_pe . k_pe enters unrotated (NoPE)
        v_h = kv_h[:, dn:]
        scores = (q_h @ k_h.T) / math.sqrt(dn + dr)
        scores = torch.where(causal, scores, torch.tensor(float("-inf"), dtype=x.dtype))
        heads.append(torch.softmax(scores, dim=-1) @ v_h)
    out = torch.cat(heads, dim=-1)
    if cfg.mla_use_output_gate:
        out = out * torch.sigmoid(x @ p["g_proj.weight"].T)
    return out @ p["o_proj.weight"].T


def run_steps(layer: KimiMLA, seqs: list[torch.Tensor], steps: list[list[int]]) -> list[torch.Tensor]:
    """Feed the sequences' tokens in steps (steps[i][b] new tokens of sequence b); per-sequence outputs."""
    cache = SimpleCache(layer.config, len(seqs), dtype=seqs[0].dtype)
    done = [0] * len(seqs)
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for query_lens in steps:
        batch = simple_batch(layer.config, query_lens, cache, cached_lens=list(done))
        x = torch.cat([s[done[b]:done[b] + q] for b, (s, q) in enumerate(zip(seqs, query_lens))])
        y = layer(x, batch)
        for b, q in enumerate(query_lens):
            outs[b].append(y[batch.token_slice(b)])
            done[b] += q
    for b, s in enumerate(seqs):
        assert done[b] == s.shape[0]
        assert cache.mla_read(0, b).shape == (s.shape[0], layer.config.mla_cache_width)
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_matches_reference_loop(name: str) -> None:
    layer = make_layer(name, seed=1)
    x = torch.randn(13, layer.config.hidden_size, dtype=F64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        (y,) = run_steps(layer, [x], [[13]])
        ref = reference_mla(layer, x)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    assert ref.std() > 0.1  # the test inputs make attention and the output non-trivial


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_prefill_chunked_decode_agree(name: str) -> None:
    layer = make_layer(name, seed=3)
    N = 12
    x = torch.randn(N, layer.config.hidden_size, dtype=F64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        (whole,) = run_steps(layer, [x], [[N]])
        (chunked,) = run_steps(layer, [x], [[5], [1], [4], [2]])
        (decoded,) = run_steps(layer, [x], [[1]] * N)
        ref = reference_mla(layer, x)
    torch.testing.assert_close(whole, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(chunked, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(decoded, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_varlen_batch_matches_each_alone(name: str) -> None:
    """One step mixing a fresh prefill, decodes at different depths, a chunk and an idle sequence."""
    layer = make_layer(name, seed=5)
    gen = torch.Generator().manual_seed(6)
    history = [0, 5, 4, 9, 1, 3]
    step = [6, 1, 3, 1, 1, 0]
    seqs = [torch.randn(h + q, layer.config.hidden_size, dtype=F64, generator=gen) for h, q in zip(history, step)]
    with torch.no_grad():
        together = run_steps(layer, seqs, [history, step])
        for b, s in enumerate(seqs):
            (alone,) = run_steps(layer, [s], [[s.shape[0]]])
            torch.testing.assert_close(together[b], alone, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(together[b], reference_mla(layer, s), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_float32_close_to_float64(name: str) -> None:
    layer64 = make_layer(name, seed=7)
    layer32 = make_layer(name, seed=7, dtype=torch.float32)
    x = torch.randn(10, layer64.config.hidden_size, dtype=F64, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        (y64,) = run_steps(layer64, [x], [[6], [1], [3]])
        (y32,) = run_steps(layer32, [x.float()], [[6], [1], [3]])
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32.double(), y64, rtol=1e-4, atol=1e-4)
