"""Vision tower time per image and TTFT of an image request with and without an encoder cache hit.

    OMP_NUM_THREADS=2 nice python benchmarks/bench_vision.py [--sizes 448 1024] [--repeats 2]

The tower has K3's real dimensions (width 1024, 27 layers, 12 heads, qkv 1536; random weights,
float32). Baseline in the same run: a float32 GEMM of the tower's shape class measured right
before, giving the CPU's attainable FLOP/s; the tower's fraction of it is reported (its FLOPs
counted from the dims: projections, MLP, attention scores and values, projector).
TTFT: an engine (tiny K3 text model, the same real-size tower projecting to its width) serving
one image prompt twice with the prefix cache off; the second finds the tower output cached.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from PIL import Image

from tidal import presets
from tidal.config import ModelConfig
from tidal.engine.request import ImageItem
from tidal.llm import LLM
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.model.vision import KimiVisionModel
from tidal.multimodal import preprocess_image
from tidal.sampling_params import SamplingParams


def tower_flops(c, n_patches: int) -> float:
    L, D, Q, I = n_patches, c.hidden_size, c.qkv_hidden_size, c.intermediate_size
    per_layer = 2 * L * (D * 3 * Q + Q * D + 2 * D * I) + 4 * L * L * Q
    m = L // 4
    proj = 2 * m * (4 * D * 4 * D + 4 * D * c.text_hidden_size)
    return c.num_hidden_layers * per_layer + proj + 2 * L * 3 * 14 * 14 * D


def gemm_flops_per_s(n: int = 2048, repeats: int = 3) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def noise_image(side: int, seed: int = 0) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    return Image.fromarray(arr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=[448, 1024])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ttft-size", type=int, default=448)
    args = ap.parse_args()
    vision = presets.preset("kimi-k3").vision
    print(f"torch threads {torch.get_num_threads()}")
    peak = gemm_flops_per_s()
    print(f"baseline: float32 GEMM 2048^3 at {peak / 1e9:.1f} GFLOP/s")
    torch.manual_seed(0)
    tower = KimiVisionModel(vision).eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    for side in args.sizes:
        img = preprocess_image(noise_image(side), vision)
        with torch.inference_mode():
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                tower(img.patches, img.grid)
                times.append(time.perf_counter() - t)
        best = min(times)
        flops = tower_flops(vision, img.patches.shape[0])
        print(f"tower {side}x{side}: grid {img.grid[0]}x{img.grid[1]} = {img.patches.shape[0]} patches, "
              f"{img.num_tokens} tokens; {best:.2f} s/image (best of {args.repeats}: "
              f"{', '.join(f'{x:.2f}' for x in times)}); {flops / 1e12:.2f} TFLOP -> {flops / best / 1e9:.1f} GFLOP/s "
              f"= {flops / best / peak:.0%} of the GEMM baseline")

    # TTFT with and without an encoder cache hit
    d = presets.tiny_k3_dict(hidden_size=256, mxfp4=False, vision=True)
    d["vision_config"] = dict(vision.to_dict(), text_hidden_size=256)
    config = ModelConfig.from_dict(d)
    model = init_weights(KimiForCausalLM(config), seed=0).to_dtype(torch.float32)
    with torch.no_grad():
        model.vision_tower.load_state_dict(tower.vision_tower.state_dict())
    llm = LLM(model, kv_cache_memory_bytes=200_000_000, enable_prefix_caching=False)
    eng = llm.engine
    img = preprocess_image(noise_image(args.ttft_size, 1), config.vision)
    pad = config.media_placeholder_token_id
    ids = [10, 11, 12] + [pad] * img.num_tokens + [20, 21]
    ttfts = []
    for i in range(3):
        t = time.perf_counter()
        eng.add_request(f"r{i}", ids + [30 + i], SamplingParams(max_tokens=1, temperature=0),
                        images=[ImageItem(3, img)])
        while eng.has_unfinished_requests():
            eng.step()
        ttfts.append(time.perf_counter() - t)
    t = time.perf_counter()
    eng.add_request("text", [10 + i % 200 for i in range(len(ids) + 1)], SamplingParams(max_tokens=1, temperature=0))
    while eng.has_unfinished_requests():
        eng.step()
    text_ttft = time.perf_counter() - t
    print(f"baseline: TTFT of a text-only prompt of the same length {text_ttft:.3f} s")
    print(f"TTFT {args.ttft_size}x{args.ttft_size} image request ({len(ids) + 1} prompt tokens, "
          f"{img.num_tokens} image tokens): encoder cache miss {ttfts[0]:.3f} s, hits {ttfts[1]:.3f} s and "
          f"{ttfts[2]:.3f} s (miss/hit {ttfts[0] / min(ttfts[1:]):.0f}x); encoder cache "
          f"{eng.encoder_cache.misses} miss(es), {eng.encoder_cache.hits} hit(s), {eng.encoder_cache.bytes} bytes")


if __name__ == "__main__":
    main()
