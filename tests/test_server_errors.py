"""``tidal serve`` failure paths: each error returns its status in the route's envelope (OpenAI's,
Anthropic's on /v1/messages) and the server keeps serving; a client that disconnects frees its
memory in the engine; SIGTERM ends open streams with an error event and the process exits."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest
from live_server import MODEL, read_stream, start_server
from test_server import API_KEY, MAX_REQUEST_BYTES, auth, metric, shared_server

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=30)


def still_serving(oai) -> None:
    r = oai.completions.create(model=MODEL, prompt="ok", max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def anthropic_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
    return body["error"]


def post(server, path: str, body, headers=None) -> httpx.Response:
    headers = auth() if headers is None else headers
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, headers={**headers, "content-type": "application/json"})
    return httpx.post(server.url + path, json=body, headers=headers)


# ---- 400 -----------------------------------------------------------------------------------------

def test_invalid_parameters_are_400(server, oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    assert e.value.body["type"] == "invalid_request_error"
    # FastAPI's 422 (missing field, wrong type, bad JSON) is a 400 in the envelope.
    assert openai_error(post(server, "/v1/chat/completions", {"model": MODEL}), 400)["param"] == "messages"
    openai_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}), 400)
    openai_error(post(server, "/v1/chat/completions", b'{"model": "tidal-test", "messages": ['), 400)
    openai_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "n": 0}), 400)
    openai_error(post(server, "/v1/completions", {"model": MODEL, "prompt": [], "max_tokens": 2}), 400)
    openai_error(post(server, "/v1/completions", {"model": MODEL, "prompt": [10**9], "max_tokens": 2}), 400)
    err = openai_error(post(server, "/v1/chat/completions",
                            {"model": MODEL, "messages": MESSAGES, "reasoning_effort": "huge"}), 400)
    assert "huge" in err["message"] and err["param"] == "reasoning_effort"
    openai_error(post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"thinking_effort": "extreme"}}), 400)
    still_serving(oai)


def test_context_overflow_is_400_context_length_exceeded(server, oai):
    max_len = httpx.get(server.url + "/v1/models", headers=auth()).json()["data"][0]["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=max_len)
    assert e.value.code == "context_length_exceeded"
    assert "maximum context length" in e.value.message
    err = openai_error(post(server, "/v1/completions", {"model": MODEL, "prompt": [65] * (max_len + 1)}), 400)
    assert err["code"] == "context_length_exceeded"
    err = anthropic_error(post(server, "/v1/messages", {
        "model": MODEL, "max_tokens": max_len, "messages": MESSAGES}), 400)
    assert err["type"] == "invalid_request_error" and "max_tokens can be at most" in err["message"]
    err = anthropic_error(post(server, "/v1/messages", {
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi " * max_len}]}), 400)
    assert "prompt is too long" in err["message"]
    assert metric(server, "tidal:num_requests_running") == 0
    still_serving(oai)


# ---- 401 / 404 / 413 -----------------------------------------------------------------------------

def test_api_key_401(server, oai):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    openai_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}, headers={}), 401)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=MESSAGES)
    err = anthropic_error(post(server, "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": MESSAGES},
                               headers={"x-api-key": "wrong"}), 401)
    assert err["type"] == "authentication_error"
    # x-api-key works on the OpenAI routes too; probes need no key.
    assert post(server, "/v1/models", {}, headers={"x-api-key": API_KEY}).status_code == 405
    assert httpx.get(server.url + "/metrics").status_code == 200
    still_serving(oai)


def test_unknown_route_and_model_404(server, oai, claude):
    err = openai_error(httpx.get(server.url + "/v1/nope", headers=auth()), 404)
    assert err["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-17", messages=MESSAGES)
    assert e.value.code == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-17")
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-17", max_tokens=2, messages=MESSAGES)
    assert e.value.body["error"]["type"] == "not_found_error"
    still_serving(oai)


def test_oversized_body_413(server, oai):
    big = {"model": MODEL, "prompt": "x" * (MAX_REQUEST_BYTES + 10), "max_tokens": 1}
    openai_error(post(server, "/v1/completions", big), 413)
    anthropic_error(post(server, "/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "x" * (MAX_REQUEST_BYTES + 10)}]}), 413)

    # Chunked upload (no Content-Length) is counted as it arrives.
    def chunks():
        yield b'{"model": "tidal-test", "max_tokens": 1, "prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 65536 + 2):
            yield b"y" * 65536
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={**auth(), "content-type": "application/json"})
    openai_error(r, 413)
    still_serving(oai)


def test_anthropic_validation_envelope(server, claude, oai):
    err = anthropic_error(post(server, "/v1/messages", {"model": MODEL, "messages": MESSAGES}), 400)
    assert err["type"] == "invalid_request_error" and "max_tokens" in err["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES,
                               extra_body={"output_config": {"effort": "enormous"}})
    still_serving(oai)


# ---- disconnects ---------------------------------------------------------------------------------

def wait_idle(server, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "tidal:num_requests_running") == 0 and metric(server, "tidal:kv_cache_usage_perc") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the pool did not return to idle after the client left")


def test_stream_disconnect_frees_pool(server, oai):
    """A streaming client that goes away mid-reply has its request aborted: running drops to 0 and
    the pool to empty long before the 4000 tokens it asked for could have been generated."""
    wait_idle(server)
    aborted = metric(server, "tidal:num_requests_aborted_total")
    body = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=auth(), timeout=30) as r:
        lines = r.iter_lines()
        n = 0
        for line in lines:
            n += line.startswith("data: ")
            if n >= 5:
                break
        assert metric(server, "tidal:num_requests_running") == 1
        assert metric(server, "tidal:kv_cache_usage_perc") > 0
    t0 = time.monotonic()
    wait_idle(server)
    assert time.monotonic() - t0 < 10
    assert metric(server, "tidal:num_requests_aborted_total") == aborted + 1
    still_serving(oai)


def test_non_stream_disconnect_frees_pool(server, oai):
    wait_idle(server)
    aborted = metric(server, "tidal:num_requests_aborted_total")
    body = json.dumps({"model": MODEL, "prompt": "long", "max_tokens": 4000, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head + body)
        deadline = time.monotonic() + 10
        while metric(server, "tidal:num_requests_running") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    wait_idle(server)
    assert metric(server, "tidal:num_requests_aborted_total") == aborted + 1
    still_serving(oai)


# ---- shutdown ------------------------------------------------------------------------------------

def test_sigterm_ends_streams_with_error_and_exits():
    srv = start_server()
    try:
        streams = [
            ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 4000,
                                      "ignore_eos": True, "stream": True}),
            ("/v1/messages", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "ignore_eos": True,
                              "stream": True}),
        ]
        outs, threads, started = [], [], []
        for path, body in streams:
            out, ev = [], threading.Event()
            t = threading.Thread(target=read_stream, args=(srv.url, path, body, out, ev), daemon=True)
            t.start()
            outs.append(out)
            threads.append(t)
            started.append(ev)
        for ev in started:
            assert ev.wait(30)
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        srv.proc.wait(20)
        assert time.monotonic() - t0 < 15
        for t in threads:
            t.join(10)
            assert not t.is_alive()
        chat, messages = outs
        # OpenAI: a final error event, then [DONE].
        assert chat[-1] == "data: [DONE]", chat[-3:]
        err = json.loads(chat[-2][len("data: "):])["error"]
        assert err["type"] == "service_unavailable" and "shutting down" in err["message"]
        # Anthropic: an error event.
        assert messages[-2] == "event: error", messages[-3:]
        assert json.loads(messages[-1][len("data: "):])["error"]["type"] == "overloaded_error"
    finally:
        srv.stop()
