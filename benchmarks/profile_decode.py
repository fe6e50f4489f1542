"""Where a batched decode step spends its time, by module (wall time of each module's forward).

    python benchmarks/profile_decode.py [--batch 32] [--steps 20] [--threads 1]

Runs the engine on the ~100M-parameter Kimi Linear model of bench_model.py (random weights),
prefills --batch prompts of 128 tokens, then times --steps pure decode steps.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from bench_model import config_90m
from tidal import LLM, SamplingParams
from tidal.engine.core import EngineCore
from tidal.engine.runner import ModelRunner
from tidal.model import kda, mla, moe
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM

TIMES: collections.Counter = collections.Counter()


def timed(cls: type, name: str, label: str) -> None:
    fn = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        TIMES[label] += time.perf_counter() - t0
        return out

    setattr(cls, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for cls, name, label in [
        (EngineCore, "step", "engine step"), (ModelRunner, "execute", "runner"),
        (KimiForCausalLM, "forward", "model"), (kda.KimiDeltaAttention, "forward", "KDA"),
        (mla.KimiMLA, "forward", "MLA"), (moe.KimiMoE, "forward", "MoE"), (moe.Experts, "forward", "routed experts"),
        (moe.KimiMLP, "forward", "dense + shared MLP"), (KimiForCausalLM, "compute_logits", "lm_head"),
    ]:
        timed(cls, name, label)
    model = init_weights(KimiForCausalLM(config_90m("float32"))).eval()
    llm = LLM(model, kv_cache_memory_bytes=2 << 30, skip_tokenizer_init=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", list(range(1 + i, 129 + i)), params)
    while engine.scheduler.waiting or any(r.num_uncomputed > 1 for r in engine.scheduler.running):
        engine.step()  # prefill
    TIMES.clear()
    for _ in range(args.steps):
        engine.step()
    step = TIMES["engine step"] / args.steps
    print(f"decode step, batch {args.batch}: {step * 1e3:.1f} ms")
    for label, total in TIMES.most_common():
        print(f"  {label:20} {total / args.steps * 1e3:8.1f} ms  {total / args.steps / step:6.1%}")


if __name__ == "__main__":
    main()
