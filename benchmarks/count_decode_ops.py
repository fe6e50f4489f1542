"""aten calls and wall time of one decode step, with the fused CPU decode path on and off, one command.

    python benchmarks/count_decode_ops.py                    # the 223M K3 model, bf16 trunk, batch 1 and 8
    python benchmarks/count_decode_ops.py --dtype float32 --batches 1 8 32 --steps 32

The model is vs_llamacpp.py's (benchmarks/configs/k3-223m.json, random weights, MXFP4 experts).
Each batch size is measured twice in the same process: once with ``TIDAL_FUSED_DECODE=0`` (the torch
ops of ``tidal/model``, the baseline) and once with it on (the one-call-per-layer C steps of
``tidal/ops/fused_decode.py``). aten calls are counted by a TorchDispatchMode over one decode step and
attributed to the innermost labelled module; ms/step is the median of --steps timed engine steps.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import tidal  # noqa: F401  (first: its OpenMP wait policy must be set before torch loads libgomp)
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llamacpp import CONFIG, checkpoint, prompts  # noqa: E402

from tidal import LLM, SamplingParams  # noqa: E402
from tidal.model import kda, kimi, layers, mla, moe  # noqa: E402

LABEL: list[str] = ["other"]


class Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[LABEL[-1]] += 1
        return func(*args, **(kwargs or {}))


def labelled(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        LABEL.append(label)
        try:
            return fn(*args, **kwargs)
        finally:
            LABEL.pop()

    setattr(owner, name, wrapper)


# (owner, attribute, label) of the parts of a decode step that the counting benchmarks attribute to
# (count_omp_regions.py too); a call inside two of them counts for the innermost
MODEL_MODULES = [
    (kda.KimiDeltaAttention, "forward", "KDA"), (mla.KimiMLA, "forward", "MLA"),
    (moe.KimiMoE, "forward", "MoE"), (moe.KimiMLP, "forward", "dense/shared MLP"),
    (kimi, "attn_res_glue", "AttnRes (+ add, norm)"), (kimi.KimiForCausalLM, "compute_logits", "lm_head"),
    (layers.RMSNorm, "forward", "RMSNorm"),
]


def label_modules() -> None:
    for owner, name, label in MODEL_MODULES:
        labelled(owner, name, label)


def decode_engine(llm: LLM, vocab: int, b: int):
    """The engine with b sequences prefilled (128 tokens each) and one decode step taken."""
    engine = llm.engine
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts(vocab, b, 128, seed=b)):
        engine.add_request(f"b{b}-{i}-{time.monotonic_ns()}", p["prompt_token_ids"], params)
    while engine.scheduler.waiting or any(r.num_uncomputed > 1 for r in engine.scheduler.running):
        engine.step()
    engine.step()
    return engine


def measure(engine, steps: int) -> tuple[collections.Counter, float]:
    with Counter() as c:
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return c.calls, statistics.median(times)


def step_arguments(doc: str, steps: int) -> argparse.ArgumentParser:
    """The options of the decode-step benchmarks (this one, profile_step.py)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=steps)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = step_arguments(__doc__, 24).parse_args(argv)
    torch.set_num_threads(args.threads)
    label_modules()
    vocab = json.loads(args.config.read_text())["text_config"]["vocab_size"]
    llm = LLM(str(checkpoint(args.config)), dtype=args.dtype, skip_tokenizer_init=True,
              kv_cache_memory_bytes=1 << 30, max_num_batched_tokens=2048)
    print(f"## {args.config.name}, {args.dtype}, {args.threads} threads, load {os.getloadavg()[0]:.2f}")
    for b in args.batches:
        engine = decode_engine(llm, vocab, b)
        results = {}
        for fused in ("0", "1", "0", "1"):  # interleaved: drift in the machine's load hits both
            os.environ["TIDAL_FUSED_DECODE"] = fused
            calls, t = measure(engine, args.steps // 2)
            prev = results.get(fused)
            results[fused] = (calls, min(t, prev[1]) if prev else t)
        for r in list(engine.scheduler.running):
            engine.abort_request(r.request_id)
        (c0, t0), (c1, t1) = results["0"], results["1"]
        print(f"\nbatch {b}: {sum(c0.values())} -> {sum(c1.values())} aten calls per step; "
              f"{t0 * 1e3:.2f} -> {t1 * 1e3:.2f} ms/step ({t0 / t1:.2f}x)")
        for label in sorted(set(c0) | set(c1), key=lambda k: -c0.get(k, 0)):
            print(f"  {label:18} {c0.get(label, 0):6} -> {c1.get(label, 0):6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
