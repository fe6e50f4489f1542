"""Bytes each rank hands to collectives per decode step, by layer type, counted against the
planner's estimate (``tidal.plan.comm``), in one command.

    python benchmarks/bench_parallel_comm.py                      # TP 2, TP 2 + DCP 2, TP 2 + EP 2
    python benchmarks/bench_parallel_comm.py --layouts 4x1x2 --batch 8

Every rank (a real process, gloo) loads its shard of the checkpoint (default: the embedded model)
and runs an engine in lockstep with the others; the rank's ``Collectives`` are wrapped in a
counter, and forward hooks on the embedding, each attention, MLP/MoE and lm_head name the layer
type a collective belongs to. After the prefills, ``--steps`` decode steps of ``--batch``
sequences are counted and averaged. Payload: the bytes of the tensor a rank passes in; wire: what
a ring algorithm would send per rank (2 (N-1)/N x payload for an all-reduce, (N-1) x for a gather).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

from tidal.embedded import embedded_model_dir
from tidal.model.checkpoint import read_config
from tidal.plan.comm import decode_bytes_by_layer_type, decode_collectives


def _label_hooks(model: torch.nn.Module, stack: list[str]) -> None:
    """Push a layer type on entry and pop it after every other forward hook (the sub-layer's
    all-reduce is one of them, registered before these)."""

    def mark(module: torch.nn.Module, name: str) -> None:
        def enter(*_: object) -> None:
            stack.append(name)

        def leave(*_: object) -> None:  # (a hook that returns something replaces the output)
            stack.pop()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)

    inner = model.model
    mark(inner.embed_tokens, "embedding")
    mark(model.lm_head, "lm_head")
    for i, layer in enumerate(inner.layers):
        mark(layer.self_attn, "kda" if model.config.is_kda_layer(i) else "mla")
        if hasattr(layer, "mlp"):
            mark(layer.mlp, "dense_mlp")
        else:
            mark(layer.block_sparse_moe, "moe")


def _count(comm, stack: list[str], counts: collections.Counter) -> None:
    """Wrap this rank's collectives: payload bytes per layer type (``_dcp`` for the DCP group's)."""
    reduce, gather = comm.all_reduce, comm.all_gather

    def label(dcp: bool) -> str:
        where = stack[-1] if stack else "other"
        return f"{where}_dcp" if dcp else where

    def all_reduce(x: torch.Tensor, dcp: bool = False) -> torch.Tensor:
        if (comm.place.dcp_size if dcp else comm.place.tp_size) > 1:
            counts[label(dcp)] += x.numel() * x.element_size()
        return reduce(x, dcp=dcp)

    def all_gather(x: torch.Tensor, dim: int, dcp: bool = False) -> torch.Tensor:
        if (comm.place.dcp_size if dcp else comm.place.tp_size) > 1:
            counts[label(dcp)] += x.numel() * x.element_size()
        return gather(x, dim, dcp=dcp)

    comm.all_reduce, comm.all_gather = all_reduce, all_gather


def _rank(place, comm, ckpt: str, batch: int, steps: int, dtype: str) -> dict:
    from tidal.config import parse_dtype
    from tidal.engine.core import EngineConfig, EngineCore
    from tidal.parallel.loader import load_rank_model
    from tidal.sampling_params import SamplingParams

    model = load_rank_model(ckpt, place, comm, parse_dtype(dtype)).eval()
    stack: list[str] = []
    counts: collections.Counter = collections.Counter()
    _label_hooks(model, stack)
    _count(comm, stack, counts)
    engine = EngineCore(model, EngineConfig(kv_cache_memory_bytes=64 << 20))
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    ids = min(1000, model.config.vocab_size - 10)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + 3 * t) % ids + 10 for t in range(20 + i)], params)
    started: set[str] = set()
    while len(started) < batch:  # prefills (one token out each)
        started.update(o.request_id for o in engine.step())
    counts.clear()
    for _ in range(steps):
        outs = engine.step()
        assert len(outs) == batch and not any(o.finished for o in outs), "a step that is not a full decode"
    return {k: v / steps for k, v in counts.items()}


def main() -> None:
    from tidal.parallel.launch import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--layouts", nargs="*", default=["2x1x1", "2x1x2", "2x2x1"], help="TPxEPxDCP")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    ckpt = args.model_dir or str(embedded_model_dir())
    config = read_config(Path(ckpt))
    width = 4 if args.dtype == "float32" else 2
    ok = True
    for lay in args.layouts:
        tp, ep, dcp = map(int, lay.split("x"))
        got = run_ranks(_rank, tp_size=tp, ep_size=ep, dcp_size=dcp, args=(ckpt, args.batch, args.steps, args.dtype),
                        timeout_s=1200)
        want = decode_bytes_by_layer_type(decode_collectives(config, tp_size=tp, dcp_size=dcp, batch_size=args.batch,
                                                             dtype_bytes=width))
        print(f"\nTP {tp} EP {ep} DCP {dcp}, decode step of {args.batch} sequences, {args.dtype} "
              f"({ckpt}): bytes per rank")
        print(f"{'layer type':<12}{'measured':>12}{'planner':>12}{'ratio':>8}{'wire (ring)':>14}")
        for kind in sorted(set(want) | {k for g in got for k in g}):
            m = [g.get(kind, 0.0) for g in got]
            p, wire = want.get(kind, (0, 0.0))
            same = all(x == m[0] for x in m)
            ok &= same and m[0] == p
            ratio = f"{m[0] / p:.3f}" if p else "-"
            print(f"{kind:<12}{m[0]:>12.0f}{p:>12d}{ratio:>8}{wire:>14.0f}" + ("" if same else f"  ranks differ: {m}"))
        total_m, total_p = sum(got[0].values()), sum(p for p, _ in want.values())
        print(f"{'total':<12}{total_m:>12.0f}{total_p:>12d}{total_m / max(total_p, 1):>8.3f}"
              f"{sum(w for _, w in want.values()):>14.0f}")
    print("\nmeasured == planner on every rank and layer type" if ok else "\nMISMATCH between measured and planner")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
