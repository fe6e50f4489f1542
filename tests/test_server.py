"""``tidal serve`` end to end: a real server process on a free 127.0.0.1 port (the embedded model),
driven by the official ``openai`` and ``anthropic`` SDKs and by raw HTTP where the SDKs hide the
wire format. The embedded model is tiny, so the tests check protocol behaviour and token
accounting, not content: counts against the tokenizer and chat renderer run here in the test,
streamed pieces against the non-streamed reply of the same greedy request.

``server()`` is shared with test_server_errors.py: one process for the whole session.
"""

from __future__ import annotations

import atexit
import json

import anthropic
import httpx
import openai
import pytest
from live_server import MODEL, Server, start_server

from tidal.embedded import embedded_model_dir
from tidal.serve.chat import chat_format_for
from tidal.tokenizer import load_tokenizer

API_KEY = "test-key"
MAX_REQUEST_BYTES = 1_000_000


_shared: list[Server] = []


def shared_server() -> Server:
    """The session's server (API key and a 1 MB body limit, so the error tests use it too)."""
    if not _shared:
        _shared.append(start_server("--api-key", API_KEY, "--max-request-bytes", str(MAX_REQUEST_BYTES)))
        atexit.register(_shared[0].stop)
    return _shared[0]


@pytest.fixture(scope="session")
def server() -> Server:
    return shared_server()


@pytest.fixture(scope="session")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer(embedded_model_dir())


@pytest.fixture(scope="session")
def fmt(tok):
    return chat_format_for(tok)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def sse_events(server: Server, path: str, body: dict) -> list[dict | str]:
    """The ``data:`` payloads of a streamed response, decoded ("[DONE]" as is)."""
    out: list[dict | str] = []
    with httpx.stream("POST", server.url + path, json=body, headers=auth(), timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def metric(server: Server, name: str) -> float:
    """The value of an unlabelled-but-for-model_name sample in /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to three."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


# ---- probes and models ---------------------------------------------------------------------------

def test_models_health_version_server_info(server, oai):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    info = httpx.get(server.url + "/server_info", headers=auth()).json()
    raw = httpx.get(server.url + "/v1/models", headers=auth()).json()
    assert raw["data"][0]["max_model_len"] == info["max_model_len"] > 0
    assert raw["data"][0]["root"] == str(embedded_model_dir())
    assert oai.models.retrieve(MODEL).id == MODEL
    assert info["internal_states"][0]["avg_spec_accept_length"] is None
    assert info["chat_format"] == "kimi_k3"
    health = httpx.get(server.url + "/health")  # public: no key needed
    assert health.status_code == 200 and health.content == b""
    from tidal import __version__
    assert httpx.get(server.url + "/version").json() == {"version": __version__}


def test_tokenize_detokenize(server, tok, fmt):
    text = "Hello, tidal! <|open|> stays text."
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text}, headers=auth()).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    assert tok.special_tokens["<|open|>"] not in r["tokens"]  # user text never becomes a marker
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, headers=auth()).json()
    assert back["prompt"] == text
    r = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, headers=auth()).json()
    assert r["tokens"] == fmt.render(MESSAGES, thinking="low").token_ids(tok)  # the model's declared default


# ---- chat ----------------------------------------------------------------------------------------

def test_chat_non_stream_usage(oai, tok, fmt):
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert r.choices[0].finish_reason == "length"
    # The embedded model declares default_reasoning_effort "low" in its config.json.
    assert r.usage.prompt_tokens == len(fmt.render(MESSAGES, thinking="low").token_ids(tok))
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.choices[0].message.role == "assistant"
    # Thinking is on by default: the reply starts in the reasoning channel.
    assert r.usage.completion_tokens_details.reasoning_tokens > 0


def test_chat_max_tokens_and_effort_off(oai, tok, fmt):
    """The older max_tokens is honoured too; reasoning_effort off renders the no-thinking prompt
    and the reply starts in the response channel (no reasoning)."""
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                    reasoning_effort="none", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    assert r.usage.prompt_tokens == len(fmt.render(MESSAGES, thinking="off").token_ids(tok))
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    assert not getattr(r.choices[0].message, "reasoning_content", None)


def test_chat_tools_prompt(oai, tok, fmt):
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_completion_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True,
                                                               "chat_template_kwargs": {"thinking_effort": "low"}})
    assert r.usage.prompt_tokens == len(fmt.render(MESSAGES, tools=TOOLS, thinking="low").token_ids(tok))
    assert r.usage.completion_tokens == 3


def test_chat_stream_matches_non_stream(oai):
    """Greedy: the streamed deltas add up to the non-streamed reply; the first delta carries the
    role, the last choice chunk the finish reason, then one usage-only chunk; every token's
    logprob arrives exactly once, mostly one token per chunk."""
    n = 12
    kw = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": n, "temperature": 0, "logprobs": True,
              "top_logprobs": 2, "extra_body": {"ignore_eos": True}}
    full = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == n
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in body)
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + ["length"]
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in body)
    content = "".join(c.choices[0].delta.content or "" for c in body)
    assert reasoning == (full.choices[0].message.reasoning_content or "")
    assert content == (full.choices[0].message.content or "")
    per_chunk = [len(c.choices[0].logprobs.content) for c in body[1:]]
    assert sum(per_chunk) == n == len(full.choices[0].logprobs.content)
    assert per_chunk.count(1) >= n // 2
    streamed = [e.token for c in body[1:] for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in full.choices[0].logprobs.content]
    for e in full.choices[0].logprobs.content:  # greedy: the chosen token is the likeliest
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob >= e.top_logprobs[1].logprob
        assert e.bytes == e.top_logprobs[0].bytes
    raw = bytes(b for e in full.choices[0].logprobs.content for b in e.bytes).decode("utf-8", "replace")
    assert (full.choices[0].message.reasoning_content or "") in raw


def test_cached_tokens_and_flush_cache(server, oai):
    """The next turn of a conversation reports its prefix-cache hit in usage; after /flush_cache
    nothing is cached."""
    turn1 = [{"role": "user", "content": "Hello there."}]
    kw = {"model": MODEL, "max_completion_tokens": 2, "extra_body": {"ignore_eos": True}}
    first = oai.chat.completions.create(messages=turn1, **kw)
    turn2 = [*turn1, {"role": "assistant", "content": "Hi.", "reasoning_content": "Greet back."},
             {"role": "user", "content": "And now?"}]
    again = oai.chat.completions.create(messages=turn2, **kw)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens // 2 < cached < again.usage.prompt_tokens
    r = httpx.post(server.url + "/flush_cache", headers=auth())
    assert r.status_code == 200 and "flushed" in r.text
    assert metric(server, "tidal:prefix_cache_pages") == 0
    assert oai.chat.completions.create(messages=turn2, **kw).usage.prompt_tokens_details.cached_tokens == 0


def test_five_turn_conversation_hits_the_prefix_cache(server, oai):
    """Each turn re-sends the whole conversation with the model's real replies: the cache serves at
    least every earlier turn's prompt (the issue's bound, previous length rounded down to the
    snapshot interval, is implied: the prompt's end always has a snapshot)."""
    messages = [{"role": "system", "content": "You are a terse coding agent."}]
    kw = {"model": MODEL, "max_completion_tokens": 6, "extra_body": {"ignore_eos": True}}
    prompt_lens, cached = [], []
    for turn in range(5):
        messages.append({"role": "user", "content": f"Step {turn}: list the files in src/ and explain one."})
        r = oai.chat.completions.create(messages=messages, **kw)
        prompt_lens.append(r.usage.prompt_tokens)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        m = r.choices[0].message
        messages.append({"role": "assistant", "content": m.content or "",
                         "reasoning_content": getattr(m, "reasoning_content", None) or ""})
    for t in range(1, 5):
        assert prompt_lens[t - 1] <= cached[t] < prompt_lens[t], (prompt_lens, cached)


def test_concurrent_streams_deliver_every_token(server):
    """Three greedy completion streams at once, across the HTTP <-> engine-core boundary: each
    carries every one of its tokens exactly once (logprobs naming token ids, and each chunk's own
    ``token_ids`` under return_token_ids, vLLM's), the same tokens as the non-streamed reply."""
    from concurrent.futures import ThreadPoolExecutor

    n = 9
    prompts = ["def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,"]

    def body(prompt: str, stream: bool) -> dict:
        return {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True, "stream": stream}

    def streamed(prompt: str) -> tuple[list[str], list[int], list]:
        events = sse_events(server, "/v1/completions", body(prompt, True))
        assert events[-1] == "[DONE]"
        chunks = [e["choices"][0] for e in events[:-1]]
        tokens = [t for c in chunks for t in (c.get("logprobs") or {}).get("tokens") or []]
        return tokens, [t for c in chunks for t in c.get("token_ids") or []], [c.get("prompt_token_ids") for c in chunks]

    with ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(streamed, prompts))
    for prompt, (tokens, ids, prompt_ids) in zip(prompts, got):
        full = httpx.post(server.url + "/v1/completions", json=body(prompt, False), headers=auth(), timeout=60).json()
        choice = full["choices"][0]
        assert len(tokens) == n and tokens == choice["logprobs"]["tokens"], prompt
        assert all(t.startswith("token_id:") for t in tokens)
        assert ids == choice["token_ids"] == [int(t.removeprefix("token_id:")) for t in tokens], prompt
        # the prompt's ids on the first chunk only
        assert prompt_ids[0] == choice["prompt_token_ids"] and not any(prompt_ids[1:]), prompt


def test_chat_stream_without_usage_has_no_usage_chunk(server):
    events = sse_events(server, "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "max_completion_tokens": 3, "stream": True, "ignore_eos": True})
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


# ---- completions ---------------------------------------------------------------------------------

def test_completions_usage_and_stream(oai, server, tok):
    prompt = "def fibonacci(n):"
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode(prompt)) and r.usage.completion_tokens == 7
    events = sse_events(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 7, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage, chunks = events[-2], events[:-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7
    assert usage["usage"]["prompt_tokens"] == r.usage.prompt_tokens
    assert all(len(c["choices"]) == 1 for c in chunks)  # bench clients read choices[0] of every chunk
    assert "".join(c["choices"][0]["text"] for c in chunks) == r.choices[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # Without include_usage there is no choices-less chunk at all.
    events = sse_events(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 3, "ignore_eos": True, "stream": True})
    assert all(e["choices"] for e in events[:-1]) and events[-1] == "[DONE]"


def test_completions_token_ids_echo_and_several_prompts(oai, tok):
    ids = tok.encode("abc")
    r = oai.completions.create(model=MODEL, prompt=ids, max_tokens=2, echo=True, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].text.startswith("abc")
    r = oai.completions.create(model=MODEL, prompt=["one", "three"], max_tokens=3, temperature=0,
                               extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.prompt_tokens == len(tok.encode("one")) + len(tok.encode("three"))
    assert r.usage.completion_tokens == 6


def test_completions_logprobs(oai):
    r = oai.completions.create(model=MODEL, prompt="xyz", max_tokens=5, logprobs=2, temperature=0,
                               extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(max(t.values()) == pytest.approx(v, abs=1e-4) for t, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_seeded_sampling_is_reproducible(oai):
    kw = {"model": MODEL, "prompt": "seed", "max_tokens": 8, "temperature": 2.0, "top_p": 0.99,
              "extra_body": {"ignore_eos": True, "top_k": 200, "min_p": 0.0001}}
    a = oai.completions.create(**kw, seed=7).choices[0].text
    assert oai.completions.create(**kw, seed=7).choices[0].text == a
    assert oai.completions.create(**kw, seed=8).choices[0].text != a


def _printable_piece(text: str) -> tuple[str, int]:
    """A 2-character ASCII stop string from the greedy text, and where it first occurs."""
    for i in range(2, len(text) - 2):
        s = text[i:i + 2]
        if s.isascii() and s.isprintable() and text.find(s) == i:
            return s, i
    pytest.skip("the greedy output has no usable stop string")


def test_stop_strings_cut_and_never_leak(oai, server):
    """A stop string taken from the greedy output ends it there, streamed or not, and the streamed
    text never contains the part that is cut."""
    base = {"model": MODEL, "prompt": "stop here", "max_tokens": 24, "temperature": 0}
    text = oai.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    stop, at = _printable_piece(text)
    r = oai.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[:at]
    assert r.choices[0].finish_reason == "stop"
    assert r.model_extra is not None and r.choices[0].model_extra["stop_reason"] == stop
    events = sse_events(server, "/v1/completions", {**base, "stop": stop, "stream": True, "ignore_eos": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[:at]
    kept = oai.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True,
                                                                   "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:at + len(stop)]


# ---- Anthropic -----------------------------------------------------------------------------------

def test_messages_stream_and_count_tokens(claude, tok, fmt):
    system, msgs = "You are terse.", [{"role": "user", "content": "Count to three."}]
    # No `thinking` in the request: the no-thinking prompt.
    expected = len(fmt.render([{"role": "system", "content": system}, *msgs], thinking="off").token_ids(tok))
    assert claude.messages.count_tokens(model=MODEL, system=system, messages=msgs).input_tokens == expected
    # Greedy: a sampled 8-token reply of the embedded model sometimes holds no text at all.
    with claude.messages.stream(model=MODEL, system=system, messages=msgs, max_tokens=8,
                                extra_body={"ignore_eos": True, "temperature": 0}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == expected
    assert final.usage.output_tokens == 8
    assert final.stop_reason == "max_tokens"
    assert {b.type for b in final.content} <= {"thinking", "text", "tool_use"}
    # The next turn: its prefix is read from the cache.
    msgs2 = [*msgs, {"role": "assistant", "content": "1, 2, 3."}, {"role": "user", "content": "Again."}]
    expected2 = len(fmt.render([{"role": "system", "content": system}, *msgs2], thinking="off").token_ids(tok))
    plain = claude.messages.create(model=MODEL, system=system, messages=msgs2, max_tokens=8,
                                   extra_body={"ignore_eos": True})
    assert expected // 2 < plain.usage.cache_read_input_tokens < expected2
    assert plain.usage.input_tokens + plain.usage.cache_read_input_tokens == expected2
    assert plain.usage.output_tokens == 8
    assert plain.id.startswith("msg_") and plain.stop_reason == "max_tokens"


def test_messages_thinking_disabled_and_tool_history(claude, tok, fmt):
    """thinking disabled renders the no-thinking prompt; tool_use / tool_result history is
    rendered as the equivalent OpenAI conversation."""
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]},
    ]
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    openai_msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
    ]
    expected = len(fmt.render(openai_msgs, tools=TOOLS, thinking="off").token_ids(tok))
    r = claude.messages.create(model=MODEL, messages=msgs, tools=tools, max_tokens=4,
                               thinking={"type": "disabled"}, extra_body={"ignore_eos": True})
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == expected and r.usage.output_tokens == 4
    assert all(b.type != "thinking" for b in r.content)


# ---- metrics -------------------------------------------------------------------------------------

def test_metrics_count_requests(server, oai):
    before = metric(server, "tidal:generation_tokens_total")
    prompt_before = metric(server, "tidal:prompt_tokens_total")
    ttft_before = metric(server, "tidal:time_to_first_token_seconds_count")
    r = oai.completions.create(model=MODEL, prompt="metrics", max_tokens=5, extra_body={"ignore_eos": True})
    assert metric(server, "tidal:generation_tokens_total") - before == 5
    assert metric(server, "tidal:prompt_tokens_total") - prompt_before == r.usage.prompt_tokens
    assert metric(server, "tidal:time_to_first_token_seconds_count") - ttft_before == 1
    text = httpx.get(server.url + "/metrics").text
    for name in ("tidal:num_requests_running", "tidal:num_requests_waiting", "tidal:kv_cache_usage_perc",
                 "tidal:num_preemptions_total", "tidal:inter_token_latency_seconds_bucket",
                 "tidal:e2e_request_latency_seconds_count", 'finished_reason="length"'):
        assert name in text
    assert metric(server, "tidal:num_requests_running") == 0


# ---- reply translation, in process: a hand-written K3 reply with reasoning and two tool calls -------

TOOL_REPLY = (
    'Let me think.<|close|>think<|sep|><|open|>response<|sep|>Calling.<|close|>response<|sep|>'
    '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris "FR"<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
    '<|open|>call tool="search" index="2"<|sep|>'
    '<|open|>argument key="q" type="object"<|sep|>{"a": [1, 2]}<|close|>argument<|sep|><|close|>call<|sep|>'
    '<|close|>tools<|sep|><|close|>message<|sep|>'
)
TOOL_ARGS = [("get_weather", {"city": 'Paris "FR"', "days": 3}), ("search", {"q": {"a": [1, 2]}})]


def reply_deltas(tok, text: str) -> list:
    """The engine client's deltas for ``text`` generated token by token, then EOS (no text)."""
    from tidal.detokenizer import Detokenizer
    from tidal.serve.engine_client import TokenDelta

    ids = tok.encode(text, allow_special=True) + [tok.special_tokens["<|end_of_msg|>"]]
    detok = Detokenizer(tok)
    out = []
    for n, t in enumerate(ids, 1):
        last = n == len(ids)
        out.append(TokenDelta("r", [t], "" if last else detok.add(t), None, num_prompt_tokens=10, num_output_tokens=n,
                              finished=last, finish_reason="stop" if last else None))
    return out


def test_chat_deltas_stream_tool_calls(tok, fmt):
    """Reasoning -> reasoning_content, the rest -> content, each call as id+name first then argument
    fragments; finish_reason tool_calls; no marker text leaks; the non-streamed message agrees."""
    from tidal.serve.openai_api import ChatAccumulator, ChatOptions

    deltas = reply_deltas(tok, TOOL_REPLY)
    acc = ChatAccumulator(fmt.parser(True), ChatOptions(id="x", model=MODEL, created=0))
    out = [acc.step(d)[0] for d in deltas]
    sent = [d for d in out if d is not None]
    assert len(sent) > 10  # streamed, not collected
    reasoning = "".join(d.get("reasoning_content", "") for d in sent)
    content = "".join(d.get("content", "") for d in sent)
    assert reasoning == "Let me think." and content == "Calling."
    calls: dict[int, dict] = {}
    for d in sent:
        for c in d.get("tool_calls", []):
            if c["index"] not in calls:  # the first fragment names the call
                assert c["id"].startswith("call_") and c["type"] == "function" and c["function"]["name"]
                calls[c["index"]] = {"name": c["function"]["name"], "args": c["function"]["arguments"], "id": c["id"]}
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[c["index"]]["args"] += c["function"]["arguments"]
    assert [(calls[i]["name"], json.loads(calls[i]["args"])) for i in sorted(calls)] == TOOL_ARGS
    assert acc.finish_reason == "tool_calls"
    assert 0 < acc.reasoning_tokens < len(deltas) and acc.completion_tokens == len(deltas)
    assert all("<|" not in (d.get("content", "") + d.get("reasoning_content", "")) for d in sent)
    msg = acc.message()
    assert msg["content"] == "Calling." and msg["reasoning_content"] == "Let me think."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == TOOL_ARGS
    assert [c["id"] for c in msg["tool_calls"]] == [calls[0]["id"], calls[1]["id"]]


def test_anthropic_blocks_stream_tool_use(tok, fmt):
    """The same reply as Messages events: a thinking block, a text block, a tool_use block per call
    whose input_json_delta pieces parse to the arguments; the non-streamed content agrees."""
    from tidal.serve.anthropic_api import (
        BlockWriter,
        MessagesOptions,
        _feed,
        messages_response,
        new_tool_id,
    )

    deltas = reply_deltas(tok, TOOL_REPLY)
    parser, writer = fmt.parser(True, new_tool_id), BlockWriter()
    events = [e for d in deltas for e in writer.events(_feed(parser, d))] + writer.close()
    parsed = [(e.split("\n")[0][len("event: "):], json.loads(e.split("\n")[1][len("data: "):])) for e in events]
    blocks: list[dict] = []
    for name, data in parsed:
        if name == "content_block_start":
            assert data["index"] == len(blocks)
            blocks.append({**data["content_block"], "json": ""})
        elif name == "content_block_delta":
            b, delta = blocks[data["index"]], data["delta"]
            key = {"thinking_delta": "thinking", "text_delta": "text", "input_json_delta": "json"}[delta["type"]]
            b[key] += delta.get(key) or delta.get("partial_json")
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use", "tool_use"]
    assert blocks[0]["thinking"] == "Let me think." and blocks[1]["text"] == "Calling."
    assert [(b["name"], json.loads(b["json"])) for b in blocks[2:]] == TOOL_ARGS
    assert all(b["id"].startswith("toolu_") for b in blocks[2:])
    assert sum(name == "content_block_stop" for name, _ in parsed) == 4
    full = messages_response(reply_deltas(tok, TOOL_REPLY), fmt.parser(True, new_tool_id),
                             MessagesOptions(id="m", model=MODEL, prompt_tokens=10))
    assert [(b["name"], b["input"]) for b in full["content"] if b["type"] == "tool_use"] == TOOL_ARGS
    assert full["stop_reason"] == "tool_use" and full["usage"]["output_tokens"] == len(deltas)
