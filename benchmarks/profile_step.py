"""Where one decode step's milliseconds go, per op family and per layer type, on vs_llamacpp.py's model.

    PYTHONPATH=. python benchmarks/profile_step.py                      # bf16 trunk, batch 1 and 8
    PYTHONPATH=. python benchmarks/profile_step.py --dtype float32 --batches 1 32 --steps 16

Two views of the same steps, one process:

* exclusive wall time of labelled regions (engine step -> runner -> model -> layer types -> the GEMM
  seam ``tidal.ops.dense.linear``, the packed experts, the sampler). A region's time excludes the
  regions inside it, so the rows add up to the step; "GEMM" rows also give the weight bytes they
  read and the rate (bytes / time), against a read-bandwidth baseline measured in the same run.
  A bfloat16 Block AttnRes model's decode step runs its layers in one C call (``model_decode_step``):
  they show as one region (``TIDAL_FUSED_DECODE=0`` for the torch ops layer by layer).
* the step split into time inside the C kernels and torch's linear (every call timed) and the rest:
  Python, dispatch and the small torch ops around them (what the fused steps exist to cut).
* the torch profiler's aten table (self CPU time) of a few steps: what the dispatcher runs. The C
  kernels (ctypes calls) are not aten ops: they show as the time of their Python callers above.

The printed load average belongs beside every figure: the machine is shared.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import tidal  # noqa: F401  (first: its OpenMP wait policy must be set before torch loads libgomp)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import read_bandwidth  # noqa: E402
from count_decode_ops import decode_engine, step_arguments  # noqa: E402
from vs_llamacpp import checkpoint  # noqa: E402

from tidal import LLM  # noqa: E402
from tidal.engine import core, runner  # noqa: E402
from tidal.model import kda, kimi, layers, mla, moe  # noqa: E402
from tidal.ops import cpu_kernels, dense, fused_decode  # noqa: E402

STACK: list[list] = []  # [label, start, time spent in children]
SELF: collections.Counter = collections.Counter()
BYTES: collections.Counter = collections.Counter()


def enter(label: str) -> None:
    STACK.append([label, time.perf_counter(), 0.0])


def leave() -> None:
    label, t0, children = STACK.pop()
    dt = time.perf_counter() - t0
    SELF[label] += dt - children
    if STACK:
        STACK[-1][2] += dt


def region(owner, name: str, label: str | None) -> None:
    """Time ``owner.name`` as ``label`` (None: as '<enclosing label> GEMM', for the GEMM seam); nothing
    where the tree has no such function (the script also profiles older trees)."""
    fn = getattr(owner, name, None)
    if fn is None:
        return

    def wrapper(*args, **kwargs):
        tag = label or f"{STACK[-1][0] if STACK else 'other'} / GEMM"
        if label is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
            BYTES[tag] += args[1].numel() * args[1].element_size()
        enter(tag)
        try:
            return fn(*args, **kwargs)
        finally:
            leave()

    setattr(owner, name, wrapper)


def label_everything() -> None:
    for owner, name, label in [
        (core.EngineCore, "step", "engine (schedule, commit, emit)"),
        (runner.ModelRunner, "execute", "runner (batch build)"),
        (core, "sample", "sampler"),
        (kimi.KimiModel, "forward", "model (embed, glue)"),
        (kda.KimiDeltaAttention, "forward", "KDA"), (mla.KimiMLA, "forward", "MLA"),
        (moe.KimiMoE, "forward", "MoE (router, glue)"), (moe.KimiMLP, "forward", "dense/shared MLP"),
        (fused_decode, "packed_experts", "routed experts (packed)"),
        (kimi, "attn_res_glue", "AttnRes (+ add, norm)"), (kimi.KimiForCausalLM, "compute_logits", "lm_head"),
        (layers.RMSNorm, "forward", "RMSNorm"),
        # a bfloat16 AttnRes model's whole decode step in one C call (its layers are not seen apart)
        (fused_decode, "model_decode_step", "all layers (one C call)"),
    ]:
        region(owner, name, label)
    region(dense, "linear", None)
    # moe imports `dense` as a module, kda/mla/layers too: patching the module attribute reaches them all.


IN_KERNELS = [0.0]  # seconds inside the C kernels and torch's linear


def time_kernels() -> None:
    """Time every C kernel call (each ctypes function cpu_kernels binds from now on) and torch's
    linear into IN_KERNELS."""
    bind = cpu_kernels._function

    class Timed:
        def __init__(self, fn) -> None:
            object.__setattr__(self, "fn", fn)

        def __call__(self, *args):
            t0 = time.perf_counter()
            try:
                return self.fn(*args)
            finally:
                IN_KERNELS[0] += time.perf_counter() - t0

        def __getattr__(self, name: str):
            return getattr(self.fn, name)

        def __setattr__(self, name: str, value) -> None:  # restype, argtypes: the function's own
            setattr(self.fn, name, value)

    def timed_bind(library: str, name: str, argtypes: list):
        fn = bind(library, name, argtypes)
        return Timed(fn) if fn is not None else None

    cpu_kernels._function = timed_bind
    torch.nn.functional.linear = Timed(torch.nn.functional.linear)  # (F.linear is read at each call)


def main(argv: list[str] | None = None) -> int:
    ap = step_arguments(__doc__, 16)
    ap.add_argument("--aten-rows", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    time_kernels()  # before any kernel is bound (the getters keep what they bind)
    vocab = json.loads(args.config.read_text())["text_config"]["vocab_size"]
    llm = LLM(str(checkpoint(args.config)), dtype=args.dtype, skip_tokenizer_init=True,
              kv_cache_memory_bytes=1 << 30, max_num_batched_tokens=2048)
    label_everything()
    bw = read_bandwidth()
    print(f"## {args.config.name}, {args.dtype}, {args.threads} threads, load {os.getloadavg()[0]:.2f}; "
          f"read bandwidth baseline {bw / 1e9:.1f} GB/s (int64 sum of 256 MiB)")
    for b in args.batches:
        engine = decode_engine(llm, vocab, b)
        SELF.clear()
        BYTES.clear()
        IN_KERNELS[0] = 0.0
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        total = sum(times)
        kernels = IN_KERNELS[0]
        print(f"\n### batch {b}: median {statistics.median(times) * 1e3:.2f} ms/step, "
              f"min {min(times) * 1e3:.2f} (load {os.getloadavg()[0]:.2f})")
        print(f"in the C kernels and torch's linear {kernels / args.steps * 1e3:.2f} ms/step; the rest (Python, "
              f"dispatch, small torch ops) {(total - kernels) / args.steps * 1e3:.2f} ms/step = "
              f"{(total - kernels) / total:.0%}\n")
        print("| region (exclusive) | ms/step | share | weight MB/step | GB/s | of baseline |")
        print("|---|---|---|---|---|---|")
        for label, t in SELF.most_common():
            per = t / args.steps
            mb = BYTES[label] / args.steps / 1e6
            rate = f"{mb / 1e3 / per:.1f} | {mb * 1e6 / per / bw:.0%}" if mb else "- | -"
            print(f"| {label} | {per * 1e3:.2f} | {t / total:.0%} | {mb:.1f} | {rate} |")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(4):
                engine.step()
        print(f"\naten ops, 4 steps (self CPU):\n"
              f"{prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=args.aten_rows)}")
        for r in list(engine.scheduler.running):
            engine.abort_request(r.request_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
