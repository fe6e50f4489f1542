"""Structured output and enforced tool_choice through the official SDKs against the live server
(the embedded model): every reply is checked with ``jsonschema`` against what was declared, over
several seeded samples (``n``), with thinking on and off."""

from __future__ import annotations

import json
import re

import anthropic
import jsonschema
import openai
import pytest
from live_server import MODEL
from test_server import claude, oai, server, tok  # noqa: F401 - shared fixtures

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40},
                                           "filters": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                       "maxItems": 2}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
ASK = [{"role": "user", "content": "What is the weather in Paris tomorrow?"}]
SAMPLED = {"n": 3, "seed": 1, "temperature": 1.0, "max_tokens": 300}


def check_calls(choice, allowed: set[str], schemas: dict[str, dict] = SCHEMAS) -> list[str]:
    calls = choice.message.tool_calls or []
    for c in calls:
        assert c.function.name in allowed, c.function.name
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    return [c.function.name for c in calls]


@pytest.mark.parametrize("effort", ["max", "off"])
def test_tool_choice_required_and_named(oai, effort):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                    reasoning_effort=effort, **SAMPLED)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert check_calls(choice, set(SCHEMAS))
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, reasoning_effort=effort,
                                    tool_choice={"type": "function", "function": {"name": "search"}}, **SAMPLED)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert check_calls(choice, {"search"}) == ["search"]


def test_tool_choice_none_and_auto(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", **SAMPLED)
    for choice in r.choices:
        assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
        assert "<|" not in (choice.message.content or "")


def test_undeclared_tool_choice_is_a_400(oai):
    with pytest.raises(openai.BadRequestError, match="delete_everything"):
        oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=5,
                                    tool_choice={"type": "function", "function": {"name": "delete_everything"}})
    with pytest.raises(openai.BadRequestError, match="tool"):
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, tool_choice="required")


PRODUCT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "size": {"enum": ["S", "M", "L"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "stock": {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 999},
                                                   "warehouse": {"enum": ["north", "south"]}},
                  "required": ["count", "warehouse"], "additionalProperties": False},
    },
    "required": ["name", "size", "tags", "stock"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("effort", ["max", "off"])
def test_response_format_json_object_and_schema(oai, tok, effort):
    # Any object: nothing bounds a key's length and the tiny model never closes its strings, so
    # logit_bias pushes the closing tokens (", "}, }) -- everywhere, also where JSON forbids them:
    # the grammar must keep the reply valid whatever the logits say.
    closers = {str(tok.encode(s)[0]): 8 for s in ('"', '"}', "}")}
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a shirt as JSON."}],
                                    response_format={"type": "json_object"}, reasoning_effort=effort,
                                    logit_bias=closers, **SAMPLED)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        assert isinstance(json.loads(choice.message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "product", "schema": PRODUCT, "strict": True}}
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A shirt, as JSON."}],
                                    response_format=fmt, reasoning_effort=effort, **SAMPLED)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PRODUCT)


def check_chat_structured_outputs(oai, **kw) -> None:
    """structured_outputs regex and choice, and vLLM's older guided_choice, in chat replies."""
    kw = {"model": MODEL, "messages": ASK, "reasoning_effort": "off", **SAMPLED, **kw}
    r = oai.chat.completions.create(**kw, extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2,8} \d{1,2}C"}})
    assert all(re.fullmatch(r"[A-Z][a-z]{2,8} \d{1,2}C", c.message.content) for c in r.choices)
    r = oai.chat.completions.create(**kw, extra_body={"structured_outputs": {"choice": ["sunny", "rainy", "foggy"]}})
    assert all(c.message.content in ("sunny", "rainy", "foggy") for c in r.choices)
    r = oai.chat.completions.create(**kw, extra_body={"guided_choice": ["yes", "no"]})
    assert all(c.message.content in ("yes", "no") for c in r.choices)


def test_structured_outputs_regex_choice_and_older_fields(oai):
    check_chat_structured_outputs(oai)
    # completions: the raw text follows the constraint
    kw = {"model": MODEL, "prompt": "The answer is", "max_tokens": 40, "n": 3, "seed": 2, "temperature": 1.0}
    r = oai.completions.create(**kw, extra_body={"regex": r" (yes|no)\."})  # SGLang's field
    assert all(c.text in (" yes.", " no.") for c in r.choices)
    r = oai.completions.create(**kw, extra_body={"structured_outputs": {"grammar": 'root ::= " " [0-9]+ " apples"'}})
    assert all(re.fullmatch(r" \d+ apples", c.text) for c in r.choices if c.finish_reason == "stop")
    r = oai.completions.create(**{**kw, "max_tokens": 200}, extra_body={"guided_json": PRODUCT})
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), PRODUCT)


def test_bad_constraints_are_400s(oai):
    with pytest.raises(openai.BadRequestError, match="one output constraint"):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"regex": "a", "guided_choice": ["b"]})
    with pytest.raises(openai.BadRequestError, match="grammar"):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"guided_regex": "(unclosed"})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, response_format={"type": "yaml"})


def test_anthropic_tool_choice_any_and_tool(claude):
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for seed_temp in (0.0, 1.0):
        m = claude.messages.create(model=MODEL, max_tokens=300, messages=ASK, tools=tools, extra_body={"temperature": seed_temp},
                                   tool_choice={"type": "any"})
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and uses
        for b in uses:
            jsonschema.validate(b.input, SCHEMAS[b.name])
        m = claude.messages.create(model=MODEL, max_tokens=300, messages=ASK, tools=tools, extra_body={"temperature": seed_temp},
                                   tool_choice={"type": "tool", "name": "get_weather"})
        uses = [b for b in m.content if b.type == "tool_use"]
        assert [b.name for b in uses] == ["get_weather"]
        jsonschema.validate(uses[0].input, WEATHER)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=5, messages=ASK, tools=tools,
                               tool_choice={"type": "tool", "name": "nope"})


def test_tool_choice_auto_calls_only_declared_tools_with_valid_arguments(oai):
    """auto is enforced by the reply grammar too: the model may answer or call, but only a
    declared tool, with arguments per its schema (the embedded model, sampled, otherwise calls
    tools it saw in training with arguments that do not fit)."""
    only_search = [TOOLS[1]]
    names = []
    for seed in range(3):
        r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=only_search, tool_choice="auto",
                                        **{**SAMPLED, "seed": seed})
        for choice in r.choices:
            names += check_calls(choice, {"search"})
            assert "<|" not in (choice.message.content or "")
    assert names  # the samples did call
