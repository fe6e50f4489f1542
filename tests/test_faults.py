"""Engine faults: a step that raises fails only its own requests (memory freed, the others exact);
a pool whose books do not add up afterwards kills the engine, and the server then answers 503 on
/health and to new requests, and ends open streams with an error."""

from __future__ import annotations

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
