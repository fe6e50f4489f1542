"""``POST /v1/responses`` through the official SDK's ``client.responses.create``: input items,
instructions, a function tool round trip (call -> function_call_output -> answer), reasoning
items (only where there is reasoning), streamed events that add up to the final response,
``previous_response_id``, tool_choice and text.format held by the reply grammar."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_server import MODEL, fmt, oai, server, tok  # noqa: F401 - the shared session fixtures

from tidal.serve.chat import K2Format, K3Format
from tidal.serve.chat.xtml import CLOSE, OPEN, SEP
from tidal.serve.responses_api import OutputBuilder

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_TOOL = [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
ASK = "What is the weather in Paris?"


def test_text_response_and_its_prompt(oai, fmt, tok):
    r = oai.responses.create(model=MODEL, input="Count to three.", instructions="You are terse.",
                             max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to three."}]
    assert r.usage.input_tokens == len(fmt.render(msgs, thinking="low").token_ids(tok))
    assert r.usage.output_tokens == 8
    kinds = [item.type for item in r.output]
    assert set(kinds) <= {"reasoning", "message"} and kinds
    if "message" in kinds:
        assert r.output_text == "".join(c.text for i in r.output if i.type == "message" for c in i.content)
    # reasoning effort "none": no reasoning item, the no-thinking prompt
    r = oai.responses.create(model=MODEL, input="Count to three.", reasoning={"effort": "none"}, max_output_tokens=4)
    assert all(item.type != "reasoning" for item in r.output)
    assert r.usage.input_tokens == len(fmt.render([msgs[1]], thinking="off").token_ids(tok))


def test_function_tool_round_trip(oai, fmt, tok):
    first = oai.responses.create(model=MODEL, input=ASK, tools=[TOOL], reasoning={"effort": "none"},
                                 max_output_tokens=80, temperature=0)
    calls = [i for i in first.output if i.type == "function_call"]
    assert first.status == "completed" and calls, first.output
    call = calls[0]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    assert call.call_id and call.id.startswith("fc_")
    follow = [{"role": "user", "content": ASK}, *[i.model_dump(exclude_none=True) for i in first.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    second = oai.responses.create(model=MODEL, input=follow, tools=[TOOL], reasoning={"effort": "none"},
                                  max_output_tokens=40, temperature=0)
    streamed = list(oai.responses.create(model=MODEL, input=follow, tools=[TOOL], reasoning={"effort": "none"},
                                         max_output_tokens=40, temperature=0, stream=True))[-1].response
    assert [i.model_dump(exclude={"id", "call_id"}) for i in streamed.output] == \
        [i.model_dump(exclude={"id", "call_id"}) for i in second.output]
    assert streamed.usage.input_tokens == second.usage.input_tokens
    chat = [{"role": "user", "content": ASK},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}]
    expected = len(fmt.render(chat, tools=CHAT_TOOL, thinking="off").token_ids(tok))
    assert second.usage.input_tokens == expected
    # The same turn by previous_response_id: only the tool output is sent.
    third = oai.responses.create(model=MODEL, previous_response_id=first.id, tools=[TOOL],
                                 reasoning={"effort": "none"}, max_output_tokens=40, temperature=0,
                                 input=[{"type": "function_call_output", "call_id": call.call_id,
                                         "output": "18 C, sunny"}])
    assert third.usage.input_tokens == expected and third.previous_response_id == first.id
    assert [i.model_dump(exclude={"id"}) for i in third.output] == [i.model_dump(exclude={"id"}) for i in second.output]
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=MODEL, previous_response_id="resp_unknown", input="hi")


def test_stream_events_build_the_response(oai):
    for kwargs in ({"input": ASK, "tools": [TOOL], "reasoning": {"effort": "none"}},
                   {"input": "Count to three.", "reasoning": {"effort": "low"}}):
        events = list(oai.responses.create(model=MODEL, max_output_tokens=60, temperature=0, stream=True, **kwargs))
        whole = oai.responses.create(model=MODEL, max_output_tokens=60, temperature=0, **kwargs)
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] in ("response.completed", "response.incomplete")
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = events[-1].response
        strip = lambda items: [i.model_dump(exclude={"id", "call_id"}) for i in items]  # noqa: E731
        assert strip(final.output) == strip(whole.output)
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert strip(done) == strip(final.output)
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == final.output_text
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert reasoning == "".join(c.text for i in final.output if i.type == "reasoning" for c in i.content or [])
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert args == "".join(i.arguments for i in final.output if i.type == "function_call")
        assert final.usage.output_tokens == whole.usage.output_tokens


def test_reasoning_input_items_render_as_reasoning(oai, fmt, tok):
    items = [{"role": "user", "content": "hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "greet"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "again"}]
    r = oai.responses.create(model=MODEL, input=items, reasoning={"effort": "high"}, max_output_tokens=1)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
            {"role": "user", "content": "again"}]
    assert r.usage.input_tokens == len(fmt.render(chat, thinking="high").token_ids(tok))
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input=[{"type": "web_search_call"}], max_output_tokens=1)
    assert e.value.body["param"] == "input.0.type"


def test_no_reasoning_item_without_reasoning(oai):
    """OpenAI emits a reasoning item only where there is reasoning: none when the model did not
    think, also when its reasoning channel held only blanks (which then never show)."""
    answer = f"{OPEN}response{SEP}Hi.{CLOSE}response{SEP}{CLOSE}message{SEP}"
    for parser, reply, items, reasoning in (
            (K3Format().parser(thinking=True), f"\n \n{CLOSE}think{SEP}{answer}", ["message"], ""),
            (K3Format().parser(thinking=True), f"{CLOSE}think{SEP}{answer}", ["message"], ""),
            (K3Format().parser(thinking=True), f"\n plan{CLOSE}think{SEP}{answer}", ["reasoning", "message"], "\n plan"),
            (K2Format().parser(), "<think>\n</think>Hi.<|im_end|>", ["message"], "")):
        b = OutputBuilder()
        events = [e for ch in reply for e in b.feed(parser.feed(ch))] + b.feed(parser.finish()) + b.close()
        assert [i["type"] for i in b.items] == items
        assert "".join(c["text"] for i in b.items if i["type"] == "reasoning" for c in i["content"]) == reasoning
        data = [json.loads(e.split("\ndata: ", 1)[1]) for e in events]
        assert "".join(d["delta"] for d in data if d["type"] == "response.reasoning_text.delta") == reasoning
        added = [d["item"]["type"] for d in data if d["type"] == "response.output_item.added"]
        assert added == items
    # Live, whole and streamed: a reasoning item, where there is one, holds reasoning.
    for effort in ("none", "high"):
        kw = {"model": MODEL, "input": "Count to three.", "reasoning": {"effort": effort}, "max_output_tokens": 24,
              "temperature": 0}
        whole = oai.responses.create(**kw)
        final = list(oai.responses.create(**kw, stream=True))[-1].response
        for r in (whole, final):
            thought = [i for i in r.output if i.type == "reasoning"]
            assert all("".join(c.text for c in i.content).strip() for i in thought), r.output
            assert not thought or effort != "none"


def test_tools_and_text_format_are_enforced(oai):
    """The reply grammar holds Responses requests as it holds chat ones: tool_choice required and
    a named function force a call of a declared tool with schema-valid arguments; text.format
    json_schema gives schema-valid JSON."""
    search = {"type": "function", "name": "search", "description": "Search the web", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 30}}, "required": ["query"],
        "additionalProperties": False}}
    kw = {"model": MODEL, "input": ASK, "tools": [TOOL, search], "reasoning": {"effort": "none"},
          "max_output_tokens": 120, "temperature": 0}
    for choice, names in (("required", {"get_weather", "search"}), ({"type": "function", "name": "search"}, {"search"})):
        for r in (oai.responses.create(**kw, tool_choice=choice),
                  list(oai.responses.create(**kw, tool_choice=choice, stream=True))[-1].response):
            calls = [i for i in r.output if i.type == "function_call"]
            assert calls and r.status == "completed", r.output
            for c in calls:
                assert c.name in names
                jsonschema.validate(json.loads(c.arguments), (TOOL if c.name == "get_weather" else search)["parameters"])
    with pytest.raises(openai.BadRequestError, match="nope"):
        oai.responses.create(**kw, tool_choice={"type": "function", "name": "nope"})
    shape = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer",
                                                                                           "minimum": 0, "maximum": 9}},
             "required": ["answer", "score"], "additionalProperties": False}
    r = oai.responses.create(model=MODEL, input="Is water wet?", reasoning={"effort": "none"}, max_output_tokens=60,
                             temperature=0, text={"format": {"type": "json_schema", "name": "verdict", "schema": shape,
                                                             "strict": True}})
    jsonschema.validate(json.loads(r.output_text), shape)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="x", max_output_tokens=2, text={"format": {"type": "yaml"}})
    assert e.value.body["param"] == "text.format"
