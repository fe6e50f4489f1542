"""A real ``tidal serve`` process on a free 127.0.0.1 port, for the end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

MODEL = "tidal-test"
POOL_BYTES = 64_000_000


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.unlink(missing_ok=True)
        return self.proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str, timeout: float = 180.0) -> Server:
    """Start ``tidal serve`` and wait until /health answers 200."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="tidal-serve-", suffix=".log")[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tidal.cli", "serve", "--port", str(port), "--served-model-name", MODEL,
           "--kv-cache-memory-bytes", str(POOL_BYTES), "--log-level", "warning", *extra]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tidal serve exited with {proc.returncode}:\n{server.log_text()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    text = server.log_text()
    server.stop()
    raise RuntimeError(f"tidal serve did not become healthy in {timeout} s:\n{text}")


def read_stream(url: str, path: str, body: dict, out: list[str], started: threading.Event,
                timeout: float = 30.0) -> None:
    """Collect a streamed response's non-empty lines into ``out`` (a transport error as the last
    line); ``started`` is set after three ``data:`` lines, and always once the stream ends."""
    try:
        with httpx.stream("POST", url + path, json=body, timeout=timeout) as r:
            for line in r.iter_lines():
                if line:
                    out.append(line)
                    if sum(x.startswith("data: ") for x in out) >= 3:
                        started.set()
    except httpx.HTTPError as e:
        out.append(f"transport error: {e}")
    finally:
        started.set()
