"""Multi-turn conversations through ``LLM`` with and without the prefix cache: TTFT and total time.

    python benchmarks/bench_prefix_cache.py                  # embedded model, 4 conversations x 5 turns
    python benchmarks/bench_prefix_cache.py --quick          # tiny K3 model, seconds
    python benchmarks/bench_prefix_cache.py --conversations 8 --turns 8 --system-len 1024 --user-len 128

Each of C conversations starts with a shared system prompt (--system-len tokens) plus its own user
message; every turn the whole conversation so far (prompt + reply) plus a new user message
(--user-len tokens) is sent again, as a coding agent does. All C requests of a turn are submitted
at once to ``LLM.generate`` (greedy, exactly --reply-len new tokens). Both engines see the same
user tokens; the replies match when the cache is exact. TTFT is arrival -> first token inside the
engine (so it includes queueing behind the other C - 1 prefills: TTFT-ish). Reported per engine:
TTFT median and p99 of turns >= 2 (turn 1 has nothing to hit), total wall time, prompt tokens
served from the cache; and the no-cache / cache ratios.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline import embedded_dir

from tidal import LLM, SamplingParams
from tidal.model.checkpoint import save_model
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.presets import tiny_k3


@dataclass
class Result:
    ttft_later: list[float] = field(default_factory=list)  # turns >= 2
    ttft_first: list[float] = field(default_factory=list)
    total_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replies: list[list[int]] = field(default_factory=list)


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def user_turns(vocab: int, args: argparse.Namespace) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and every conversation's user messages, fixed by the seed."""
    g = torch.Generator().manual_seed(args.seed)
    system = torch.randint(0, vocab, (args.system_len,), generator=g).tolist()
    users = [[torch.randint(0, vocab, (args.user_len,), generator=g).tolist() for _ in range(args.turns)]
             for _ in range(args.conversations)]
    return system, users


def run(llm: LLM, system: list[int], users: list[list[list[int]]], reply_len: int) -> Result:
    params = SamplingParams(temperature=0, max_tokens=reply_len, ignore_eos=True)
    convs = [list(system) for _ in users]
    res = Result()
    t0 = time.perf_counter()
    for turn in range(len(users[0])):
        prompts = [c + u[turn] for c, u in zip(convs, users)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for i, (p, o) in enumerate(zip(prompts, outs)):
            (res.ttft_later if turn else res.ttft_first).append(o.metrics.ttft)
            res.prompt_tokens += len(p)
            res.cached_tokens += o.num_cached_tokens
            res.replies.append(o.outputs[0].token_ids)
            convs[i] = p + o.outputs[0].token_ids
    res.total_s = time.perf_counter() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny K3 model and short conversations")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-len", type=int, default=None)
    ap.add_argument("--user-len", type=int, default=None)
    ap.add_argument("--reply-len", type=int, default=None)
    ap.add_argument("--snapshot-interval", type=int, default=None, help="default: the engine's")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.system_len = args.system_len or (64 if args.quick else 512)
    args.user_len = args.user_len or (16 if args.quick else 96)
    args.reply_len = args.reply_len or (8 if args.quick else 32)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path = Path(args.model)
        elif args.quick:
            path = Path(tmp) / "tiny-k3"
            save_model(init_weights(KimiForCausalLM(tiny_k3(mxfp4=False)), seed=0), path)
        else:
            path = embedded_dir(Path(tmp))
        results: dict[bool, Result] = {}
        for cache in (False, True):
            llm = LLM(str(path), dtype=args.dtype, skip_tokenizer_init=True, device=args.device,
                      kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                      max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=cache,
                      prefix_snapshot_interval=args.snapshot_interval)
            if cache and args.snapshot_interval is None:
                args.snapshot_interval = llm.engine.prefix_cache.snapshot_interval
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))  # warm-up
            llm.engine.flush_prefix_cache()
            results[cache] = run(llm, *user_turns(llm.engine.model_config.vocab_size, args), args.reply_len)
            del llm
    off, on = results[False], results[True]
    final = args.system_len + args.turns * (args.user_len + args.reply_len)
    print(f"\n{args.conversations} conversations x {args.turns} turns; system {args.system_len}, user "
          f"{args.user_len}, reply {args.reply_len} tokens (last prompt ~{final}); model {path.name}, "
          f"{args.dtype}, threads={torch.get_num_threads()}, snapshot interval {args.snapshot_interval}")
    print(f"{'':>9} | {'TTFT med s':>10} | {'TTFT p99 s':>10} | {'turn-1 TTFT med':>15} | {'total s':>8} | "
          f"{'cached / prompt tokens':>24}")
    for name, r in (("no cache", off), ("cache", on)):
        print(f"{name:>9} | {statistics.median(r.ttft_later):>10.4f} | {p99(r.ttft_later):>10.4f} | "
              f"{statistics.median(r.ttft_first):>15.4f} | {r.total_s:>8.2f} | "
              f"{r.cached_tokens:>10} / {r.prompt_tokens:<11}")
    med = statistics.median(off.ttft_later) / statistics.median(on.ttft_later)
    print(f"ratio no-cache / cache: TTFT median {med:.2f}x, TTFT p99 {p99(off.ttft_later) / p99(on.ttft_later):.2f}x, "
          f"total time {off.total_s / on.total_s:.2f}x; replies identical: {off.replies == on.replies}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
