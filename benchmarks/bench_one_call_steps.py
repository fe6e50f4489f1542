"""Decode ms/step with the one-call steps on and off, alternated in one process.

    PYTHONPATH=. python benchmarks/bench_one_call_steps.py                  # batch 1, 8 and 32
    PYTHONPATH=. python benchmarks/bench_one_call_steps.py --batches 1 --rounds 16 --steps-of model

Two kinds of one-call step (``--steps-of``, both by default):

* ``layers``: ``tidal.ops.fused_decode.kda_layer_step`` (a bfloat16 KDA layer's whole decode step)
  and ``mlp_step`` (a gated MLP of a few bfloat16 rows); "off" runs the separate calls they replace.
  The whole-model call below is off in both settings (it runs the layer steps from C).
* ``model``: ``model_decode_step`` (a bfloat16 Block AttnRes model's whole decode step, its layers'
  one-call steps and the glue between them from C); "off" runs them one Python call each.

Either way the two settings give the same bits, and everything else (the other C kernels) is the
same in both. Each round takes a warm-up step and --steps timed steps of each setting in turn, so
the machine's drift hits both; the figure is the median step of each. Model: vs_llamacpp.py's 223M
checkpoint, bf16 trunk, B prefilled 128-token sequences (count_decode_ops.decode_engine). The load
average is printed with every row: the machine is shared.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import tidal  # noqa: F401  (first: its OpenMP wait policy must be set before torch loads libgomp)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from count_decode_ops import decode_engine, step_arguments  # noqa: E402
from vs_llamacpp import checkpoint  # noqa: E402

from tidal import LLM  # noqa: E402
from tidal.ops import fused_decode  # noqa: E402

# per kind: (what "off" turns off, what is off in both settings)
ONE_CALL = {"layers": (("kda_layer_step", "mlp_step"), ("model_decode_step",)),
            "model": (("model_decode_step",), ())}


def main(argv: list[str] | None = None) -> int:
    ap = step_arguments(__doc__, 6)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps-of", nargs="+", default=list(ONE_CALL), choices=list(ONE_CALL))
    ap.set_defaults(batches=[1, 8, 32])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    vocab = json.loads(args.config.read_text())["text_config"]["vocab_size"]
    llm = LLM(str(checkpoint(args.config)), dtype=args.dtype, skip_tokenizer_init=True,
              kv_cache_memory_bytes=1 << 30, max_num_batched_tokens=2048)
    real = {name: getattr(fused_decode, name) for toggled, off in ONE_CALL.values() for name in (*toggled, *off)}
    print(f"## {args.config.name}, {args.dtype}, {args.threads} threads, {args.rounds} rounds of {args.steps} steps")
    print("| one-call steps of | batch | separate calls ms/step | one-call steps ms/step | ratio | load |")
    print("|---|---|---|---|---|---|")
    for kind in args.steps_of:
        toggled, always_off = ONE_CALL[kind]
        for b in args.batches:
            engine = decode_engine(llm, vocab, b)
            times: dict[bool, list[float]] = {False: [], True: []}
            try:
                for name in always_off:
                    setattr(fused_decode, name, lambda *a: None)
                for _ in range(args.rounds):
                    for on in (False, True):
                        for name in toggled:
                            setattr(fused_decode, name, real[name] if on else (lambda *a: None))
                        engine.step()
                        for _ in range(args.steps):
                            t0 = time.perf_counter()
                            engine.step()
                            times[on].append(time.perf_counter() - t0)
            finally:
                for name, fn in real.items():
                    setattr(fused_decode, name, fn)
            off, on = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
            print(f"| {kind} | {b} | {off:.2f} | {on:.2f} | {off / on:.2f}x | {os.getloadavg()[0]:.2f} |")
            for r in list(engine.scheduler.running):
                engine.abort_request(r.request_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
