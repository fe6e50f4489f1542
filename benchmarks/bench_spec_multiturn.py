"""Speculative decoding on the multi-turn agent workload, through live servers: ``tidal serve`` on
the embedded model without speculation, with NGRAM and with the shipped DSPARK drafter (one at a
time, on 127.0.0.1), each loaded by the same ``tidal bench --dataset multiturn`` run; prints each
server's output tok/s, its ratio to the plain server's, and the accept length the bench reads from
/server_info (committed tokens per verified chain, SGLang's avg_spec_accept_length).

    python benchmarks/bench_spec_multiturn.py [--concurrency 1] [--duration 60] [--k K] [--dspark-k K]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DRAFTER = ROOT / "tidal" / "assets" / "embedded-dspark"


def serve(flags: list[str]) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "serve", "--port", str(port), "--log-level",
                             "warning", *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"tidal serve {' '.join(flags)} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("tidal serve did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per server")
    ap.add_argument("--k", type=int, default=None, help="NGRAM's drafted tokens (default: the engine's)")
    ap.add_argument("--dspark-k", type=int, default=None, help="DSPARK's block size (default: --k, else the engine's)")
    ap.add_argument("--system-len", type=int, default=300)
    ap.add_argument("--tool-result-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--tools", type=int, default=0, help="tools declared (a tool grammar constrains replies: no speculation)")
    args = ap.parse_args()
    from tidal.bench.cli import main as bench

    settings = {
        "plain": [],
        "NGRAM": ["--speculative-algorithm", "NGRAM", *(["--speculative-num-draft-tokens", str(args.k)] if args.k else [])],
        "DSPARK": ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(DRAFTER),
                   *(["--speculative-dspark-block-size", str(args.dspark_k or args.k)] if args.dspark_k or args.k
                     else [])],
    }
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in settings.items():
            proc, url = serve(flags)
            try:
                out = Path(tmp) / name
                bench(["--base-url", url, "--dataset", "multiturn", "--max-concurrency", args.concurrency,
                       "--max-duration", str(args.duration), "--system-len", str(args.system_len),
                       "--tool-result-len", str(args.tool_result_len), "--output-len", str(args.output_len),
                       "--turns", "3,6", "--tools", str(args.tools), "--task-len", "40", "--output", str(out), "--no-progress",
                       "--no-plot"])
                rows[name] = [json.loads(line) for line in open(f"{out}.jsonl")]
            finally:
                proc.terminate()
                proc.wait(30)
    ks = f"k={args.k or 'default'}, DSPARK k={args.dspark_k or args.k or 'default'}"
    print(f"multiturn, embedded model, {ks}, {args.duration:g} s per server; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'server':7} {'conc':>4} {'done':>5} {'out tok/s':>10} {'ratio':>6} {'TPOT ms':>8} {'accept len':>10}")
    for name, rs in rows.items():
        for r, base in zip(rs, rows["plain"]):
            accept = r.get("spec_accept_length")
            print(f"{name:7} {r['max_concurrency']:>4} {r['completed']:>5} {r['output_throughput']:>10.1f} "
                  f"{r['output_throughput'] / base['output_throughput']:>6.2f} {r.get('mean_tpot_ms', 0):>8.1f} "
                  f"{'-' if accept is None else f'{accept:.2f}':>10}")


if __name__ == "__main__":
    main()
