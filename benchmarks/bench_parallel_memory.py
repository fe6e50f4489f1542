"""Per-rank memory and the longest context at TP 1, TP 2 and TP 2 + DCP 2 (and any --layouts), the
planner's figures against what the running engine's ranks allocated, in one command.

    python benchmarks/bench_parallel_memory.py
    python benchmarks/bench_parallel_memory.py --kv-cache-memory-bytes 8MiB --layouts 1x1 2x2 4x4

Each layout gets the same pool per rank (--kv-cache-memory-bytes). Planner: ``plan_for_pool`` and
``weight_breakdown`` from the config alone. Engine: ``LLM(tp_size=, dcp_size=)``; each rank process
reports the bytes of its weights and pool storage and the KV rows its pool holds
(``RankWorkers.memory``; at TP 1 the in-process worker). The longest context is then run: a prompt
of the engine's longest request minus one token, generating one token, must complete, and one more
token must be refused before it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from tidal import LLM, SamplingParams
from tidal.embedded import embedded_model_dir
from tidal.engine.core import model_bytes
from tidal.model.checkpoint import read_config
from tidal.plan.planner import plan_for_pool
from tidal.plan.weights import weight_breakdown
from tidal.serve.cli import parse_bytes


def engine_figures(llm: LLM) -> list[tuple[int, int, int]]:
    """(weight bytes, pool bytes, KV rows) per rank, as the ranks allocated them."""
    if llm.workers is not None:
        return [(m.weight_bytes, m.pool_bytes, m.kv_tokens) for m in llm.workers.memory]
    w = llm.engine.worker
    buf = w.storage.buffer
    return [(model_bytes(w.model), buf.numel() * buf.element_size(), w.storage.kv_token_rows)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=parse_bytes("4MiB"), help="pool per rank")
    ap.add_argument("--layouts", nargs="*", default=["1x1", "2x1", "2x2"], help="TPxDCP")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip-run", action="store_true", help="do not run the longest context")
    args = ap.parse_args()
    ckpt = Path(args.model_dir or embedded_model_dir())
    config = read_config(ckpt)
    dtype = getattr(torch, args.dtype)
    rows, ok = [], True
    for lay in args.layouts:
        tp, dcp = map(int, lay.split("x"))
        plan = plan_for_pool(config, args.kv_cache_memory_bytes, tp_size=tp, dcp_size=dcp, dtype=dtype)
        as_run = dataclasses.replace(config, torch_dtype=args.dtype)  # weights in the engine's dtype
        planned = (sum(s.per_rank_bytes for s in weight_breakdown(as_run, tp_size=tp)),
                   plan.layout.num_blocks * plan.layout.block_bytes, plan.kv_tokens_per_rank)
        llm = LLM(str(ckpt), dtype=args.dtype, kv_cache_memory_bytes=args.kv_cache_memory_bytes, tp_size=tp,
                  dcp_size=dcp, skip_tokenizer_init=True)
        try:
            got = engine_figures(llm)
            longest = llm.engine.max_request_len
            agree = all(g == planned for g in got) and longest == min(plan.max_context_len, llm.engine.max_model_len)
            ran = "skipped"
            if not args.skip_run:
                t0 = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": [(5 * i) % 1000 + 10 for i in range(longest - 1)]}],
                                   SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
                fits = len(out[0].outputs[0].token_ids) == 1
                try:
                    llm.generate([{"prompt_token_ids": [10] * longest}], SamplingParams(max_tokens=1))
                    refused = False
                except ValueError:
                    refused = True
                ran = f"{'ran' if fits else 'FAILED'} in {time.perf_counter() - t0:.1f} s, +1 {'refused' if refused else 'ACCEPTED'}"
                agree &= fits and refused
        finally:
            llm.close()
        ok &= agree
        rows.append((tp, dcp, planned, got, plan.kv_tokens_logical, plan.max_context_len, longest, ran, agree))
    print(f"\n{ckpt}, {args.dtype}, pool {args.kv_cache_memory_bytes / 2**20:.2f} MiB per rank")
    print(f"{'TP':>3}{'DCP':>4}  {'weights/rank':>14}{'pool/rank':>12}{'KV rows/rank':>13}{'logical KV':>11}"
          f"{'longest (plan)':>15}{'longest (engine)':>17}  agree  longest-context run")
    for tp, dcp, planned, got, logical, plan_longest, longest, ran, agree in rows:
        w, p, kv = planned
        engine = "" if all(g == planned for g in got) else f"  engine ranks: {got}"
        print(f"{tp:>3}{dcp:>4}  {w / 2**20:>11.2f} MiB{p / 2**20:>8.2f} MiB{kv:>13}{logical:>11}{plan_longest:>15}"
              f"{longest:>17}  {'yes' if agree else 'NO':>5}  {ran}{engine}")
    base = next((r for r in rows if r[0] == 1 and r[1] == 1), None)
    if base is not None:
        for tp, dcp, *_, longest, _, _ in rows:
            if (tp, dcp) != (1, 1):
                print(f"TP {tp} DCP {dcp}: longest context {longest / base[6]:.2f} x TP 1's")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
