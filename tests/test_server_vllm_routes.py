"""vLLM's extra routes and field rules, found by running vLLM's own entrypoint tests against tidal
(benchmarks/vllm_conformance): /v1/chat/completions/batch, /invocations, usage on every chunk
with continuous_usage_stats, int64 seeds, and a non-string regex constraint as a 400."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from live_server import MODEL as LIVE_MODEL
from live_server import start_server
from test_server import MESSAGES, MODEL, auth, sse_events
from test_server import oai, server  # noqa: F401 - the shared session fixtures

OTHER = [{"role": "user", "content": "Name a colour."}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=auth(), timeout=60)


def test_chat_batch_is_one_choice_per_conversation(server):
    common = {"model": MODEL, "max_completion_tokens": 4, "temperature": 0, "reasoning_effort": "none"}
    r = post(server, "/v1/chat/completions/batch", {**common, "messages": [MESSAGES, OTHER]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    singles = [post(server, "/v1/chat/completions", {**common, "messages": m}).json() for m in (MESSAGES, OTHER)]
    for choice, single in zip(body["choices"], singles):
        assert choice["message"] == single["choices"][0]["message"]  # greedy: the same reply
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert body["usage"][key] == sum(s["usage"][key] for s in singles)


@pytest.mark.parametrize(("extra", "param"), [
    ({"messages": MESSAGES}, "messages"),  # one conversation, not a list of them
    ({"messages": []}, "messages"),
    ({"messages": [MESSAGES], "stream": True}, "stream"),
    ({"messages": [MESSAGES], "n": 2}, "n"),
])
def test_chat_batch_refuses_what_it_does_not_do(server, extra, param):
    r = post(server, "/v1/chat/completions/batch", {"model": MODEL, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_invocations_dispatch_on_the_body(server):
    chat = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 3, "temperature": 0}
    done = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 3, "temperature": 0}
    reply = post(server, "/v1/chat/completions", chat).json()
    assert post(server, "/invocations", chat).json()["choices"] == reply["choices"]
    # every field of OpenAI's ChatCompletion and its message is in the JSON (null when unused),
    # so an SDK's model_dump() and the raw body have the same keys
    assert {"system_fingerprint", "service_tier"} <= set(reply)
    assert {"tool_calls", "refusal", "annotations", "audio", "function_call"} <= set(reply["choices"][0]["message"])
    assert post(server, "/invocations", done).json()["choices"] == \
        post(server, "/v1/completions", done).json()["choices"]
    r = post(server, "/invocations", {"model": MODEL})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = post(server, "/invocations", {"model": MODEL, "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_continuous_usage_is_on_every_chunk_the_role_chunk_too(server):
    events = sse_events(server, "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "max_completion_tokens": 4, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert all(c["usage"] is not None for c in chunks)
    assert chunks[0]["usage"]["completion_tokens"] == 0 and chunks[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(("seed", "bound"), [(2**63, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")])
def test_seed_outside_int64_is_a_400_naming_the_bound(oai, seed, bound):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=1, seed=seed)
    assert e.value.body["param"] == "seed" and bound in e.value.body["message"]


def test_regex_constraint_that_is_not_a_string_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=1,
                                    extra_body={"structured_outputs": {"regex": {"1": "Python"}}})
    assert e.value.body["param"] == "structured_outputs" and "regex must be a string" in e.value.body["message"]


def test_return_tokens_as_token_ids_and_force_include_usage_server_flags():
    """vLLM's --return-tokens-as-token-ids: logprobs name tokens "token_id:N" without the request
    asking; --enable-force-include-usage: a stream that asks for nothing has usage on every chunk."""
    s = start_server("--return-tokens-as-token-ids", "--enable-force-include-usage")
    try:
        r = httpx.post(f"{s.url}/v1/completions", timeout=60, json={
            "model": LIVE_MODEL, "prompt": "def add(a, b):", "max_tokens": 3, "temperature": 0, "logprobs": 1})
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 3 and all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens), tokens
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", timeout=60, json={
                "model": LIVE_MODEL, "messages": MESSAGES, "max_completion_tokens": 3, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert chunks and all(c.get("usage") is not None for c in chunks)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    finally:
        s.stop()


def test_continuous_usage_only_with_include_usage(server):
    events = sse_events(server, "/v1/completions", {
        "model": MODEL, "prompt": "def add(a, b):", "max_tokens": 3, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks and all(c.get("usage") is None for c in chunks)
