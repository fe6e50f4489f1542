"""A two-"node" tensor-parallel server on 127.0.0.1: node 0 runs the server, the engine core and
rank 0; node 1 (the same command, --node-rank 1) runs rank 1. It serves a request; a lost node turns
/health to 503 within seconds, and stopping the server leaves no process behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from live_server import free_port, start_server


def test_two_nodes_serve_and_a_lost_node_turns_health_503() -> None:
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    node1 = subprocess.Popen([sys.executable, "-m", "tidal.cli", "serve", *flags, "--node-rank", "1"], env=env)
    server = None
    try:
        server = start_server(*flags, "--node-rank", "0", timeout=600)
        r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"model": "tidal-test", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        node1.kill()  # its worker dies with it (PR_SET_PDEATHSIG)
        node1.wait()
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 30 s after a rank was lost"
            time.sleep(0.5)
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": "tidal-test", "prompt": "hi", "max_tokens": 4})
        assert r.status_code >= 500
    finally:
        if server is not None:
            server.stop()
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    out = subprocess.run(["pgrep", "-f", f"init-method tcp://{addr}"], capture_output=True, text=True)
    assert not out.stdout.strip(), f"worker processes left: {out.stdout}"
