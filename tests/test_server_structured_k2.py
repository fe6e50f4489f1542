"""Structured output and enforced tool_choice on the Kimi K2 chat format, through the official
SDKs against a live server on a tiny random-weight Kimi Linear checkpoint whose tokenizer carries
K2's special tokens (so the server speaks K2: ``<|tool_calls_section_begin|>`` ...).

The model is random, so ``logit_bias`` pushes it towards what the constraint must prevent or
the request must reach (open the tool section, end the reply, close a string): whatever the
logits say, every reply must follow the declared tools and schemas, checked with ``jsonschema``.
Schemas bound their strings (a random model never closes one by itself)."""

from __future__ import annotations

import atexit
import json

import anthropic
import jsonschema
import openai
import pytest
from live_server import MODEL, Server, start_server
from test_server_structured import test_undeclared_tool_choice_is_a_400  # noqa: F401 - run here on K2 too

import test_server_structured as k3

from tidal.embedded import write_random_k2_model
from tidal.tokenizer import load_tokenizer

# The K3 tests' schemas, with every string bounded.
WEATHER = {**k3.WEATHER, "properties": {**k3.WEATHER["properties"], "city": {"type": "string", "maxLength": 12}},
           "additionalProperties": False}
SEARCH, PRODUCT = k3.SEARCH, k3.PRODUCT
TOOLS = [{"type": "function", "function": {**k3.TOOLS[0]["function"], "parameters": WEATHER}}, k3.TOOLS[1]]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
ASK, SAMPLED = k3.ASK, k3.SAMPLED


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_k2_model(tmp_path_factory.mktemp("k2-ckpt"))


@pytest.fixture(scope="module")
def ids(ckpt) -> dict[str, str]:
    """The K2 markers' and a few characters' token ids, as logit_bias keys."""
    tok = load_tokenizer(ckpt)
    return {**{name: str(i) for name, i in tok.special_tokens.items()}, **{c: str(tok.encode(c)[0]) for c in '"}'}}


@pytest.fixture(scope="module")
def k2_server(ckpt) -> Server:
    server = start_server(str(ckpt))
    atexit.register(server.stop)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oai(k2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{k2_server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(k2_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=k2_server.url, api_key="none", max_retries=0, timeout=120)


def check_calls(choice, allowed: set[str]) -> list[str]:
    return k3.check_calls(choice, allowed, SCHEMAS)


def test_the_server_speaks_k2(oai, ids):
    assert "<|tool_calls_section_begin|>" in ids and "<|open|>" not in ids
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert int(ids["<|im_assistant|>"]) in r.prompt_token_ids


@pytest.mark.parametrize("effort", ["high", "off"])
def test_tool_choice_required_and_named(oai, ids, effort):
    # Ending the reply is what the model prefers most: required must call anyway.
    bias = {ids["<|im_end|>"]: 30, ids["[EOS]"]: 30, ids["</think>"]: 10, ids["<|tool_calls_section_begin|>"]: 10}
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                    reasoning_effort=effort, logit_bias=bias, **SAMPLED)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert check_calls(choice, set(SCHEMAS))
        assert not choice.message.content
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, reasoning_effort=effort, logit_bias=bias,
                                    tool_choice={"type": "function", "function": {"name": "search"}}, **SAMPLED)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert check_calls(choice, {"search"}) == ["search"]


def test_tool_choice_none_and_auto(oai, ids):
    # The model is pushed to open the tool section: none must keep it shut ...
    bias = {ids["<|tool_calls_section_begin|>"]: 30, ids["<|tool_call_begin|>"]: 30, ids["<|im_end|>"]: 5}
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", logit_bias=bias,
                                    **SAMPLED)
    for choice in r.choices:
        assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length"), choice
        assert "<|" not in (choice.message.content or "")
    # ... auto lets it call, but only a declared tool, with arguments per its schema.
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOLS[1]], tool_choice="auto", logit_bias=bias,
                                    **SAMPLED)
    names = []
    for choice in r.choices:
        names += check_calls(choice, {"search"})
        assert "<|" not in (choice.message.content or "")
    assert names


def test_response_format_json_object_and_schema(oai, ids, effort="high"):
    # Nothing bounds an object's keys: pushing the closers ends them, and the tool section and
    # stop tokens are pushed too -- everywhere, also where JSON forbids them.
    push = {ids['"']: 8, ids["}"]: 8, ids["</think>"]: 10, ids["<|im_end|>"]: 10,
            ids["<|tool_calls_section_begin|>"]: 10}
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a shirt as JSON."}],
                                    response_format={"type": "json_object"}, reasoning_effort=effort,
                                    logit_bias=push, **SAMPLED)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        assert isinstance(json.loads(choice.message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "product", "schema": PRODUCT, "strict": True}}
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A shirt, as JSON."}],
                                    response_format=fmt, reasoning_effort=effort,
                                    logit_bias={ids["</think>"]: 10, ids["<|im_end|>"]: 10}, **SAMPLED)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PRODUCT)


def test_structured_outputs_regex_choice_and_older_fields(oai, ids):
    bias = {ids["<|im_end|>"]: 10, ids["<|tool_calls_section_begin|>"]: 10}  # allowed only once the pattern ends
    k3.check_chat_structured_outputs(oai, logit_bias=bias)
    r = oai.chat.completions.create(model=MODEL, messages=ASK, reasoning_effort="off", logit_bias=bias, **SAMPLED,
                                    extra_body={"guided_json": PRODUCT})
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), PRODUCT)


def test_streamed_forced_call_matches_the_whole_reply(oai, ids):
    kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, "seed": 4, "temperature": 1.0, "max_tokens": 300,
          "reasoning_effort": "off",
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = oai.chat.completions.create(**kw).choices[0]
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    args = "".join(tc.function.arguments or "" for ch in chunks for d in [ch.choices[0].delta] if ch.choices
                   for tc in d.tool_calls or [])
    names = [tc.function.name for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []
             if tc.function.name]
    assert names == ["get_weather"] and args == whole.message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(args), WEATHER)


def test_anthropic_tool_choice_any_and_tool(claude):
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    # Greedy, the random model calls again and again: one call only when parallel use is off.
    # Sampled (no seed in this API), it makes a few calls of up to ~80 tokens each.
    for temperature, parallel in ((0.0, False), (1.0, True)):
        choice = {"type": "any", "disable_parallel_tool_use": not parallel}
        m = claude.messages.create(model=MODEL, max_tokens=1000, messages=ASK, tools=tools, tool_choice=choice,
                                   extra_body={"temperature": temperature})
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and uses and (parallel or len(uses) == 1), m
        for b in uses:
            jsonschema.validate(b.input, SCHEMAS[b.name])
        m = claude.messages.create(model=MODEL, max_tokens=300, messages=ASK, tools=tools,
                                   extra_body={"temperature": temperature},
                                   tool_choice={"type": "tool", "name": "get_weather"})
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and [b.name for b in uses] == ["get_weather"], m
        jsonschema.validate(uses[0].input, WEATHER)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=5, messages=ASK, tools=tools,
                               tool_choice={"type": "tool", "name": "nope"})
    m = claude.messages.create(model=MODEL, max_tokens=300, messages=[{"role": "user", "content": "A shirt."}],
                               extra_body={"output_config": {"format": {"type": "json_schema", "schema": PRODUCT}}})
    jsonschema.validate(json.loads(m.content[0].text), PRODUCT)
