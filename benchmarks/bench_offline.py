"""Offline throughput and TTFT of tidal's engine against transformers ``generate()``, same prompts.

    python benchmarks/bench_offline.py                    # embedded model + ~90M Kimi Linear, C = 1 8 32 128
    python benchmarks/bench_offline.py --quick            # tiny model, C = 1 4, seconds
    python benchmarks/bench_offline.py --models kimi-linear-90m --concurrency 1 32 --prompt-len 256 --output-len 128

For each model and concurrency C: C random prompts of --prompt-len tokens, greedy, exactly
--output-len new tokens each (ignore_eos). tidal: all C requests submitted at once to
``LLM.generate`` (continuous batching). transformers: one static batch of the same C prompts
through ``generate()``; its TTFT is the time of ``generate(max_new_tokens=1)`` on that batch.
transformers has no Kimi-K3 model, so the embedded (K3-layout) model runs tidal only.
Also prints the batch-1 decode bound: bytes of weights read per token / measured read bandwidth.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import active_weight_bytes, config_90m, copy_bandwidth  # noqa: E402

from tidal import LLM, SamplingParams  # noqa: E402
from tidal.model.checkpoint import save_model  # noqa: E402
from tidal.model.init import init_weights  # noqa: E402
from tidal.model.kimi import KimiForCausalLM  # noqa: E402
from tidal.presets import tiny_kimi_linear  # noqa: E402


@dataclass
class Run:
    output_tok_s: float
    ttft_mean_s: float
    decode_tok_s: float | None = None  # per request, after its first token (batch-1 runs)


def embedded_dir(tmp: Path) -> Path:
    """The shipped embedded checkpoint, or the same recipe written to a temporary directory."""
    from tidal.embedded import embedded_model_dir, write_random_embedded_model

    path = embedded_model_dir()
    if (path / "config.json").exists():
        return path
    return write_random_embedded_model(tmp / "embedded")


def kimi_linear_dir(tmp: Path, quick: bool, dtype: torch.dtype) -> Path:
    config = tiny_kimi_linear() if quick else config_90m(str(dtype).removeprefix("torch."))
    path = tmp / ("kimi-linear-tiny" if quick else "kimi-linear-90m")
    save_model(init_weights(KimiForCausalLM(config), seed=0).to_dtype(dtype), path)
    return path


def prompts_for(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


def run_tidal(llm: LLM, prompts: list[list[int]], output_len: int) -> Run:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [o.metrics.ttft for o in outs]
    decode = None
    if len(outs) == 1 and output_len > 1:
        m = outs[0].metrics
        decode = (output_len - 1) / max(m.last_token_time - m.first_token_time, 1e-9)
    return Run(n_out / elapsed, statistics.mean(ttfts), decode)


@torch.inference_mode()
def run_transformers(model, prompts: list[list[int]], output_len: int, pad_id: int) -> Run:
    x = torch.tensor(prompts)
    mask = torch.ones_like(x)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=pad_id)
    t0 = time.perf_counter()
    model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(x, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
    elapsed = time.perf_counter() - t0
    n_out = (out.shape[1] - x.shape[1]) * x.shape[0]
    return Run(n_out / elapsed, ttft)


def bench_model(name: str, path: Path, args: argparse.Namespace, dtype: torch.dtype) -> None:
    llm = LLM(str(path), dtype=str(dtype).removeprefix("torch."), skip_tokenizer_init=True,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_num_batched_tokens=args.max_num_batched_tokens,
              device=args.device)
    config = llm.engine.model_config
    hf = None
    if config.model_type == "kimi_linear" and not args.no_transformers:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(args.device or "cpu").eval()
    n_params = sum(p.numel() for p in llm.engine.model.parameters())
    print(f"\n## {name}: {config.model_type}, {n_params / 1e6:.1f}M params, {str(dtype).removeprefix('torch.')}, "
          f"threads={torch.get_num_threads()}, prompt {args.prompt_len}, output {args.output_len}")
    warm = prompts_for(config.vocab_size, 2, 8, seed=99)
    run_tidal(llm, warm, 2)
    if hf is not None:
        run_transformers(hf, warm, 2, config.pad_token_id or 0)
    header = f"{'C':>5} | {'tidal out tok/s':>15} | {'tidal TTFT s':>12}"
    if hf is not None:
        header += f" | {'HF out tok/s':>12} | {'HF TTFT s':>9} | {'ratio':>6}"
    print(header)
    single: Run | None = None
    for c in args.concurrency:
        prompts = prompts_for(config.vocab_size, c, args.prompt_len, seed=c)
        ours = run_tidal(llm, prompts, args.output_len)
        if c == 1:
            single = ours
        line = f"{c:>5} | {ours.output_tok_s:>15.1f} | {ours.ttft_mean_s:>12.3f}"
        if hf is not None:
            theirs = run_transformers(hf, prompts, args.output_len, config.pad_token_id or 0)
            ratio = ours.output_tok_s / theirs.output_tok_s
            line += f" | {theirs.output_tok_s:>12.1f} | {theirs.ttft_mean_s:>9.3f} | {ratio:>5.2f}x"
        print(line, flush=True)
    m = llm.engine.metrics()
    print(f"engine: {m.num_preemptions} preemptions, {m.num_compactions} compactions, "
          f"{m.generation_tokens} tokens out, {m.prompt_tokens} prompt tokens")
    if single is not None and single.decode_tok_s is not None:
        bw = copy_bandwidth()
        per_tok = active_weight_bytes(llm.engine.model)
        bound = bw / 2 / per_tok
        rate = single.decode_tok_s
        print(f"batch-1 decode bound: {per_tok / 1e6:.2f} MB of weights per token / {bw / 2e9:.1f} GB/s read = "
              f"{bound:.0f} tok/s; tidal decodes at {rate:.1f} tok/s ({rate / bound:.0%})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny Kimi Linear model, C = 1 4, short lengths")
    ap.add_argument("--models", nargs="+", default=None, choices=["embedded", "kimi-linear-90m"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("tidal.engine").setLevel(logging.INFO)  # pool size and capacity at start-up
    if args.threads:
        torch.set_num_threads(args.threads)
    args.concurrency = args.concurrency or ([1, 4] if args.quick else [1, 8, 32, 128])
    args.prompt_len = args.prompt_len or (16 if args.quick else 128)
    args.output_len = args.output_len or (8 if args.quick else 64)
    models = args.models or (["kimi-linear-90m"] if args.quick else ["embedded", "kimi-linear-90m"])
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            if name == "embedded":
                path = embedded_dir(Path(tmp))
            else:
                path = kimi_linear_dir(Path(tmp), args.quick, dtype)
            label = f"{name} (--quick: tiny config)" if args.quick and name != "embedded" else name
            bench_model(label, path, args, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
