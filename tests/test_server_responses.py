"""``POST /v1/responses`` through the official SDK's ``client.responses.create``: input items,
instructions, a function tool round trip (call -> function_call_output -> answer), reasoning
items, streamed events that add up to the final response, ``previous_response_id``."""

from __future__ import annotations

import json

import openai
import pytest
from test_server import MODEL, fmt, oai, server, tok  # noqa: F401 - the shared session fixtures

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
