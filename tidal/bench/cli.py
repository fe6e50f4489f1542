"""``tidal bench``: a serving benchmark for any OpenAI-compatible server (tidal, vLLM, SGLang).

One command runs a sweep (one row per --max-concurrency / --request-rate value) and writes a
terminal table, PREFIX.jsonl (one line per row, SGLang bench_serving key names), PREFIX.md and
PREFIX.png (total and output throughput against the swept load)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from tidal.bench import report
from tidal.bench.client import OpenAIClient, root_url
from tidal.bench.datasets import (
    BenchRequest,
    load_mooncake,
    random_requests,
    trace_requests,
)
from tidal.bench.load import RowRun, arrival_times, run_closed_loop, run_open_loop
from tidal.bench.metrics import summarize
from tidal.bench.multiturn import AgentConfig, AgentWorkload, measure_chars_per_token
from tidal.bench.tokenizer import BenchTokenizer, ServerTokenizer, load_local_tokenizer


def _int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _rate_list(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is accepted)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token (default $OPENAI_API_KEY)")
    g.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    g.add_argument("--endpoint", choices=["chat", "completions"], default=None,
                   help="default: completions, chat for multiturn")
    g.add_argument("--header", action="append", default=[], metavar="K=V", help="extra HTTP header (repeatable)")
    g.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for /v1/models to answer")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=["random", "multiturn", "trace"], default="random")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests per row (random: 200; trace: the whole file)")
    g.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens")
    g.add_argument("--output-len", type=int, default=None,
                   help="random: max tokens (default 1024); multiturn: median tokens per turn (default 220)")
    g.add_argument("--range-ratio", type=float, default=None, help="random: length spread (default: exact lengths)")
    g.add_argument("--range-semantics", choices=["sglang", "vllm"], default="sglang",
                   help="sglang: lengths in [L*r, L]; vllm: lengths in [L*(1-r), L*(1+r)]")
    g.add_argument("--prompt-format", choices=["text", "ids"], default=None,
                   help="text re-encoded to exact length, or token ids (completions only); default: text when a "
                        "tokenizer is known, else ids")
    g.add_argument("--tokenizer", default=None,
                   help="model dir or file (tokenizer.json / tiktoken.model); default: the server's /tokenize")
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--trace-file", default=None, help="trace: Mooncake JSONL (timestamp, input_length, ...)")
    g.add_argument("--trace-block-size", type=int, default=512, help="trace: tokens per hash_ids block")
    g.add_argument("--trace-time-scale", type=float, default=1.0, help="trace: multiply timestamps (2 = half speed)")
    g.add_argument("--system-len", type=int, default=4000, help="multiturn: shared system prompt tokens")
    g.add_argument("--tool-result-len", type=int, default=500, help="multiturn: median tool-result tokens")
    g.add_argument("--task-len", type=int, default=150, help="multiturn: median tokens of a session's first message")
    g.add_argument("--turns", default="10,40", help="multiturn: MIN,MAX turns per session")
    g.add_argument("--tools", type=int, default=8, help="multiturn: tools in the shared tool list (0 sends none)")
    g.add_argument("--max-context", type=int, default=None,
                   help="multiturn: end a session before this many tokens (default: the server's max_model_len)")
    g = p.add_argument_group("load")
    g.add_argument("--max-concurrency", type=_int_list, default=None,
                   help="comma list, one row each (multiturn: the number of session lanes)")
    g.add_argument("--request-rate", type=_rate_list, default=None,
                   help="comma list of req/s (default inf; trace: the trace's own timestamps)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    g.add_argument("--max-duration", type=float, default=None,
                   help="seconds per row; in-flight requests at the end are cut (multiturn default 300)")
    g.add_argument("--warmup-requests", type=int, default=1, help="sent once before the sweep, not measured")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds")
    g.add_argument("--flush-cache", action="store_true",
                   help="POST /flush_cache (SGLang) or /reset_prefix_cache (vLLM) before each row")
    g = p.add_argument_group("request")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    g.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    g = p.add_argument_group("output")
    g.add_argument("--output", default=None, help="file prefix (default tidal-bench-DATASET-TIME)")
    g.add_argument("--title", default=None)
    g.add_argument("--output-details", action="store_true", help="per-request arrays in the JSONL rows")
    g.add_argument("--itl", choices=("chunk", "token"), default="chunk",
                   help="chunk: one ITL per streamed chunk (SGLang's and vLLM's OpenAI clients); "
                        "token: a chunk's gap spread over its tokens")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    return p


class BenchError(Exception):
    """A run that cannot go on: the server is not there, or the warm-up failed."""


@dataclass
class Server:
    root: str
    headers: dict[str, str]
    model: str
    max_model_len: int | None


def wait_ready(root: str, headers: dict[str, str], model: str | None, timeout: float) -> Server:
    """Poll /v1/models until it answers; the model defaults to its first entry."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            r = httpx.get(f"{root}/v1/models", headers=headers, timeout=10)
            if r.status_code == 200:
                data = r.json().get("data") or []
                entry = next((d for d in data if d.get("id") == model), data[0] if data else {})
                name = model or entry.get("id")
                if not name:
                    raise BenchError(f"{root}/v1/models lists no model; pass --model")
                return Server(root, headers, name, entry.get("max_model_len"))
            last = f"HTTP {r.status_code}"
        except (httpx.HTTPError, ValueError) as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise BenchError(f"{root} not ready after {timeout:g} s ({last})")
        time.sleep(1.0)


def pick_tokenizer(args: argparse.Namespace, server: Server, console: Console) -> BenchTokenizer | None:
    if args.tokenizer:
        tok = load_local_tokenizer(args.tokenizer)
    else:
        tok = ServerTokenizer.probe(server.root, server.model, server.headers)
    console.print(f"tokenizer: {tok.name if tok else 'none (token-id prompts on /v1/completions)'}")
    return tok


def flush_cache(server: Server, console: Console) -> None:
    for route in ("/flush_cache", "/reset_prefix_cache"):
        try:
            r = httpx.post(f"{server.root}{route}", headers=server.headers, timeout=300)
        except httpx.HTTPError:
            continue
        if r.status_code == 200:
            return
    console.print("[yellow]--flush-cache: the server has neither /flush_cache nor /reset_prefix_cache[/]")


def row_config(args: argparse.Namespace, server: Server, tok: BenchTokenizer | None, endpoint: str, fmt: str,
               conc: int | None, rate: float | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "backend": "tidal-bench", "base_url": server.root, "endpoint": endpoint, "model_id": server.model,
        "tokenizer": tok.name if tok else None, "dataset_name": args.dataset, "prompt_format": fmt,
        "request_rate": "trace" if rate is None else ("inf" if math.isinf(rate) else rate),
        "burstiness": args.burstiness, "max_concurrency": conc, "seed": args.seed,
        "max_duration": args.max_duration, "timeout": args.timeout, "warmup_requests": args.warmup_requests,
        "ignore_eos": not args.disable_ignore_eos, "temperature": args.temperature,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if args.dataset == "random":
        cfg.update(num_prompts=args.num_prompts, random_input_len=args.input_len, random_output_len=args.output_len,
                   random_range_ratio=args.range_ratio, range_semantics=args.range_semantics)
    elif args.dataset == "trace":
        cfg.update(num_prompts=args.num_prompts, trace_file=args.trace_file, trace_block_size=args.trace_block_size,
                   trace_time_scale=args.trace_time_scale)
    else:
        cfg.update(system_len=args.system_len, tool_result_len=args.tool_result_len, task_len=args.task_len,
                   turns=args.turns, tools=args.tools, output_len=args.output_len, max_context=args.max_context)
    if args.title:
        cfg["tag"] = args.title
    return cfg


class Workload:
    """Builds each row's requests (or sessions) with its own salt, and the warm-up requests."""

    def __init__(self, args: argparse.Namespace, tok: BenchTokenizer | None, fmt: str, server: Server) -> None:
        self.args, self.tok, self.fmt = args, tok, fmt
        self.trace = load_mooncake(args.trace_file, args.num_prompts) if args.dataset == "trace" else None
        if args.dataset == "multiturn":
            lo, hi = _int_list(args.turns)
            self.agent = AgentConfig(system_len=args.system_len, tool_result_len=args.tool_result_len,
                                     task_len=args.task_len, output_len=args.output_len, turns=(lo, hi),
                                     num_tools=args.tools,
                                     max_context=args.max_context or server.max_model_len or 131072,
                                     chars_per_token=measure_chars_per_token(tok, args.seed))

    def requests(self, salt: int, n: int | None = None) -> list[BenchRequest]:
        a = self.args
        if a.dataset == "random":
            return random_requests(n or a.num_prompts, a.input_len, a.output_len, tokenizer=self.tok,
                                   range_ratio=a.range_ratio, semantics=a.range_semantics, fmt=self.fmt,
                                   seed=a.seed, salt=salt)
        if a.dataset == "trace":
            entries = self.trace[:n] if n else self.trace
            return trace_requests(entries, tokenizer=self.tok, block_size=a.trace_block_size, fmt=self.fmt,
                                  seed=a.seed, salt=salt, time_scale=a.trace_time_scale)
        w = self.sessions(salt)
        return [w.new_session().next_request() for _ in range(n or 1)]

    def sessions(self, salt: int) -> AgentWorkload:
        return AgentWorkload(self.agent, seed=self.args.seed, salt=salt)


def _progress(console: Console, disable: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=disable, transient=False)


async def run_row(client: OpenAIClient, work: Workload, salt: int, conc: int | None, rate: float | None,
                  progress: Progress, label: str) -> RowRun:
    a = work.args
    if a.dataset == "multiturn":
        sessions = work.sessions(salt)
        task = progress.add_task(f"{label} (s)", total=int(a.max_duration))
        done = 0

        def on_done(_rec: object) -> None:
            nonlocal done
            done += 1

        async def tick() -> None:
            start = time.perf_counter()
            while True:
                progress.update(task, completed=min(int(time.perf_counter() - start), int(a.max_duration)),
                                description=f"{label}: {done} turns")
                await asyncio.sleep(0.5)

        ticker = asyncio.create_task(tick())
        try:
            run = await run_closed_loop(sessions.new_session, client.send, lanes=conc or 1,
                                        max_duration=a.max_duration, on_done=on_done)
        finally:
            ticker.cancel()
        progress.update(task, completed=int(a.max_duration), description=f"{label}: {done} turns")
        return run
    reqs = work.requests(salt)
    if rate is None:
        arrivals = [r.arrival or 0.0 for r in reqs]
    else:
        arrivals = arrival_times(len(reqs), rate, a.burstiness, seed=a.seed + salt)
    task = progress.add_task(label, total=len(reqs))
    return await run_open_loop(reqs, arrivals, client.send, max_concurrency=conc, max_duration=a.max_duration,
                               on_done=lambda _r: progress.advance(task))


def spec_counts(server: Server) -> tuple[int, int] | None:
    """(verified chains, tokens they committed) from the server's /server_info (tidal's engine
    counters); None when the server does not report speculation."""
    try:
        r = httpx.get(f"{server.root}/server_info", headers=server.headers, timeout=10)
        engine = (r.json().get("engine") or {}) if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return None
    counts = engine.get("spec_accept_length_counts")
    if not counts:
        return None
    return int(engine.get("spec_num_chains", 0)), sum(n * c for n, c in enumerate(counts))


async def run_sweep(args: argparse.Namespace, server: Server, tok: BenchTokenizer | None, endpoint: str, fmt: str,
                    loads: list[tuple[int | None, float | None]], console: Console) -> list[dict]:
    work = Workload(args, tok, fmt, server)
    counter = getattr(tok, "chunk_token_counts", None)
    rows = []
    async with OpenAIClient(server.root, server.model, endpoint=endpoint, api_key=args.api_key, timeout=args.timeout,
                            ignore_eos=not args.disable_ignore_eos, temperature=args.temperature,
                            extra_body=args.extra_body, headers=server.headers) as client:
        if args.warmup_requests > 0:
            warm = work.requests(salt=0, n=args.warmup_requests)
            for r in warm:
                r.output_len = min(r.output_len, 32)
            recs = await asyncio.gather(*(client.send(r) for r in warm))
            bad = [r for r in recs if not r.ok]
            if bad:
                raise BenchError(f"warm-up failed ({bad[0].error_class}: {bad[0].error})")
        with _progress(console, args.no_progress) as progress:
            for i, (conc, rate) in enumerate(loads):
                if args.flush_cache:
                    flush_cache(server, console)
                label = f"concurrency {conc if conc else 'inf'}" + (f", rate {rate:g}" if rate is not None else "")
                before = spec_counts(server)
                run = await run_row(client, work, i + 1, conc, rate, progress, label)
                row = row_config(args, server, tok, endpoint, fmt, conc, rate)
                row.update(summarize(run.records, run.duration, cut=run.cut, row_start=run.start, counter=counter,
                                     details=args.output_details, itl_rule=args.itl))
                after = spec_counts(server)
                if before is not None and after is not None and after[0] > before[0]:
                    # SGLang's avg_spec_accept_length over this row's chains
                    row["spec_accept_length"] = (after[1] - before[1]) / (after[0] - before[0])
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (BenchError, OSError, ValueError) as e:
        print(f"tidal bench: {e}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    headers = dict(h.split("=", 1) for h in args.header)
    if args.dataset == "trace" and not args.trace_file:
        print("tidal bench: --dataset trace needs --trace-file", file=sys.stderr)
        return 2
    if args.dataset == "multiturn":
        if args.request_rate:
            print("tidal bench: multiturn is a closed loop; use --max-concurrency for the number of sessions",
                  file=sys.stderr)
            return 2
        args.max_duration = args.max_duration or 300.0
        args.output_len = args.output_len or 220
    else:
        args.output_len = args.output_len or 1024
        if args.dataset == "random":
            args.num_prompts = args.num_prompts or 200
    endpoint = args.endpoint or ("chat" if args.dataset == "multiturn" else "completions")
    if args.dataset == "multiturn" and endpoint != "chat":
        print("tidal bench: multiturn needs --endpoint chat", file=sys.stderr)
        return 2

    server = wait_ready(root_url(args.base_url), headers, args.model, args.ready_timeout)
    tok = pick_tokenizer(args, server, console)
    fmt = args.prompt_format or ("text" if tok is not None else "ids")
    if args.dataset != "multiturn" and fmt == "ids" and endpoint == "chat":
        print("tidal bench: the chat endpoint needs text prompts: pass --tokenizer (the server has no /tokenize)",
              file=sys.stderr)
        return 2
    default_rate = None if args.dataset == "trace" else math.inf
    loads = list(itertools.product(args.max_concurrency or [None], args.request_rate or [default_rate]))

    try:
        rows = asyncio.run(run_sweep(args, server, tok, endpoint, fmt, loads, console))
    finally:
        if isinstance(tok, ServerTokenizer):
            tok.close()

    title = args.title or describe(args, server)
    out = Console()
    if not out.is_terminal:  # a pipe or file: do not squeeze the table into 80 columns
        out = Console(width=240)
    out.print(report.rich_table(rows, title))
    for line in report.error_lines(rows):
        console.print(f"[red]{line}[/]")
    prefix = args.output or f"tidal-bench-{args.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    report.write_jsonl(rows, f"{prefix}.jsonl")
    with open(f"{prefix}.md", "w") as f:
        f.write(report.markdown(rows, title))
    written = [f"{prefix}.jsonl", f"{prefix}.md"]
    if not args.no_plot:
        report.plot_throughput(rows, f"{prefix}.png", title)
        written.append(f"{prefix}.png")
    console.print("wrote " + ", ".join(written))
    return 0


def describe(args: argparse.Namespace, server: Server) -> str:
    if args.dataset == "random":
        spread = "" if args.range_ratio is None else f" (range {args.range_ratio:g}, {args.range_semantics})"
        what = f"random {args.input_len} in / {args.output_len} out{spread}, {args.num_prompts} prompts per row"
    elif args.dataset == "trace":
        what = f"trace {os.path.basename(args.trace_file)}"
    else:
        what = f"multiturn coding agent, {args.max_duration:g} s per row"
    return f"{server.model}: {what}"


if __name__ == "__main__":
    sys.exit(main())
