"""Engine faults: a step that raises fails only its own requests (memory freed, the others exact);
a pool whose books do not add up afterwards kills the engine, and the server then answers 503 on
/health and to new requests, and ends open streams with an error."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from live_server import MODEL, start_server

from tidal.cache.recount import recount
from tidal.engine.core import EngineConfig, EngineCore
from tidal.engine.faults import FAULT_ENV, StepFailedError
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.presets import tiny_k3
from tidal.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return init_weights(KimiForCausalLM(tiny_k3()), seed=0).to_dtype(torch.float32).eval()


def engine(model, **kw) -> EngineCore:
    return EngineCore(model, EngineConfig(kv_cache_memory_bytes=8 << 20, **kw))


def alone(model, prompt):
    e = engine(model)
    e.add_request("x", prompt, GREEDY)
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                return o.outputs[0].token_ids


def test_a_failing_step_fails_only_its_requests(model, monkeypatch):
    prompts = {str(i): [(5 * i + j) % 250 + 1 for j in range(4 + i)] for i in range(4)}
    want = {rid: alone(model, p) for rid, p in prompts.items()}
    monkeypatch.setenv(FAULT_ENV, "raise-at-step:3")
    eng = engine(model, max_running_requests=2, enable_prefix_caching=False)
    start = eng.pool.usage()
    for rid, p in prompts.items():
        eng.add_request(rid, p, GREEDY)
    done, failed = {}, []
    while eng.has_unfinished_requests():
        try:
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        except StepFailedError as e:
            assert "injected fault at step 3" in str(e) and e.dead is None
            failed += e.request_ids
    assert sorted(failed) == ["0", "1"]  # the two running at step 3
    assert sorted(done) == ["2", "3"]
    for rid in done:
        assert done[rid] == want[rid]
    assert recount(eng.pool) == [] and eng.pool.usage() == start
    assert eng.metrics().num_requests_aborted == 2


def test_a_corrupted_pool_kills_the_engine(model, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "corrupt-pool-at-step:2")
    eng = engine(model)
    eng.add_request("a", [1, 2, 3], GREEDY)
    eng.step()
    with pytest.raises(StepFailedError) as e:
        eng.step()
    assert e.value.dead is not None and "inconsistent" in e.value.dead
    assert eng.dead == e.value.dead
    with pytest.raises(StepFailedError):  # a dead engine never steps again
        eng.step()


def test_recount_finds_a_leak(model):
    eng = engine(model)
    assert recount(eng.pool) == []
    eng.pool.leak_page_for_test()
    assert any("used pages" in p for p in recount(eng.pool))


def test_server_fails_the_step_then_dies_on_corruption(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "corrupt-pool-at-step:3")
    server = start_server()
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 500, r.text  # the step's own request: failed, with the cause
        assert "injected pool corruption at step 3" in r.json()["error"]["message"]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "inconsistent" in health.json()["error"]["message"]
        again = httpx.post(server.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "x"})
        assert again.status_code == 503
    finally:
        server.stop()


def _sse_events(response: httpx.Response) -> list[tuple[str | None, str]]:
    """(event name or None, data) of every SSE event of a streamed reply, read to its end."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            events.append((name, line.split(":", 1)[1].strip()))
            name = None
    return events


def test_open_streams_end_with_an_error_event_when_the_engine_dies(monkeypatch):
    """Public behaviour only (the engine may run in a thread or a process of its own): a stream
    whose engine dies mid-reply gets an error event naming the cause and ends; a stream still
    waiting for the running set gets one too; /health turns 503."""
    monkeypatch.setenv(FAULT_ENV, "corrupt-pool-at-step:100")  # far enough for the second stream to be in
    server = start_server("--max-num-seqs", "1")
    try:
        chat = {"model": MODEL, "stream": True, "max_tokens": 160, "ignore_eos": True,
                "messages": [{"role": "user", "content": "tell me a story"}]}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat, timeout=120) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            head = next(line for line in lines if line.startswith("data:"))  # it runs: a first chunk is out
            assert json.loads(head.split(":", 1)[1])["object"] == "chat.completion.chunk"
            waiting_body = {"model": MODEL, "stream": True, "max_tokens": 8,
                            "messages": [{"role": "user", "content": "hi"}]}
            with httpx.stream("POST", server.url + "/v1/messages", json=waiting_body, timeout=120) as second:
                assert second.status_code == 200  # accepted: it waits behind the running one
                rest = [line.split(":", 1)[1].strip() for line in lines if line.startswith("data:")]
                anthropic = _sse_events(second)
        chunks = [json.loads(d) for d in rest if d != "[DONE]"]
        assert rest[-1] == "[DONE]" and rest.count("[DONE]") == 1  # the stream ends, once
        error = chunks[-1]["error"]
        assert "injected pool corruption at step 100" in error["message"], error
        assert all("error" not in c for c in chunks[:-1])
        assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks[:-1])  # it had started
        names = [name for name, _ in anthropic]
        assert names[-1] == "error" and names.count("error") == 1, names
        body = json.loads(anthropic[-1][1])
        assert body["type"] == "error" and "inconsistent" in body["error"]["message"], body
        assert "content_block_delta" not in names  # it never ran
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and "inconsistent" in health.json()["error"]["message"]
        late = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={**chat, "stream": True})
        assert late.status_code == 503  # refused before any stream opens
    finally:
        server.stop()
