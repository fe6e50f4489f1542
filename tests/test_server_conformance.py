"""What everyday clients send, through the official SDKs against the live server of
test_server.py: every effort value, no thinking blocks by default on /v1/messages, no markup in
replies (tool calls cut by max_tokens, ignore_eos) and streams that hold back no decided text."""

from __future__ import annotations

import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest
from live_server import start_server
from test_server import API_KEY, MESSAGES, MODEL, TOOLS, auth
from test_server import claude, fmt, oai, server, tok  # noqa: F401 - the shared session fixtures

from tidal.embedded import embedded_model_dir
from tidal.serve.chat import REQUEST_EFFORTS, chat_format_for
from tidal.tokenizer import load_tokenizer
from tidal.serve.chat.xtml import END_OF_MSG

LONGEST_MARKER_HOLD = len(END_OF_MSG) - 1  # the longest proper prefix of a K3 marker


def prompt_len(fmt, tok, level: str, messages=MESSAGES, **kw) -> int:
    return len(fmt.render(messages, thinking=level, **kw).token_ids(tok))


# ---- efforts -------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", sorted(REQUEST_EFFORTS))
def test_every_openai_effort_value(oai, fmt, tok, value):
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=1, temperature=0,
                                    reasoning_effort=value)
    assert r.usage.prompt_tokens == prompt_len(fmt, tok, REQUEST_EFFORTS[value])


def test_effort_table_and_its_sources(oai, fmt, tok):
    assert {k: REQUEST_EFFORTS[k] for k in ("none", "minimal", "low", "medium", "high", "xhigh", "max")} == {
        "none": "off", "minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}
    # No effort: the embedded model's declared default (config.json default_reasoning_effort "low").
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=1)
    assert r.usage.prompt_tokens == prompt_len(fmt, tok, "low")
    # The Kimi API's thinking switch.
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=1,
                                    extra_body={"thinking": {"type": "disabled"}})
    assert r.usage.prompt_tokens == prompt_len(fmt, tok, "off")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=1, reasoning_effort="huge")
    err = e.value.body
    assert err["param"] == "reasoning_effort" and "'huge'" in err["message"] and "medium" in err["message"]


@pytest.mark.parametrize(("kwargs", "level"), [
    ({}, "off"),
    ({"thinking": {"type": "disabled"}}, "off"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "low"),
    ({"thinking": {"type": "enabled", "budget_tokens": 8000}}, "high"),
    ({"thinking": {"type": "enabled", "budget_tokens": 32000}}, "max"),
    ({"thinking": {"type": "adaptive"}}, "low"),  # the server's default (the model's: low)
    *[({"thinking": {"type": "adaptive"}, "extra_body": {"output_config": {"effort": e}}}, REQUEST_EFFORTS[e])
      for e in ("low", "medium", "high", "xhigh", "max")],
])
def test_anthropic_thinking_and_effort(claude, fmt, tok, kwargs, level):
    system = "You are terse."
    msgs = [{"role": "user", "content": "Count to three."}]
    n = claude.messages.count_tokens(model=MODEL, system=system, messages=msgs,
                                     **{k: v for k, v in kwargs.items() if k == "thinking"},
                                     extra_body=kwargs.get("extra_body")).input_tokens
    assert n == prompt_len(fmt, tok, level, [{"role": "system", "content": system}, *msgs])


def test_messages_without_thinking_have_no_thinking_block(claude):
    r = claude.messages.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=24)
    assert r.content and all(b.type == "text" for b in r.content)
    assert isinstance(r.content[0].text, str)
    with claude.messages.stream(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                max_tokens=24, extra_body={"ignore_eos": True}) as stream:
        final = stream.get_final_message()
    assert all(b.type != "thinking" for b in final.content)


# ---- no leaked markup ----------------------------------------------------------------------------

WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def raw_reply(server, fmt, tok, max_tokens: int) -> list[int]:
    """The greedy reply's token ids to the tool prompt (no thinking), from /v1/completions."""
    ids = fmt.render(WEATHER, tools=TOOLS, thinking="off").token_ids(tok)
    r = httpx.post(server.url + "/v1/completions", headers=auth(), timeout=60, json={
        "model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
        "skip_special_tokens": False, "return_tokens_as_token_ids": True}).json()
    return [int(t.removeprefix("token_id:")) for t in r["choices"][0]["logprobs"]["tokens"]]


def assert_clean(text: str | None, tok) -> None:
    for name in tok.special_tokens:
        assert name not in (text or ""), text


def test_tool_call_cut_by_max_tokens_is_dropped(server, oai, fmt, tok):
    reply = raw_reply(server, fmt, tok, 60)
    text = [tok.decode([t]) for t in reply]
    start = text.index("<|open|>", text.index("tools"))  # the first call opens here
    end = len(text) - text[::-1].index("<|close|>") - 4  # before </call></tools>...
    whole = oai.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, reasoning_effort="none",
                                        max_completion_tokens=60, temperature=0)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.tool_calls
    # The call closes 10 tokens before the end (</call></tools></message><|end_of_msg|>); the chat
    # reply may be shorter than the raw one (tool grammar), so cut relative to its own length.
    end = min(end, whole.usage.completion_tokens - 10)
    cuts = sorted({start + 1, start + 4, (start + end) // 2, end})
    for n in cuts:
        r = oai.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, reasoning_effort="none",
                                        max_completion_tokens=n, temperature=0)
        c = r.choices[0]
        assert c.finish_reason == "length" and not c.message.tool_calls, (n, c)
        assert_clean(c.message.content, tok)
        chunks = list(oai.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, reasoning_effort="none",
                                                  max_completion_tokens=n, temperature=0, stream=True))
        assert not any(ch.choices and ch.choices[0].delta.tool_calls for ch in chunks), n
        assert chunks[-1].choices[0].finish_reason == "length"
        assert_clean("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), tok)
    fn = TOOLS[0]["function"]  # the same tool, so the same prompt (no thinking) and the same reply
    tool = {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}
    m = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0).messages.create(
        model=MODEL, messages=WEATHER, max_tokens=cuts[-1], tools=[tool], extra_body={"temperature": 0})
    assert m.stop_reason == "max_tokens" and all(b.type == "text" for b in m.content)


def test_ignore_eos_never_leaks_special_tokens(oai, tok):
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=160, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 160
    msg = r.choices[0].message
    assert_clean(msg.content, tok)
    assert_clean(getattr(msg, "reasoning_content", None), tok)
    assert msg.content  # text past the end of the message is content, markers removed


# ---- stream timing -------------------------------------------------------------------------------

def test_stream_holds_back_no_decided_text(oai):
    """Each chunk carries its own token's text plus at most a held marker prefix: never a run of
    earlier tokens' text (ignore_eos runs on past the message, where nothing is markup)."""
    chunks = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=160, temperature=0,
                                         stream=True, logprobs=True, top_logprobs=0,
                                         extra_body={"ignore_eos": True, "return_tokens_as_token_ids": False})
    worst, texts = 0, 0
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        text = (d.content or "") + (getattr(d, "reasoning_content", None) or "")
        if not text or ch.choices[0].logprobs is None:
            continue
        texts += 1
        last = ch.choices[0].logprobs.content[-1].token
        worst = max(worst, len(text) - len(last))
    assert texts > 80
    assert worst <= LONGEST_MARKER_HOLD


# ---- error bodies --------------------------------------------------------------------------------

def raw_post(server, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, headers={**auth(), "content-type": "application/json"})
    return httpx.post(server.url + path, json=body, headers=auth())


def test_too_large_max_tokens_names_the_field_and_the_numbers(oai, server, fmt, tok):
    limit = httpx.get(server.url + "/v1/models", headers=auth()).json()["data"][0]["max_model_len"]
    n = prompt_len(fmt, tok, "low")
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=MESSAGES, **{field: limit})
        err = e.value.body
        assert err["param"] == field and err["code"] == "context_length_exceeded"
        assert f"{limit} tokens" in err["message"] and f"{n} in the prompt" in err["message"]
        assert f"{field} can be at most {limit - n}" in err["message"]
        assert "prompt is too long" not in err["message"]
    err = raw_post(server, "/v1/completions", {"model": MODEL, "prompt": [65] * limit, "max_tokens": 1}).json()["error"]
    assert err["param"] == "prompt" and "prompt is too long" in err["message"] and f"has {limit} tokens" in err["message"]


def test_json_errors_give_line_and_column(server):
    body = b'{"model": "tidal-test",\n "messages": [}'
    r = raw_post(server, "/v1/chat/completions", body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] is None
    assert "line 2, column 15" in err["message"], err


def test_error_codes_are_strings(server):
    bodies = [
        ("/v1/chat/completions", {"model": MODEL}),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "temperature": -1}),
        ("/v1/chat/completions", {"model": "nope", "messages": MESSAGES}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}),
        ("/v1/nothing", {}),
    ]
    for path, body in bodies:
        err = raw_post(server, path, body).json()["error"]
        assert isinstance(err["code"], str) and err["code"], (path, err)


def test_stream_options_only_with_stream_and_tool_choice_needs_its_tool(server):
    err = raw_post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                    "stream_options": {"include_usage": True}}).json()["error"]
    assert err["param"] == "stream_options"
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        err = raw_post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                        "tool_choice": choice}).json()["error"]
        assert err["param"] == "tool_choice", err
    err = raw_post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "other"}}}).json()["error"]
    assert err["param"] == "tool_choice" and "'other'" in err["message"] and "get_weather" in err["message"]
    ok = raw_post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 1,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert ok.status_code == 200


# ---- operations --------------------------------------------------------------------------------

def test_startup_access_and_stats_lines_and_the_port_check():
    """A server of its own at --log-level info: a short start-up (model, dtype, device, pool
    capacity, URL; no planner table), one access line per request, the periodic stats line;
    --default-reasoning-effort applies; sizes take units; a port in use fails before loading."""
    s = start_server("--log-level", "info", "--stats-interval", "0.3", "--default-reasoning-effort", "high",
                     "--max-model-len", "4K", "--max-request-bytes", "1MiB")
    tokenizer = load_tokenizer(embedded_model_dir())
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=60)
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=16,
                                           extra_body={"ignore_eos": True})
        time.sleep(1.0)
        log = s.log_text()
        assert r.usage.prompt_tokens == len(chat_format_for(tokenizer).render(MESSAGES, thinking="high").token_ids(tokenizer))
        assert f"serving {MODEL} (" in log and "float32 on cpu" in log and "default thinking effort high" in log
        assert "KV tokens" in log and "requests of 4096 tokens at once" in log
        assert f"listening on http://127.0.0.1:{s.port}" in log
        assert "┏" not in log and "weights per rank" not in log  # the planner's tables: --log-level debug
        assert sum('"POST /v1/chat/completions HTTP/1.1" 200' in line for line in log.splitlines()) == 1
        assert "Avg generation throughput:" in log and "Running:" in log and "Prefix cache hit rate:" in log
        lines_before = log.count("Avg generation throughput")
        time.sleep(1.0)
        assert s.log_text().count("Avg generation throughput") <= lines_before + 1  # idle: quiet
        t0 = time.monotonic()
        clash = subprocess.run([sys.executable, "-m", "tidal.cli", "serve", "--port", str(s.port)],
                               capture_output=True, text=True, timeout=120)
        assert clash.returncode == 2 and f"cannot listen on 127.0.0.1:{s.port}" in clash.stderr
        assert "loaded" not in clash.stderr and time.monotonic() - t0 < 60
    finally:
        s.stop()
    bad = subprocess.run([sys.executable, "-m", "tidal.cli", "serve", "--kv-cache-memory-bytes", "lots"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "'lots' is not a size in bytes" in bad.stderr
    help_text = subprocess.run([sys.executable, "-m", "tidal.cli", "serve", "--help"], capture_output=True,
                               text=True, timeout=120).stdout
    assert "(default: 8000)" in help_text
    # a help text that names its own default gets no second "(default: ...)"
    flat = " ".join(help_text.split())
    assert "(default: the model's)" in flat and "the model's) (default" not in flat


def test_reasoning_alias_and_vllm_metric_names(server, oai):
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=6, temperature=0,
                                    reasoning_effort="high", extra_body={"ignore_eos": True})
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning"] == msg["reasoning_content"] and msg["reasoning"]
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for family in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                   "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                   "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_count",
                   "e2e_request_latency_seconds_sum", "request_success_total"):
        tidal = [ln.split(" ")[0].replace("tidal:", "") + ln.rsplit(" ", 1)[1]
                 for ln in text.splitlines() if ln.startswith("tidal:" + family)]
        vllm = [ln.split(" ")[0].replace("vllm:", "") + ln.rsplit(" ", 1)[1]
                for ln in text.splitlines() if ln.startswith("vllm:" + family)]
        assert tidal and vllm == tidal, family
