"""Backpressure: --max-running-requests (alias --max-num-seqs) caps the running set and
--max-queued-requests the waiting queue; a request beyond the queue gets 503 + Retry-After in the
route's error envelope at once, the others complete exactly, and nothing leaks."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
import torch
from live_server import MODEL, start_server

from tidal.engine.core import EngineConfig, EngineCore
from tidal.engine.request import QueueFullError
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.plan import plan_for_pool, plan_table, pool_layout
from tidal.presets import tiny_k3
from tidal.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return init_weights(KimiForCausalLM(tiny_k3()), seed=0).to_dtype(torch.float32).eval()


def engine(model, **kw) -> EngineCore:
    return EngineCore(model, EngineConfig(kv_cache_memory_bytes=8 << 20, **kw))


def run(eng: EngineCore, prompts: list[list[int]]) -> tuple[dict[str, list[int]], int]:
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, GREEDY)
    out, most = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
        most = max(most, len(eng.scheduler.running))
    return out, most


def test_running_cap_bounds_the_running_set_and_changes_no_output(model):
    prompts = [[(7 * i + j) % 250 + 1 for j in range(5 + i)] for i in range(6)]
    free, most_free = run(engine(model), prompts)
    capped, most_capped = run(engine(model, max_running_requests=2), prompts)
    assert most_free == 6 and most_capped == 2
    assert capped == free


def test_queue_cap_rejects_at_once_and_counts_every_request_not_running(model):
    eng = engine(model, max_running_requests=4, max_queued_requests=2)
    eng.add_request("a", [1, 2, 3], GREEDY)
    eng.add_request("b", [4, 5], GREEDY)
    # SGLang's count: not yet running is queued, even with room in the running set
    with pytest.raises(QueueFullError, match="waiting queue is full .2 requests"):
        eng.add_request("c", [6, 7], GREEDY)
    assert "c" not in eng.requests and eng.metrics().num_requests_rejected == 1
    eng.step()  # "a" and "b" run: the queue is empty again
    assert eng.num_queued == 0 and len(eng.scheduler.running) == 2
    eng.add_request("c", [6, 7], GREEDY)
    eng.add_request("d", [8, 9], GREEDY)
    with pytest.raises(QueueFullError):
        eng.add_request("e", [1], GREEDY)
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("e", [1], GREEDY)  # room again
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_queued_requests must be >= 1"):
            engine(model, max_queued_requests=bad)


def test_preempted_requests_count_as_queued(model):
    block = pool_layout(model.config, 1 << 30, page_size=4, kv_dtype_bytes=4, conv_dtype_bytes=4).block_bytes
    eng = EngineCore(model, EngineConfig(kv_cache_memory_bytes=8 * block, page_size=4, max_queued_requests=6))
    long = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    for i in range(6):
        eng.add_request(str(i), [(5 * i + j) % 250 + 1 for j in range(12)], long)
    while eng.scheduler.num_preemptions == 0:
        eng.step()
    preempted = [r for r in eng.scheduler.waiting if r.metrics.num_preemptions]
    assert preempted  # back in the waiting queue, and counted there
    waiting, room = len(eng.scheduler.waiting), 0
    while True:
        try:
            eng.add_request(f"new{room}", [1, 2], GREEDY)
        except QueueFullError:
            break
        room += 1
    assert room == 6 - waiting < 6  # the preempted requests take places of the cap


def test_plan_describes_the_running_cap():
    p = plan_for_pool(tiny_k3(), 8 << 20, max_running_requests=2)
    assert p.max_running_requests == 2 and "--max-running-requests caps the running set at" in plan_table(p)
    assert plan_for_pool(tiny_k3(), 8 << 20).max_running_requests > 2


def test_ten_concurrent_clients_with_caps_of_two():
    server = start_server("--max-num-seqs", "2", "--max-queued-requests", "2")
    try:
        def ask(i: int) -> httpx.Response:
            if i % 2:
                body = {"model": MODEL, "max_tokens": 24, "messages": [{"role": "user", "content": f"hi {i}"}]}
                return httpx.post(server.url + "/v1/messages", json=body, timeout=120)
            body = {"model": MODEL, "prompt": f"count {i}", "max_tokens": 24, "ignore_eos": True}
            return httpx.post(server.url + "/v1/completions", json=body, timeout=120)

        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            replies = list(pool.map(ask, range(10)))
        ok = [r for r in replies if r.status_code == 200]
        busy = [(i, r) for i, r in enumerate(replies) if r.status_code == 503]
        assert len(ok) + len(busy) == 10, [r.text for r in replies]
        assert len(ok) >= 2 and busy  # two queued at least (more once the first run); the rest turned away
        for i, r in busy:
            assert int(r.headers["retry-after"]) >= 1
            body = r.json()
            if i % 2:
                assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
                message = body["error"]["message"]
            else:
                assert body["error"]["type"] == "service_unavailable"
                message = body["error"]["message"]
            assert "waiting queue is full" in message
        for r in ok:
            assert "usage" in r.json()
        deadline = time.monotonic() + 30
        text = ""
        while time.monotonic() < deadline:
            text = httpx.get(server.url + "/metrics", timeout=10).text
            if _sample(text, "tidal:num_requests_running") == 0 and _sample(text, "tidal:kv_cache_usage_perc") == 0:
                break
            time.sleep(0.2)
        assert _sample(text, "tidal:num_requests_running") == 0 and _sample(text, "tidal:num_requests_waiting") == 0
        assert _sample(text, "tidal:kv_cache_usage_perc") == 0  # nothing leaked
        after = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                           timeout=60)
        assert after.status_code == 200
    finally:
        server.stop()


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")
