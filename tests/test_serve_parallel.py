"""A two-"node" tensor-parallel server on 127.0.0.1: node 0 runs the server, the engine core and
rank 0; node 1 (the same command, --node-rank 1) runs rank 1. It serves a request; a lost node turns
/health to 503 within seconds, and stopping the server leaves no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx

from live_server import free_port, start_server

from tidal.embedded import embedded_model_dir


def maps_the_checkpoint(pid: int) -> bool:
    """Whether process ``pid`` maps the embedded model's safetensors file (its float32 norms and
    gates are views of it under the default --safetensors-load-strategy lazy)."""
    name = str(embedded_model_dir() / "model.safetensors")
    with open(f"/proc/{pid}/maps") as f:
        return any(line.rstrip().endswith(name) for line in f)


def rank_pid(rank: int, addr: str) -> int:
    out = subprocess.run(["pgrep", "-f", f"rank {rank} .*init-method tcp://{addr}"], capture_output=True, text=True)
    return int(out.stdout.split()[0])


def test_two_nodes_serve_and_a_lost_node_turns_health_503() -> None:
    """TP 2 + DCP 2 over two nodes: the start-up log has the load's aggregate GB/s line and the
    logical context across the DCP ranks (2 x each rank's KV tokens)."""
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--tp-size", "2", "--dcp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    node1 = subprocess.Popen([sys.executable, "-m", "tidal.cli", "serve", *flags, "--node-rank", "1"], env=env)
    server = None
    try:
        server = start_server(*flags, "--node-rank", "0", "--log-level", "info", timeout=600)
        log = server.log_text()
        loaded = re.search(r"loaded 2 ranks' shards: ([\d.]+) GB read in ([\d.]+) s, ([\d.]+) GB/s aggregate", log)
        assert loaded and float(loaded[1]) > 0 and float(loaded[3]) > 0, log
        capacity = re.search(r"capacity: (\d+) KV tokens per rank x dcp 2 = (\d+) logical", log)
        assert capacity and int(capacity[2]) == 2 * int(capacity[1]) > 0, log
        r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"model": "tidal-test", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        assert maps_the_checkpoint(rank_pid(1, addr))  # lazy, the default, on the other node's rank too
        node1.kill()  # its worker dies with it (PR_SET_PDEATHSIG)
        node1.wait()
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 30 s after a rank was lost"
            time.sleep(0.5)
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": "tidal-test", "prompt": "hi", "max_tokens": 4})
        assert r.status_code >= 500 and "rank 1" in r.text, r.text
    finally:
        if server is not None:
            server.stop()
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    out = subprocess.run(["pgrep", "-f", f"init-method tcp://{addr}"], capture_output=True, text=True)
    assert not out.stdout.strip(), f"worker processes left: {out.stdout}"


def test_a_hung_rank_turns_health_503_and_fails_its_requests() -> None:
    """A rank that stops answering (SIGSTOP: no crash, no closed connection) while a request streams:
    the heartbeat watchdog finds it within seconds, the stream ends with an error naming the rank,
    /health turns 503, new requests are refused, and SIGTERM leaves no process (the stopped one too).
    Served with --safetensors-load-strategy eager: the ranks hold no mapping of the checkpoint."""
    addr = f"127.0.0.1:{free_port()}"
    server = start_server("--tp-size", "2", "--dist-init-addr", addr, "--safetensors-load-strategy", "eager",
                          timeout=600)
    rank1 = None
    try:
        rank1 = rank_pid(1, addr)
        assert not maps_the_checkpoint(rank1) and not maps_the_checkpoint(rank_pid(0, addr))
        body = {"model": "tidal-test", "prompt": "def add(a, b):", "max_tokens": 4000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        errors, chunks, stopped = [], 0, None
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    errors.append(event["error"]["message"])
                    continue
                chunks += 1
                if chunks == 3:
                    os.kill(rank1, signal.SIGSTOP)
                    stopped = time.monotonic()
        assert stopped is not None, f"the stream ended after {chunks} chunks: {errors}"
        waited = time.monotonic() - stopped
        assert waited < 30, f"the stream ran {waited:.1f} s past the hang"
        assert errors and "rank 1" in errors[0] and "heartbeat" in errors[0], errors
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
        r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                       json={"model": "tidal-test", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 503 and "rank 1" in r.text, r.text
    finally:
        server.stop()
        if rank1 is not None:
            try:
                os.kill(rank1, signal.SIGCONT)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    while (left := subprocess.run(["pgrep", "-f", f"init-method tcp://{addr}"], capture_output=True,
                                  text=True).stdout.strip()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"worker processes left: {left}"


def test_a_rank_whose_collectives_never_complete_fails_by_the_collective_timeout(monkeypatch) -> None:
    """Rank 1's main thread stops before its third step while its heartbeat goes on (the
    TIDAL_RANK_HANG test hook): only the collective timeout (--dist-timeout 10) finds it. The
    request fails with an error saying a collective timed out (which rank stopped, no process can
    tell: every peer just waits), /health turns 503 within 30 s of the hang, and stopping the
    server leaves no process behind."""
    from tidal.parallel.workers import HANG_ENV

    monkeypatch.setenv(HANG_ENV, "1:3")
    addr = f"127.0.0.1:{free_port()}"
    server = start_server("--tp-size", "2", "--dist-init-addr", addr, "--dist-timeout", "10", timeout=600)
    try:
        start = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"model": "tidal-test", "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code >= 500 and "collective" in r.text and "timed out" in r.text.lower(), r.text
        while httpx.get(f"{server.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() - start < 30, "/health still 200 30 s after the hang"
            time.sleep(0.5)
    finally:
        server.stop()
    deadline = time.monotonic() + 10
    while (left := subprocess.run(["pgrep", "-f", f"init-method tcp://{addr}"], capture_output=True,
                                  text=True).stdout.strip()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"worker processes left: {left}"
