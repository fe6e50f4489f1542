"""The bfloat16 MoE layer with packed MXFP4 experts: one C call against the separate calls, A/B in one process.

    PYTHONPATH=. python benchmarks/bench_moe_layer_step.py [--rows 1 8] [--rounds 5]

The 223M model's MoE layer shape (benchmarks/configs/k3-223m.json: hidden 768, latent 384, 32
experts top-4 of 512, one shared expert of 512; random weights, packed experts), --layers copies
cycled so that a step reads each layer's weights once as a decode step does. Per round and row
count, interleaved: the separate calls (router, latent projections, packed experts, norm, shared
MLP, sum: ``fused_decode.moe_layer_step`` off), the one call on 1 thread (the two branches one after
the other) and on --threads threads (side by side where they read comparable bytes). Median
microseconds per layer, ratios against the separate calls of the same round, and the load average
beside each round (the machine is shared). The outputs of the three are compared bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import tidal  # noqa: F401  (first: its OpenMP wait policy must be set before torch loads libgomp)
import torch

from tidal.config import ModelConfig
from tidal.model.moe import KimiMoE, PackedExperts
from tidal.ops import fused_decode

CONFIG = Path(__file__).resolve().parent / "configs" / "k3-223m.json"


def layer(config: ModelConfig, seed: int) -> KimiMoE:
    torch.manual_seed(seed)
    moe = KimiMoE(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.data.normal_(0.0, p.shape[-1] ** -0.5)
        moe.experts = PackedExperts.from_dense(moe.experts)
        for name, p in moe.named_parameters():
            if name != "gate.e_score_correction_bias":
                p.data = p.data.bfloat16()
    return moe


def timed(layers: list[KimiMoE], x: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
    """Median seconds per layer over ``steps`` passes through all layers, and the last output."""
    per = []
    out = x
    for _ in range(steps):
        t0 = time.perf_counter()
        for moe in layers:
            out = moe(x)
        per.append((time.perf_counter() - t0) / len(layers))
    return statistics.median(per), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    config = ModelConfig.from_dict(json.loads(CONFIG.read_text()))
    layers = [layer(config, seed) for seed in range(args.layers)]
    one_call = fused_decode.moe_layer_step
    print(f"## MoE layer step, {config.hidden_size} -> {config.expert_hidden_size}, {config.num_experts} experts "
          f"top-{config.num_experts_per_token}, load {os.getloadavg()[0]:.2f}")
    print("| rows | round | separate us | one call, 1 thread | one call, %d threads | load |" % args.threads)
    print("|---|---|---|---|---|---|")
    ratios: dict[tuple[int, str], list[float]] = {}
    with torch.inference_mode():
        for T in args.rows:
            x = torch.randn(T, config.hidden_size, generator=torch.Generator().manual_seed(T)).bfloat16()
            for r in range(args.rounds):
                fused_decode.moe_layer_step = lambda *a: None
                torch.set_num_threads(args.threads)
                sep, want = timed(layers, x, args.steps)
                fused_decode.moe_layer_step = one_call
                torch.set_num_threads(1)
                one, got1 = timed(layers, x, args.steps)
                torch.set_num_threads(args.threads)
                many, got2 = timed(layers, x, args.steps)
                if not (torch.equal(want, got1) and torch.equal(want, got2)):
                    print("the outputs differ", file=sys.stderr)
                    return 1
                ratios.setdefault((T, "1"), []).append(sep / one)
                ratios.setdefault((T, "n"), []).append(sep / many)
                print(f"| {T} | {r + 1} | {sep * 1e6:.0f} | {one * 1e6:.0f} ({sep / one:.2f}x) | "
                      f"{many * 1e6:.0f} ({sep / many:.2f}x) | {os.getloadavg()[0]:.2f} |")
    fused_decode.moe_layer_step = one_call
    for T in args.rows:
        print(f"rows {T}: one call {statistics.median(ratios[T, '1']):.2f}x (1 thread), "
              f"{statistics.median(ratios[T, 'n']):.2f}x ({args.threads} threads) as fast as the separate calls "
              "(median over rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
