"""The engine core in its own process, seen from outside (real ``tidal serve`` processes): a core
that dies turns /health to 503 and fails the open requests with a clear error within seconds;
SIGTERM and a killed server leave no process behind; the pool is back to its baseline after
completions, aborts and disconnects."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
from live_server import MODEL, read_stream, start_server


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(running(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if running(p)]


def core_pid(url: str) -> int:
    return httpx.get(url + "/server_info", timeout=10).json()["engine_core_pid"]


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def stream_until_error(url: str, out: list[str], started: threading.Event) -> None:
    body = {"model": MODEL, "prompt": "count", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    read_stream(url, "/v1/completions", body, out, started, timeout=60)


def test_a_killed_core_gives_503_and_clear_errors_then_sigterm_leaves_nothing():
    server = start_server()
    try:
        pid = core_pid(server.url)
        assert pid in children(server.proc.pid) and pid != server.proc.pid
        out: list[str] = []
        started = threading.Event()
        reader = threading.Thread(target=stream_until_error, args=(server.url, out, started), daemon=True)
        reader.start()
        assert started.wait(60)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        reader.join(30)
        assert not reader.is_alive() and time.monotonic() - t0 < 30
        assert any("engine core process" in line and "killed by signal 9" in line for line in out), out[-3:]
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and "exited" in health.json()["error"]["message"]
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
        assert r.status_code == 503 and "engine core process" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 30
        left = children(server.proc.pid)
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        assert wait_gone([server.proc.pid, *left], 10) == []
    finally:
        server.stop()


def test_sigterm_stops_both_and_a_killed_server_takes_its_core_along():
    server = start_server()
    try:
        tree = [server.proc.pid, *children(server.proc.pid)]
        assert core_pid(server.url) in tree
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
        assert wait_gone(tree, 10) == []
    finally:
        server.stop()
    server = start_server()
    try:
        tree = [server.proc.pid, *children(server.proc.pid)]
        server.proc.kill()  # no clean-up code runs in the server: the core must notice alone
        server.proc.wait(10)
        assert wait_gone(tree, 10) == []
    finally:
        server.stop()


def test_pool_returns_to_baseline_after_completions_aborts_and_disconnects():
    server = start_server()
    try:
        url = server.url
        total = metric(url, "tidal:pool_total_pages")
        assert total > 0 and metric(url, "tidal:pool_free_pages") == total
        for i in range(3):
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": f"hello {i}", "max_tokens": 6, "n": 2})
            assert r.status_code == 200, r.text
        # A streaming client that leaves mid-reply (its request is aborted)...
        body = {"model": MODEL, "prompt": "go on", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 6:
                    break
        # ... and one that disconnects before any byte comes back.
        try:
            httpx.post(url + "/v1/completions", timeout=0.5,
                       json={"model": MODEL, "prompt": "long " * 50, "max_tokens": 4000, "ignore_eos": True})
        except httpx.TimeoutException:
            pass
        deadline = time.monotonic() + 30
        while metric(url, "tidal:num_requests_running") + metric(url, "tidal:num_requests_waiting") > 0:
            assert time.monotonic() < deadline, "requests still running after their clients left"
            time.sleep(0.2)
        assert metric(url, "tidal:num_requests_aborted_total") >= 2
        assert httpx.post(url + "/flush_cache", timeout=60).status_code == 200
        deadline = time.monotonic() + 10
        while metric(url, "tidal:pool_free_pages") != total:  # stats follow the core's next frame
            assert time.monotonic() < deadline, (metric(url, "tidal:pool_free_pages"), total)
            time.sleep(0.1)
    finally:
        server.stop()
