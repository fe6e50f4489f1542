"""``tidal bench`` multi-turn agent sessions against ``tidal serve`` with and without the prefix cache.

    python benchmarks/bench_serve_prefix.py [--concurrency 4] [--duration 120] [--model-dir DIR]

Starts the server twice on 127.0.0.1 (``--no-prefix-cache`` for the baseline), runs the same
closed-loop multiturn workload (same seed) against each, and prints TTFT median/p99, total
throughput and the cache/no-cache ratios. Extra arguments after ``--`` go to ``tidal bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model_dir: str | None, cache: bool, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "tidal.cli", "serve", "--port", str(port), "--log-level", "warning"]
    if model_dir:
        cmd.insert(4, model_dir)
    if not cache:
        cmd.append("--no-prefix-cache")
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tidal serve exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("tidal serve did not start")


def run(args: argparse.Namespace, cache: bool, out: Path) -> dict:
    proc, url = serve(args.model_dir, cache, out.with_suffix(".log"))
    try:
        cmd = [sys.executable, "-m", "tidal.cli", "bench", "--base-url", url, "--dataset", "multiturn",
               "--max-concurrency", str(args.concurrency), "--max-duration", str(args.duration),
               "--seed", "0", "--output", str(out), "--no-plot", "--no-progress", *args.bench_args]
        subprocess.run(cmd, check=True)
    finally:
        proc.terminate()
        proc.wait(30)
    return json.loads(out.with_suffix(".jsonl").read_text().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--duration", type=float, default=120)
    ap.add_argument("--model-dir", default=None, help="default: the embedded model")
    ap.add_argument("bench_args", nargs="*", help="after --: passed to tidal bench")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: run(args, cache, Path(tmp) / name) for name, cache in (("no-cache", False), ("cache", True))}
    keys = [("median_ttft_ms", "TTFT median (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"),
            ("total_throughput", "total tok/s"), ("output_throughput", "output tok/s"),
            ("completed", "turns completed"), ("total_cached_tokens", "cached tokens")]
    print(f"\n{'':22}{'no cache':>14}{'cache':>14}{'ratio':>10}")
    for key, label in keys:
        a, b = rows["no-cache"].get(key) or 0, rows["cache"].get(key) or 0
        ratio = (a / b if "ttft" in key else b / a) if a and b else float("nan")
        print(f"{label:22}{a:>14.1f}{b:>14.1f}{ratio:>9.2f}x")
    print("(ratio: how many times better with the cache — lower TTFT, higher throughput)")


if __name__ == "__main__":
    main()
