"""The plan as a terminal table and as stable JSON."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from tidal.plan.layout import (
    GIB,
    SNAPSHOT_KV_FRACTION,
    _gib,
    _mib,
)
from tidal.plan.planner import Plan
from tidal.plan.sglang import SGLangSplit, Workload

# ---- output --------------------------------------------------------------------------------------


def plan_to_json(p: Plan) -> dict[str, Any]:
    """The stable interface scripts read: top-level numbers follow ``engine``; inputs are echoed."""
    lay = p.layout
    out: dict[str, Any] = {
        "model": p.model,
        "engine": p.engine,
        "inputs": {
            "gpu_memory_gib": p.gpu_memory_bytes / GIB if p.gpu_memory_bytes is not None else None,
            "num_gpus": p.parallel.num_gpus,
            "tp_size": p.parallel.tp_size,
            "dcp_size": p.parallel.dcp_size,
            "ep_size": p.parallel.ep_size,
            "mem_fraction_static": p.mem_fraction_static,
            "kv_dtype": p.kv_dtype,
            "page_size": p.page_size,
            "spec_draft_tokens": p.spec_draft_tokens,
            "reserve_bytes": p.reserve_bytes,
            "workload": asdict(p.workload) if p.workload else None,
            **(p.sglang_inputs or {}),
        },
        "weights_bytes_per_rank": p.weights_bytes_per_rank,
        "weights_measured": p.weights_measured,
        "weights_total_bytes": sum(w.total_bytes for w in p.weights),
        "weights_by_kind": {
            w.kind: {"per_rank_bytes": w.per_rank_bytes, "total_bytes": w.total_bytes, "sharding": w.sharding}
            for w in p.weights
        },
        "pool_bytes_per_rank": p.pool_bytes,
        "kda_state_bytes_per_request_per_rank": p.kda_state_bytes_per_request,
        "mla_kv_bytes_per_token_per_rank": p.mla_kv_bytes_per_token,
        "prefix_snapshot_interval": p.prefix_snapshot_interval,
        "kv_tokens_per_rank": p.kv_tokens_per_rank,
        "kv_tokens_logical": p.kv_tokens_logical,
        "state_slots": p.state_slots,
        "max_running_requests": p.max_running_requests,
        "max_context_len": p.max_context_len,
        "tidal_pool": {
            "page_size": lay.page_size,
            "page_bytes": lay.page_bytes,
            "pages_per_block": lay.pages_per_block,
            "block_bytes": lay.block_bytes,
            "num_blocks": lay.num_blocks,
            "state_blocks_per_request": lay.state_blocks_per_request,
            "kv_tokens_per_rank": lay.kv_tokens_per_rank,
            "kv_tokens_logical": lay.kv_tokens_logical,
            "max_context_len": min(lay.max_context_len(), p.max_position_embeddings),
            "max_requests_for_workload": lay.max_requests(p.workload.context_len) if p.workload else None,
        },
        "sglang": _split_json(p.sglang),
        "recommendation": None,
        "decode_comm_bytes_per_sequence": {
            kind: {"payload_bytes": payload, "wire_bytes": wire} for kind, (payload, wire) in p.decode_comm.items()
        },
    }
    if p.recommendation:
        r = p.recommendation
        out["recommendation"] = {
            "mamba_full_memory_ratio": r.ratio,
            "ratio_min": r.ratio_min,
            "ratio_max": r.ratio_max,
            "state_bytes_needed": r.state_bytes_needed,
            "kv_bytes_needed": r.kv_bytes_needed,
            "reason": r.reason,
            "sglang_at_ratio": _split_json(r.sglang),
            "tidal_max_requests": r.tidal_max_requests,
            "tidal_max_context_len": min(r.tidal_max_context_len, p.max_position_embeddings),
        }
    return out


def _split_json(s: SGLangSplit | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {**asdict(s), "kv_tokens_logical": s.kv_tokens_logical, "max_context_len": s.max_context_len()}




def plan_table(p: Plan, width: int = 100) -> str:
    """The plan as rich tables, rendered to plain text."""
    import io

    from rich.console import Console
    from rich.table import Table

    console = Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None)
    par = p.parallel
    where = f"{par.num_gpus} GPU(s)" if p.device is None or p.device.startswith("cuda") else p.device
    head = (
        f"tidal plan: {p.model} | {where}, TP {par.tp_size}, DCP {par.dcp_size}, EP {par.ep_size} | "
        f"KV {p.kv_dtype}, page {p.page_size}" + (f", {p.spec_draft_tokens} draft tokens" if p.spec_draft_tokens else "")
    )
    console.print(head)

    w = Table(title="weights per rank")
    for col in ("kind", "sharding", "per rank", "whole model"):
        w.add_column(col, justify="left" if col in ("kind", "sharding") else "right")
    for s in p.weights:
        w.add_row(s.kind, s.sharding, _gib(s.per_rank_bytes), _gib(s.total_bytes))
    formula_rank, formula_model = sum(s.per_rank_bytes for s in p.weights), sum(s.total_bytes for s in p.weights)
    if p.weights_measured:
        # the rows above are the formula's (checkpoint dtype); the loaded weights are measured per rank,
        # and on one rank that is the whole model
        one_rank = par.tp_size == 1 and par.ep_size == 1
        w.add_row("total (formula)", "checkpoint dtype", _gib(formula_rank), _gib(formula_model))
        w.add_row("total (measured)", "as loaded", _gib(p.weights_bytes_per_rank),
                  _gib(p.weights_bytes_per_rank) if one_rank else "-")
    else:
        w.add_row("total", "formula", _gib(formula_rank), _gib(formula_model))
    console.print(w)

    m = Table(title="memory per rank")
    m.add_column("item")
    m.add_column("value", justify="right")
    if p.gpu_memory_bytes is not None:
        static = p.gpu_memory_bytes * p.mem_fraction_static
        m.add_row(f"GPU x mem_fraction_static {p.mem_fraction_static:g}", _gib(static))
        m.add_row("- weights", _gib(p.weights_bytes_per_rank))
        m.add_row("- workspace reserve", _gib(p.reserve_bytes))
    m.add_row("= pool (state + KV)", _gib(p.pool_bytes))
    m.add_row("KDA state per request", f"{_mib(p.kda_state_bytes_per_request)} ({p.kda_state_bytes_per_request:,} B)")
    m.add_row("MLA KV per stored token", f"{p.mla_kv_bytes_per_token:,} B")
    m.add_row(f"prefix snapshot interval (KV >= {SNAPSHOT_KV_FRACTION:g} x state)",
              f"{p.prefix_snapshot_interval:,} tokens")
    console.print(m)

    lay = p.layout
    t = Table(title="tidal single pool" + (" (same memory)" if p.engine == "sglang" else ""))
    t.add_column("item")
    t.add_column("value", justify="right")
    block = f"{lay.pages_per_block} pages of {lay.page_size} tokens, {_mib(lay.block_bytes)}"
    t.add_row("block = one request's state", block)
    t.add_row("blocks (= state slots)", f"{lay.num_blocks:,}")
    t.add_row("KV tokens per rank (pool all KV)", f"{lay.kv_tokens_per_rank:,}")
    t.add_row(f"KV tokens logical (DCP {lay.dcp_size})", f"{lay.kv_tokens_logical:,}")
    t.add_row("longest single context", f"{min(lay.max_context_len(), p.max_position_embeddings):,}")
    if p.workload:
        t.add_row(f"requests of {p.workload.context_len:,} tokens", f"{lay.max_requests(p.workload.context_len):,}")
    else:
        t.add_row("max running requests (1-token contexts)", f"{lay.max_requests(1):,}")
    if p.running_cap is not None:
        t.add_row("--max-running-requests caps the running set at", f"{p.running_cap:,}")
    console.print(t)

    if p.decode_comm:
        console.print(_comm_table(p))

    if p.sglang:
        console.print(_split_table(p.sglang, f"SGLang split, R = {p.sglang.ratio:g}", p.workload))
    r = p.recommendation
    if r:
        wl = r.workload
        line = f"workload isl={wl.isl} osl={wl.osl} concurrency={wl.concurrency}: "
        if r.ratio is not None:
            line += f"SGLang needs --mamba-full-memory-ratio {r.ratio:g} ({r.reason})"
        else:
            line += f"SGLang cannot serve it: {r.reason}"
        line += f"; tidal's pool runs {r.tidal_max_requests:,} such requests"
        console.print(line)
        if r.sglang is not None and (p.sglang is None or r.sglang.ratio != p.sglang.ratio):
            console.print(_split_table(r.sglang, f"SGLang split at recommended R = {r.ratio:g}", wl))
    return console.file.getvalue()


def _comm_table(p: Plan):
    """Bytes one rank hands to collectives per decode step, by layer type (tidal.plan.comm)."""
    from rich.table import Table

    t = Table(title="collectives per decode step and sequence, per rank",
              caption="a decode step of B sequences hands B x these bytes to its collectives")
    for col in ("layer type", "payload", "ring wire"):
        t.add_column(col, justify="left" if col == "layer type" else "right")
    for kind, (payload, wire) in p.decode_comm.items():
        t.add_row(kind, f"{payload:,} B", f"{wire:,.0f} B")
    t.add_row("total", f"{sum(v[0] for v in p.decode_comm.values()):,} B",
              f"{sum(v[1] for v in p.decode_comm.values()):,.0f} B")
    return t


def _split_table(s: SGLangSplit, title: str, workload: Workload | None):
    from rich.table import Table

    t = Table(title=title)
    t.add_column("step")
    t.add_column("value", justify="right")
    t.add_row("1 rest after weights", _gib(s.rest_bytes))
    t.add_row("3 state budget rest*R/(1+R)", _gib(s.state_budget_bytes))
    t.add_row("3 state slots", f"{s.state_slots:,}")
    if s.spec_draft_tokens:
        t.add_row("4 speculative scratch", _gib(s.spec_scratch_bytes))
    t.add_row("5 KV tokens per rank", f"{s.kv_tokens_per_rank:,}")
    t.add_row(f"5 KV tokens logical (DCP {s.dcp_size})", f"{s.kv_tokens_logical:,}")
    t.add_row(f"6 max running requests ({s.slots_per_request} slots each)", f"{s.max_running_requests:,}")
    if workload:
        t.add_row(f"requests of {workload.context_len:,} tokens", f"{s.max_requests(workload.context_len):,}")
    return t
