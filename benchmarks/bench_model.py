"""Batch-1 prefill and decode speed of tidal's model against transformers on the same checkpoint.

    python benchmarks/bench_model.py [--prompt-len 512] [--new-tokens 64] [--dtype float32]

Builds a ~100M-parameter Kimi Linear checkpoint (random weights), loads it in both, and times
one prefill of --prompt-len tokens and greedy decoding of --new-tokens tokens (transformers:
``generate()`` with its cache). Prints tokens/s for each and tidal/transformers ratios, plus the
batch-1 decode bound: bytes of weights read per token / measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from tidal.config import ModelConfig
from tidal.model.checkpoint import load_model, save_model
from tidal.model.context import SimpleCache, simple_batch
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.presets import tiny_kimi_linear_dict


def config_90m(dtype: str) -> ModelConfig:
    d = tiny_kimi_linear_dict(hidden_size=512, num_layers=12, vocab_size=32000, num_experts=16, top_k=2)
    d.update(intermediate_size=1536, moe_intermediate_size=192, num_attention_heads=4, num_key_value_heads=4,
             kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, torch_dtype=dtype)
    d["linear_attn_config"].update(num_heads=4, head_dim=128)
    return ModelConfig.from_dict(d)


def active_weight_bytes(model: KimiForCausalLM) -> int:
    """Bytes read per decoded token: everything but the unchosen routed experts and the embedding table
    (packed MXFP4 experts are buffers: their codes and scales)."""
    c = model.config
    total = 0
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if "embed_tokens" in name:
            total += p.shape[-1] * p.element_size()
        elif ".experts." in name:
            total += p.numel() * p.element_size() * c.num_experts_per_token // c.num_experts
        else:
            total += p.numel() * p.element_size()
    return total


def copy_bandwidth() -> float:
    a = torch.empty(64 << 20, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    dt = (time.perf_counter() - t0) / 5
    return 2 * a.numel() / dt  # read + write


def read_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s of an int64 sum over ``nbytes`` on torch's threads, re-read (best of 5): a read-only
    stream, the GEMV's ideal. Sized as a decode step's weights it is the rate at which a step can
    re-read them, caches included (a working set the last-level cache holds reads faster than DRAM)."""
    a = torch.ones(max(8, nbytes // 8 * 8), dtype=torch.uint8).view(torch.int64)
    a.sum()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.numel() * 8 / best


@torch.inference_mode()
def tidal_speed(model: KimiForCausalLM, ids: torch.Tensor, new_tokens: int) -> tuple[float, float, list[int]]:
    c = model.config
    cache = SimpleCache(c, 1, model.dtype)
    t0 = time.perf_counter()
    logits = model.compute_logits(model(ids, simple_batch(c, [len(ids)], cache, [0]))[-1:])
    t_prefill = time.perf_counter() - t0
    out = [int(logits.argmax())]
    t0 = time.perf_counter()
    for i in range(new_tokens - 1):
        tok = torch.tensor(out[-1:])
        logits = model.compute_logits(model(tok, simple_batch(c, [1], cache, [len(ids) + i])))
        out.append(int(logits.argmax()))
    t_decode = time.perf_counter() - t0
    return len(ids) / t_prefill, (new_tokens - 1) / t_decode, out


@torch.inference_mode()
def hf_speed(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float, list[int]]:
    """generate() of 1 token = the prefill; generate() of N tokens minus that = N-1 decode steps."""
    x = ids[None]
    t0 = time.perf_counter()
    model.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    t_decode = max(time.perf_counter() - t0 - t_prefill, 1e-9)
    return len(ids) / t_prefill, (new_tokens - 1) / t_decode, out[0, len(ids):].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    dtype = getattr(torch, args.dtype)
    config = config_90m(args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        save_model(init_weights(KimiForCausalLM(config), seed=0).to_dtype(dtype), path)
        ours = load_model(path, dtype=dtype).process_weights_after_loading()  # as the engine does
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    n_params = sum(p.numel() for p in ours.parameters())
    ids = torch.randint(0, config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    # warm-up both once on a short input
    tidal_speed(ours, ids[:16], 2)
    hf_speed(theirs, ids[:16], 2)
    tp, td, tout = tidal_speed(ours, ids, args.new_tokens)
    hp, hd, hout = hf_speed(theirs, ids, args.new_tokens)
    same = sum(a == b for a, b in zip(tout, hout))
    bw = copy_bandwidth()
    bytes_per_tok = active_weight_bytes(ours)
    bound = bw / 2 / bytes_per_tok  # weights are only read: one direction of the copy
    print(f"model: Kimi Linear layout, {n_params / 1e6:.1f}M params, {args.dtype}, threads={torch.get_num_threads()}")
    print(f"prefill {args.prompt_len} tok : tidal {tp:8.1f} tok/s   transformers {hp:8.1f} tok/s   ratio {tp / hp:.2f}x")
    print(f"decode  {args.new_tokens} tok  : tidal {td:8.1f} tok/s   transformers {hd:8.1f} tok/s   ratio {td / hd:.2f}x")
    print(f"batch-1 decode bound: {bytes_per_tok / 1e6:.1f} MB of weights per token / {bw / 2e9:.1f} GB/s read "
          f"= {bound:.0f} tok/s; tidal reaches {td / bound:.0%}")
    print(f"greedy tokens identical to transformers: {same}/{len(tout)}")


if __name__ == "__main__":
    main()
