"""Report formats for a sweep: a rich terminal table, a Markdown table (the same cells), one JSONL
line per row, and a PNG with total and output throughput against the swept load."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.table import Table


def x_key(rows: Sequence[dict]) -> str:
    """The swept load: request rate when it varies across rows, else max concurrency."""
    rates = {str(r.get("request_rate")) for r in rows}
    return "request_rate" if len(rates) > 1 else "max_concurrency"


def load_label(row: dict, key: str) -> str:
    v = row.get(key)
    if v is None or (isinstance(v, float) and math.isinf(v)):
        return "inf"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _num(fmt: str) -> Callable[[object], str]:
    return lambda v: "-" if v is None else format(v, fmt)


def columns(rows: Sequence[dict]) -> list[tuple[str, Callable[[dict], str]]]:
    key = x_key(rows)
    cols: list[tuple[str, Callable[[dict], str]]] = [
        ("rate (req/s)" if key == "request_rate" else "concurrency", lambda r: load_label(r, key)),
        ("duration (s)", lambda r: _num(".1f")(r["duration"])),
        ("completed", lambda r: str(r["completed"])),
        ("failed", lambda r: str(r["failed"])),
    ]
    if any(r.get("cut") for r in rows):
        cols.append(("cut", lambda r: str(r["cut"])))
    cols += [
        ("output tok/s", lambda r: _num(".1f")(r["output_throughput"])),
        ("total tok/s", lambda r: _num(".1f")(r["total_throughput"])),
    ]
    for stat in ("ttft", "itl"):
        for q in ("median", "p90", "p99"):
            label = f"{stat.upper()} {'med' if q == 'median' else q} (ms)"
            cols.append((label, lambda r, k=f"{q}_{stat}_ms": _num(".1f")(r.get(k))))
    if any(r.get("spec_accept_length") is not None for r in rows):
        cols.append(("accept len", lambda r: _num(".2f")(r.get("spec_accept_length"))))
    if any(r.get("cache_hit_rate") is not None for r in rows):
        cols.append(("cache hit", lambda r: "-" if r.get("cache_hit_rate") is None else f"{r['cache_hit_rate']:.0%}"))
    return cols


def cells(rows: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    cols = columns(rows)
    return [h for h, _ in cols], [[f(r) for _, f in cols] for r in rows]


def error_lines(rows: Sequence[dict]) -> list[str]:
    key = x_key(rows)
    out = []
    for r in rows:
        if r.get("error_classes"):
            classes = ", ".join(f"{c}: {n}" for c, n in sorted(r["error_classes"].items()))
            example = next(iter(r.get("error_examples", {}).values()), "")
            out.append(f"{key}={load_label(r, key)} failed {classes}" + (f" (e.g. {example[:200]})" if example else ""))
    return out


def rich_table(rows: Sequence[dict], title: str = "") -> Table:
    headers, body = cells(rows)
    table = Table(title=title or None)
    for h in headers:
        table.add_column(h, justify="right")
    for line in body:
        table.add_row(*line)
    return table


def markdown(rows: Sequence[dict], title: str = "") -> str:
    headers, body = cells(rows)
    lines = [f"### {title}", ""] if title else []
    lines.append("| " + " | ".join(headers) + " |")
    lines.append("|" + "|".join("---:" for _ in headers) + "|")
    lines += ["| " + " | ".join(line) + " |" for line in body]
    errors = error_lines(rows)
    if errors:
        lines += [""] + [f"- {e}" for e in errors]
    return "\n".join(lines) + "\n"


def write_jsonl(rows: Sequence[dict], path: str | Path) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r, default=_json_default) + "\n" for r in rows)


def _json_default(v: object) -> object:
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if hasattr(v, "item"):
        return v.item()
    raise TypeError(f"not JSON serializable: {type(v).__name__}")


def plot_throughput(rows: Sequence[dict], path: str | Path, title: str = "") -> None:
    """Two panels, total and output tok/s against the swept load (one point per row)."""
    from matplotlib.figure import Figure

    key = x_key(rows)
    labels = [load_label(r, key) for r in rows]
    numeric = all(lab != "inf" for lab in labels)
    xs = [float(lab) for lab in labels] if numeric else list(range(len(rows)))
    fig = Figure(figsize=(11, 4.2), dpi=110)
    for ax, (name, k) in zip(fig.subplots(1, 2), (("total", "total_throughput"), ("output", "output_throughput"))):
        ax.plot(xs, [r[k] for r in rows], marker="o")
        ax.set_xlabel("request rate (req/s)" if key == "request_rate" else "max concurrency")
        ax.set_ylabel(f"{name} throughput (tok/s)")
        ax.set_title(f"{name} tok/s")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        if not numeric:
            ax.set_xticks(xs, labels)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
