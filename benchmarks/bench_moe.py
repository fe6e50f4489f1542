"""Routed experts and shared MLP: the previous implementation (baseline, copied below) against the current one.

    python benchmarks/bench_moe.py [--threads 1] [--tokens 1 8 32 128 2048] [--repeats 7] [--dtype float32]

Two configs: the 104M Kimi Linear model of bench_model.py (d 512, 16 experts, top-2, I 192, SwiGLU,
11 MoE layers) and a K3-like latent MoE (d 512, latent width 256, 256 experts, top-8, I 256, SiTU).
Each timing is one pass over all layers of the config, each layer with its own weights and its own
routing of T random tokens, so that, as in a real model, the weights come from memory rather than
from the cache; the best of --repeats interleaved passes (half as many for T >= 1024) is printed per
layer (best rather than median: the machine is shared, and others' load only adds time).

Columns (ms per layer): ``base`` the baseline ``Experts.forward``, ``new`` the current one,
``fused`` the current one after ``fuse_weights()``; ``mlp base`` / ``mlp fused``: the shared
expert (nn.Linear gate, up, down against ``KimiMLP`` after ``fuse_weights()``). ``bound``: the bytes
of the distinct experts the tokens chose divided by the read bandwidth (a streaming sum over 256 MiB).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import config_90m

from tidal.config import ModelConfig
from tidal.model.init import init_weights
from tidal.model.layers import compute_dtype
from tidal.model.moe import Experts, KimiMLP, KimiMoE, activate
from tidal.presets import tiny_k3_dict

# ---- BASELINE: Experts.forward and KimiMLP.forward as they were before this benchmark (commit 197a81d) ----


def baseline_experts(self: Experts, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sum over each token's chosen experts of weight * expert(h). Tokens are grouped by expert:
    one matmul per active expert, no per-token loop."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=self.config.num_experts).tolist()
    token_of = order // k
    w_sorted = weights.reshape(-1)[order]
    out = torch.zeros(T, h.shape[-1], dtype=compute_dtype(h.dtype), device=h.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start : start + n]
        x = h[rows]
        y = activate(self.config, x @ self.w1[e].t(), x @ self.w3[e].t()) @ self.w2[e].t()
        out.index_add_(0, rows, y.to(out.dtype) * w_sorted[start : start + n, None].to(out.dtype))
        start += n
    return out


def baseline_mlp(self: KimiMLP, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(activate(self.config, self.gate_proj(x), self.up_proj(x)))


# ---- END BASELINE ----------------------------------------------------------------------------------------


def config_k3_like(dtype: str) -> ModelConfig:
    d = tiny_k3_dict(hidden_size=512, num_layers=4, num_experts=256, top_k=8, mxfp4=False)
    d["text_config"].update(routed_expert_hidden_size=256, moe_intermediate_size=256, torch_dtype=dtype)
    return ModelConfig.from_dict(d)


def read_bandwidth() -> float:
    """Bytes per second of a streaming read (sum over 256 MiB of float32)."""
    a = torch.ones(64 << 20)
    a.sum()
    best = min(_seconds(a.sum) for _ in range(5))
    return a.numel() * a.element_size() / best


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def layers_for(config: ModelConfig, n: int, dtype: torch.dtype) -> list[KimiMoE]:
    return [init_weights(KimiMoE(config), seed=i).to(dtype).eval() for i in range(n)]


def inputs_for(moes: list[KimiMoE], T: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """Per layer: x, the experts' input h, routed ids and weights (random tokens)."""
    out = []
    for i, moe in enumerate(moes):
        x = torch.randn(T, moe.config.hidden_size, generator=torch.Generator().manual_seed(100 + i)).to(dtype)
        ids, weights = moe.gate(x)
        h = moe.routed_expert_down_proj(x) if moe.config.is_latent_moe else x
        out.append((x, h, ids, weights))
    return out


def expert_bytes(moe: KimiMoE, ids: torch.Tensor) -> int:
    e = moe.experts
    per_expert = sum(p[0].numel() * p.element_size() for p in (e.w1, e.w2, e.w3))
    return per_expert * len(ids.unique())


def implementations(
    plain: list[KimiMoE], fused: list[KimiMoE], inputs: list[tuple[torch.Tensor, ...]]
) -> dict[str, Callable[[int], object]]:
    """Each timed implementation as a function of the layer index."""
    return {
        "base": lambda i: baseline_experts(plain[i].experts, *inputs[i][1:]),
        "new": lambda i: plain[i].experts(*inputs[i][1:]),
        "fused": lambda i: fused[i].experts(*inputs[i][1:]),
        "mlp base": lambda i: baseline_mlp(plain[i].shared_experts, inputs[i][0]),
        "mlp fused": lambda i: fused[i].shared_experts(inputs[i][0]),
    }


def bench_config(name: str, config: ModelConfig, n_layers: int, args: argparse.Namespace, bw: float) -> None:
    dtype = getattr(torch, args.dtype)
    plain = layers_for(config, n_layers, dtype)
    fused = copy.deepcopy(plain)
    for moe in fused:
        for m in moe.modules():
            if hasattr(m, "fuse_weights"):
                m.fuse_weights()
    c = config
    print(f"\n{name}: d {c.hidden_size}, expert width {c.expert_hidden_size}, {c.num_experts} experts, "
          f"top-{c.num_experts_per_token}, I {c.moe_intermediate_size}, {c.hidden_act}, {n_layers} layers, {args.dtype}")
    print(f"{'T':>5} {'base':>8} {'new':>8} {'fused':>8} {'base/fused':>10} {'bound':>7} {'fused/bound':>11}"
          f" {'mlp base':>9} {'mlp fused':>9} {'ratio':>6}")
    for T in args.tokens:
        inputs = inputs_for(plain, T, dtype)
        runs = implementations(plain, fused, inputs)
        for i in range(n_layers):
            ref = runs["base"](i)
            torch.testing.assert_close(runs["new"](i), ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(runs["fused"](i), ref, rtol=1e-4, atol=1e-4)
        times: dict[str, list[float]] = {k: [] for k in runs}
        repeats = args.repeats if T < 1024 else max(3, args.repeats // 2)
        for _ in range(repeats):
            for key, run in runs.items():
                times[key].append(_seconds(lambda run=run: [run(i) for i in range(n_layers)]) / n_layers * 1e3)
        ms = {k: min(v) for k, v in times.items()}
        bound = sum(expert_bytes(m, inp[2]) for m, inp in zip(plain, inputs)) / n_layers / bw * 1e3
        bound_s = f"{bound:7.3f}" if T <= 128 else f"{'-':>7}"
        ratio_s = f"{ms['fused'] / bound:11.2f}" if T <= 128 else f"{'-':>11}"
        print(f"{T:5d} {ms['base']:8.3f} {ms['new']:8.3f} {ms['fused']:8.3f} {ms['base'] / ms['fused']:10.2f} "
              f"{bound_s} {ratio_s} {ms['mlp base']:9.3f} {ms['mlp fused']:9.3f} {ms['mlp base'] / ms['mlp fused']:6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 2048])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--configs", nargs="+", default=["104m", "k3-like"], choices=["104m", "k3-like"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bw = read_bandwidth()
    print(f"threads {args.threads}, read bandwidth {bw / 1e9:.1f} GB/s")
    with torch.inference_mode():
        if "104m" in args.configs:
            bench_config("104M Kimi Linear", config_90m(args.dtype), 11, args, bw)
        if "k3-like" in args.configs:
            bench_config("K3-like latent MoE", config_k3_like(args.dtype), 3, args, bw)


if __name__ == "__main__":
    main()
