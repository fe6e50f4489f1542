"""KDA: chunked vs recurrent kernels, both vs flash-linear-attention's naive reference, the short
conv against F.conv1d, the gate against its scalar formula, and the layer against a per-head loop
written from spec §1 and against itself across prefill / chunked prefill / decode / varlen batches."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tidal.config import ModelConfig
from tidal.model.context import SimpleCache, simple_batch
from tidal.model.kda import KimiDeltaAttention
from tidal.ops import kda as kda_ops
from tidal.ops.kda import kda_chunked, kda_decode_step_, kda_gate, kda_recurrent, l2_normalize
from tidal.ops.short_conv import causal_conv, causal_conv_step
from tidal.presets import tiny_k3, tiny_k3_dict, tiny_kimi_linear

F64 = torch.float64
B, H, K, V = 2, 2, 16, 32
CONFIGS = {"k3": tiny_k3, "kimi_linear": tiny_kimi_linear}


def kernel_inputs(gen: torch.Generator, T: int, decay: str):
    """Normalised q (scaled) and k, values, gates of the given strength, beta, a non-zero state."""
    q = l2_normalize(torch.randn(B, T, H, K, dtype=F64, generator=gen)) * K**-0.5
    k = l2_normalize(torch.randn(B, T, H, K, dtype=F64, generator=gen))
    v = torch.randn(B, T, H, V, dtype=F64, generator=gen)
    z = torch.randn(B, T, H, K, dtype=F64, generator=gen)
    a_log = torch.randn(H, 1, dtype=F64, generator=gen) * 0.3
    dt_bias = torch.zeros(H * K, dtype=F64)
    if decay == "strong":  # K3 gate pushed against its -5 lower bound
        g = kda_gate(z + 8.0, a_log.abs(), dt_bias, -5.0)
        assert g.max() < -4.9
    elif decay == "mixed":  # K3 gate anywhere in (-5, 0)
        g = kda_gate(4.0 * z, a_log, dt_bias, -5.0)
    else:  # Kimi Linear softplus gate, mild
        g = kda_gate(z - 3.0, a_log, dt_bias, None)
    beta = torch.rand(B, T, H, dtype=F64, generator=gen)
    state = torch.randn(B, H, K, V, dtype=F64, generator=gen)
    return q, k, v, g, beta, state


def load_fla_naive():
    """fla's naive KDA module, loaded by file path (``import fla.ops.kda`` needs triton)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flash-linear-attention is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    if not path.exists():
        pytest.skip(f"{path} not found in this fla version")
    mod_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


# ---- kernels ---------------------------------------------------------------------------------


@pytest.mark.parametrize("decay", ["strong", "mixed", "mild"])
@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130, 200])
def test_chunked_matches_recurrent(T: int, decay: str) -> None:
    gen = torch.Generator().manual_seed(T * 7 + len(decay))
    q, k, v, g, beta, state = kernel_inputs(gen, T, decay)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, state)
    o, s = kda_chunked(q, k, v, g, beta, state)
    assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("chunk_size", [8, 16, 24, 128])
def test_chunked_other_chunk_sizes(chunk_size: int) -> None:
    gen = torch.Generator().manual_seed(chunk_size)
    q, k, v, g, beta, state = kernel_inputs(gen, 77, "mixed")
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, state)
    o, s = kda_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("chunk_size", [32, 24])
@pytest.mark.parametrize("floor", [-20.0, -50.0, -1000.0])
def test_chunked_extreme_decay(floor: float, chunk_size: int) -> None:
    """Per-channel decays down to `floor` per token (Kimi Linear's gate is unbounded), mixed with
    channels that barely decay: finite in float32 and equal to the recurrent kernel in float64."""
    gen = torch.Generator().manual_seed(int(-floor))
    q, k, v, _, beta, state = kernel_inputs(gen, 150, "mild")
    g = floor * torch.rand(B, 150, H, K, dtype=F64, generator=gen) ** 3  # most channels mild, some extreme
    g[..., : K // 4] = floor  # and a quarter of the channels at the floor on every token
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, state)
    o, s = kda_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-10)
    o32, s32 = kda_chunked(*(t.float() for t in (q, k, v, g, beta, state)), chunk_size=chunk_size)
    assert torch.isfinite(o32).all() and torch.isfinite(s32).all()
    torch.testing.assert_close(o32, o_ref.float(), rtol=0, atol=1e-4)
    torch.testing.assert_close(s32, s_ref.float(), rtol=0, atol=1e-4)


def pad_tokens(inputs: tuple[torch.Tensor, ...], extra: int) -> tuple[torch.Tensor, ...]:
    """Append `extra` padding tokens (q = k = v = 0, g = 0, beta = 0) to q, k, v, g, beta."""
    return tuple(torch.cat([t, t.new_zeros(t.shape[0], extra, *t.shape[2:])], dim=1) for t in inputs)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_chunked_zero_padding_changes_no_bit(dtype: torch.dtype) -> None:
    """Padding tokens after a sequence, inside its last chunk or as whole extra chunks, leave its
    outputs and final state bit-identical (what batching sequences of unequal lengths relies on)."""
    gen = torch.Generator().manual_seed(21)
    *inputs, state = (t.to(dtype) for t in kernel_inputs(gen, 45, "mixed"))
    o, s = kda_chunked(*inputs, state)
    for extra in (1, 19, 20, 64, 100):
        o_pad, s_pad = kda_chunked(*pad_tokens(tuple(inputs), extra), state)
        assert torch.equal(o_pad[:, :45], o) and torch.equal(s_pad, s), extra


def test_chunked_batch_equals_each_alone() -> None:
    """Sequences of unequal lengths zero-padded into one float32 call get exactly the bits of their
    own unpadded calls (one thread: the kernels' per-row arithmetic does not depend on the batch)."""
    gen = torch.Generator().manual_seed(22)
    lengths = [70, 17, 128, 33]
    seqs = [tuple(t.float() for t in kernel_inputs(gen, n, "mixed")) for n in lengths]  # each B = 2
    longest = max(lengths)
    padded = [pad_tokens(s[:5], longest - n) for s, n in zip(seqs, lengths)]
    batched = [torch.cat(parts) for parts in zip(*padded)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        o_all, s_all = kda_chunked(*batched, torch.cat([s[5] for s in seqs]))
        alone = [kda_chunked(*s) for s in seqs]
    finally:
        torch.set_num_threads(threads)
    for i, (n, (o, s)) in enumerate(zip(lengths, alone)):
        rows = slice(2 * i, 2 * i + 2)
        assert torch.equal(o_all[rows, :n], o) and torch.equal(s_all[rows], s), n


def test_chunked_autograd_path_gives_the_same_bits() -> None:
    """With inputs that require grad the kernel works out of place; its forward result is the
    in-place path's, bit for bit."""
    gen = torch.Generator().manual_seed(23)
    inputs = [t.float() for t in kernel_inputs(gen, 77, "mixed")]
    for chunk_size in (32, 24):
        o, s = kda_chunked(*inputs, chunk_size=chunk_size)
        o_grad, s_grad = kda_chunked(*(t.clone().requires_grad_() for t in inputs), chunk_size=chunk_size)
        assert o_grad.requires_grad and torch.equal(o_grad, o) and torch.equal(s_grad, s)


@pytest.mark.parametrize("chunk_size", [32, 24])
def test_chunked_tiles_give_the_same_bits(chunk_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large calls compute their chunks in tiles; tiles of 3 chunk rows (not dividing the 20 or
    28 rows of this call) give exactly the untiled result."""
    gen = torch.Generator().manual_seed(24)
    inputs = [t.float() for t in kernel_inputs(gen, 150, "mixed")]
    o, s = kda_chunked(*inputs, chunk_size=chunk_size)
    monkeypatch.setattr(kda_ops, "TILE_TOKENS", 3 * chunk_size)
    o_tiled, s_tiled = kda_chunked(*inputs, chunk_size=chunk_size)
    assert torch.equal(o_tiled, o) and torch.equal(s_tiled, s)


@pytest.mark.parametrize("T", [64, 77])
def test_chunked_leaves_its_inputs_alone(T: int) -> None:
    """The in-place path only writes buffers of its own (whole chunks or not, state included)."""
    gen = torch.Generator().manual_seed(25)
    inputs = [t.float() for t in kernel_inputs(gen, T, "mixed")]
    before = [t.clone() for t in inputs]
    kda_chunked(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(inputs, before))


@pytest.mark.parametrize("decay", ["strong", "mild"])
def test_decode_step_matches_recurrent(decay: str) -> None:
    """The in-place decode step, chained over 12 tokens, equals the token-by-token reference."""
    gen = torch.Generator().manual_seed(11)
    q, k, v, g, beta, state = kernel_inputs(gen, 12, decay)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, state)
    s = state.clone()
    outs = [kda_decode_step_(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s) for t in range(12)]
    torch.testing.assert_close(torch.stack(outs, 1), o_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-12)


def test_kernels_continue_across_calls() -> None:
    """Splitting a sequence and carrying the state equals one pass (both kernels, mixed)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta, state = kernel_inputs(gen, 150, "mixed")
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, state)
    outs, s = [], state
    for lo, hi, kernel in ((0, 70, kda_chunked), (70, 71, kda_recurrent), (71, 150, kda_chunked)):
        o, s = kernel(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], s)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-10)


def test_recurrent_matches_fla_naive() -> None:
    naive = load_fla_naive()
    gen = torch.Generator().manual_seed(11)
    for decay in ("mixed", "mild"):
        q, k, v, g, beta, state = kernel_inputs(gen, 37, decay)
        o, s = kda_recurrent(q, k, v, g, beta, state)
        # fla scales q itself and computes in float32: pass scale 1 for our pre-scaled q.
        o_ref, s_ref = naive.naive_recurrent_kda(
            q, k, v, g, beta, scale=1.0, initial_state=state, output_final_state=True
        )
        torch.testing.assert_close(o, o_ref.to(F64), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s, s_ref.to(F64), rtol=1e-4, atol=1e-5)


def test_chunked_matches_fla_naive() -> None:
    naive = load_fla_naive()
    gen = torch.Generator().manual_seed(12)
    for decay in ("strong", "mixed", "mild"):
        q, k, v, g, beta, state = kernel_inputs(gen, 128, decay)  # naive_chunk_kda needs T % 64 == 0
        o, s = kda_chunked(q, k, v, g, beta, state)
        o_ref, s_ref = naive.naive_chunk_kda(
            q, k, v, g, beta, scale=1.0, initial_state=state, output_final_state=True, chunk_size=64
        )
        torch.testing.assert_close(o, o_ref.to(F64), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s, s_ref.to(F64), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["head", "channel"])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gate_matches_scalar_formula(layout: str, lower_bound: float | None) -> None:
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(3, H, K, dtype=F64, generator=gen) * 3
    a_log = torch.randn((H, 1) if layout == "head" else (1, K), dtype=F64, generator=gen)
    dt_bias = torch.randn(H * K, dtype=F64, generator=gen)
    g = kda_gate(z, a_log, dt_bias, lower_bound)
    for t in range(3):
        for h in range(H):
            for d in range(K):
                a = math.exp(a_log[h, 0] if layout == "head" else a_log[0, d])
                x = z[t, h, d].item() + dt_bias[h * K + d].item()
                if lower_bound is None:
                    want = -a * (x if x > 20 else math.log1p(math.exp(x)))
                else:
                    want = lower_bound / (1 + math.exp(-a * x))
                assert abs(g[t, h, d].item() - want) < 1e-12


def test_gate_keeps_float32_for_low_precision_inputs() -> None:
    z = torch.randn(4, H, K).to(torch.bfloat16)
    g = kda_gate(z, torch.zeros(H, 1), torch.zeros(H * K), -5.0)
    assert g.dtype == torch.float32


# ---- short conv ------------------------------------------------------------------------------


@pytest.mark.parametrize("W", [4, 2, 1])
def test_causal_conv_pieces_steps_and_conv1d(W: int) -> None:
    gen = torch.Generator().manual_seed(W)
    T, C = 23, 6
    x = torch.randn(T, C, dtype=F64, generator=gen)
    w = torch.randn(C, W, dtype=F64, generator=gen)
    zero = torch.zeros(W - 1, C, dtype=F64)
    # independent reference: depthwise conv over the zero-left-padded sequence, then SiLU
    padded = torch.cat([torch.zeros(W - 1, C, dtype=F64), x]).t().unsqueeze(0)
    ref = F.silu(F.conv1d(padded, w.unsqueeze(1), groups=C))[0].t()
    ref_state = torch.cat([zero, x])[-(W - 1):] if W > 1 else zero

    whole, state = causal_conv(x, w, zero)
    torch.testing.assert_close(whole, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)

    pieces, state = [], zero
    for lo, hi in ((0, 1), (1, 3), (3, 4), (4, 12), (12, 14), (14, 23)):  # includes pieces shorter than W-1
        y, state = causal_conv(x[lo:hi], w, state)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces), ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)

    # token by token in a batch of two sequences: the second is the first shifted by 5 tokens
    states = torch.zeros(2, W - 1, C, dtype=F64)
    steps = []
    for t in range(T):
        xt = torch.stack([x[t], x[t - 5] if t >= 5 else torch.zeros(C, dtype=F64)])
        y, states = causal_conv_step(xt, w, states)
        steps.append(y)
    steps = torch.stack(steps, 1)
    torch.testing.assert_close(steps[0], ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(steps[1, 5:], ref[: T - 5], rtol=0, atol=1e-12)
    torch.testing.assert_close(states[0], ref_state, rtol=0, atol=0)


# ---- the layer -------------------------------------------------------------------------------


def make_layer(config: ModelConfig, seed: int) -> KimiDeltaAttention:
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(config, 0).to(F64)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "dt_bias":
                p.normal_(-2.0, 0.5)  # moderate decay so the state carries information many tokens
            elif name == "o_norm.weight":
                p.normal_(1.0, 0.2)
            elif name == "A_log":
                p.normal_(0.0, 0.5)
            elif "conv1d" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return layer


def layer_and_input(name: str, seed: int, T: int) -> tuple[KimiDeltaAttention, torch.Tensor]:
    layer = make_layer(CONFIGS[name](), seed)
    return layer, torch.randn(T, layer.config.hidden_size, dtype=F64)


def run_steps(layer: KimiDeltaAttention, x: torch.Tensor, sizes: list[int]):
    """Feed one sequence in pieces of the given sizes; returns outputs and the final states."""
    config = layer.config
    cache = SimpleCache(config, 1, F64)
    outs, done = [], 0
    for n in sizes:
        batch = simple_batch(config, [n], cache, [done])
        outs.append(layer(x[done : done + n], batch))
        done += n
    conv, rec = cache.kda_state(0)
    return torch.cat(outs), conv.clone(), rec.clone()


def reference_layer(layer: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """Spec §1 for one fresh sequence, head by head and token by token, with 2-D tensors only."""
    config, T = layer.config, x.shape[0]
    Hn, Kd, W = layer.num_heads, layer.head_dim, layer.conv_kernel

    def conv_silu(proj, conv):
        y = proj(x).t().unsqueeze(0)  # [1, P, T]
        return F.silu(F.conv1d(y, conv.weight, padding=W - 1, groups=y.shape[1])[..., :T])[0].t()

    q = conv_silu(layer.q_proj, layer.q_conv1d)
    k = conv_silu(layer.k_proj, layer.k_conv1d)
    v = conv_silu(layer.v_proj, layer.v_conv1d)
    beta = torch.sigmoid(layer.b_proj(x))
    z = layer.f_b_proj(layer.f_a_proj(x))
    gate_in = layer.g_proj(x) if config.kda_full_rank_gate else layer.g_b_proj(layer.g_a_proj(x))
    out = torch.zeros(T, Hn * Kd, dtype=F64)
    for h in range(Hn):
        cols = slice(h * Kd, (h + 1) * Kd)
        a = layer.A_log[h, 0].exp() if layer.A_log.shape[0] == Hn else layer.A_log[0].exp()
        S = torch.zeros(Kd, Kd, dtype=F64)
        for t in range(T):
            qt = q[t, cols] / torch.sqrt((q[t, cols] ** 2).sum() + 1e-6) / math.sqrt(Kd)
            kt = k[t, cols] / torch.sqrt((k[t, cols] ** 2).sum() + 1e-6)
            u = z[t, cols] + layer.dt_bias[cols]
            if config.kda_gate_lower_bound is None:
                g = -a * F.softplus(u)
            else:
                g = config.kda_gate_lower_bound * torch.sigmoid(a * u)
            S = torch.diag(g.exp()) @ S
            S = S + beta[t, h] * torch.outer(kt, v[t, cols] - S.t() @ kt)
            o = S.t() @ qt
            o = o / torch.sqrt(o.pow(2).mean() + config.rms_norm_eps) * layer.o_norm.weight
            out[t, cols] = o * torch.sigmoid(gate_in[t, cols])
    return layer.o_proj(out)


@pytest.mark.parametrize("name", CONFIGS)
def test_layer_matches_spec_reference(name: str) -> None:
    layer, x = layer_and_input(name, seed=1, T=40)
    with torch.no_grad():
        got, _, _ = run_steps(layer, x, [40])
        want = reference_layer(layer, x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", CONFIGS)
def test_layer_prefill_equals_chunks_and_decode(name: str) -> None:
    layer, x = layer_and_input(name, seed=2, T=100)
    with torch.no_grad():
        ref, conv_ref, rec_ref = run_steps(layer, x, [100])
        assert ref.abs().max() > 1e-3
        for sizes in ([70, 1, 2, 27], [5, 16, 17, 62], [1] * 100):
            out, conv, rec = run_steps(layer, x, sizes)
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
            torch.testing.assert_close(conv, conv_ref, rtol=0, atol=1e-12)
            torch.testing.assert_close(rec, rec_ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", CONFIGS)
def test_layer_varlen_batch_equals_each_alone(name: str) -> None:
    """Decode tokens (with histories), a fresh prefill and a continued prefill in one step."""
    layer = make_layer(CONFIGS[name](), seed=3)
    config = layer.config
    histories, news = [20, 0, 70, 9, 0], [1, 45, 1, 12, 1]
    xs = [torch.randn(h + n, config.hidden_size, dtype=F64) for h, n in zip(histories, news)]
    with torch.no_grad():
        alone = [run_steps(layer, x, [h, n] if h else [n]) for x, h, n in zip(xs, histories, news)]
        # the batched cache starts from each sequence's state after its history
        convs, recs = [], []
        for x, h in zip(xs, histories):
            if h:
                _, conv, rec = run_steps(layer, x[:h], [h])
            else:
                conv, rec = SimpleCache(config, 1, F64).kda_state(0)
            convs.append(conv[0])
            recs.append(rec[0])
        cache = SimpleCache(config, len(xs), F64)
        cache.set_kda_state(0, torch.stack(convs), torch.stack(recs))
        batch = simple_batch(config, news, cache, histories)
        out = layer(torch.cat([x[h:] for x, h in zip(xs, histories)]), batch)
        conv, rec = cache.kda_state(0)
    for b, (o_alone, conv_alone, rec_alone) in enumerate(alone):
        torch.testing.assert_close(out[batch.token_slice(b)], o_alone[-news[b]:], rtol=0, atol=1e-10)
        torch.testing.assert_close(conv[b], conv_alone[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(rec[b], rec_alone[0], rtol=0, atol=1e-10)


def test_layer_a_log_channel_layout() -> None:
    d = tiny_k3_dict()
    d["text_config"]["linear_attn_config"]["a_log_layout"] = "channel"
    channel = make_layer(ModelConfig.from_dict(d), seed=4)
    head = make_layer(tiny_k3(), seed=4)
    assert channel.A_log.shape == (1, K) and head.A_log.shape == (H, 1)
    channel.load_state_dict({n: t for n, t in head.state_dict().items() if n != "A_log"}, strict=False)
    x = torch.randn(30, head.config.hidden_size, dtype=F64)
    with torch.no_grad():
        # equal when both layouts hold the same value everywhere ...
        channel.A_log.fill_(0.3)
        head.A_log.fill_(0.3)
        torch.testing.assert_close(run_steps(channel, x, [30])[0], run_steps(head, x, [30])[0], rtol=0, atol=1e-12)
        # ... and different when the values vary along the axis that differs
        values = torch.linspace(-1.0, 1.0, K, dtype=F64)
        channel.A_log.copy_(values[None, :])
        head.A_log.copy_(values[:H, None])
        got = run_steps(channel, x, [30])[0]
        assert (got - run_steps(head, x, [30])[0]).abs().max() > 1e-3
        torch.testing.assert_close(got, reference_layer(channel, x), rtol=0, atol=1e-10)


def test_layer_low_precision_keeps_dtypes() -> None:
    """bf16 weights with a float32 recurrent state: output bf16, states keep their dtypes, close to float64."""
    layer = make_layer(tiny_k3(), seed=5)
    x = torch.randn(50, layer.config.hidden_size, dtype=F64)
    with torch.no_grad():
        want, _, _ = run_steps(layer, x, [50])
        low = layer.to(torch.bfloat16)
        low.A_log.data, low.dt_bias.data = low.A_log.data.float(), low.dt_bias.data.float()
        cache = SimpleCache(low.config, 1, torch.bfloat16)
        got = low(x.to(torch.bfloat16), simple_batch(low.config, [50], cache, [0]))
        conv, rec = cache.kda_state(0)
    assert got.dtype == torch.bfloat16 and conv.dtype == torch.bfloat16 and rec.dtype == torch.float32
    err = (got.to(F64) - want).abs().max() / want.abs().max()
    assert err < 0.05
