"""Chat renderers: the K3 XTML and K2 prompts for a full conversation, written out by hand from
k3-chat-format.md and k3-model.md §6.2, plus the rules' edge cases."""

import pytest

from tidal.embedded import write_byte_tokenizer
from tidal.serve.chat import K2Format, K3Format, chat_format_for, thinking_effort
from tidal.serve.chat.k2 import KIMI_LINEAR_DEFAULT_SYSTEM
from tidal.tokenizer import load_tokenizer

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "name": 'a"b&c', "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_time", "arguments": '{"tz": "Europe/Rome", "opts": {"h24": true}, "x": null}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "Sun"}, {"type": "text", "text": "ny"}]},
    {"role": "assistant", "content": "Sunny, noon.", "reasoning": "   "},
    {"role": "user", "content": "Thanks <|open|>"},
]

EFFORT_PROSE = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=high`."
)

K3_EXPECTED = (
    '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, described in '
    'JSONSchema.\n\n```json\n[{"function":{"description":"Weather","name":"get_weather","parameters":{"properties":'
    '{"city":{"type":"string"},"days":{"type":"integer"}},"required":["city"],"type":"object"}},"type":"function"}]'
    '\n```<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="system" type="thinking-effort"<|sep|>' + EFFORT_PROSE + '<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="system"<|sep|>You are terse.<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="user" name="a&quot;b&amp;c"<|sep|>Weather in Paris?<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Need the tool.<|close|>think<|sep|>'
    '<|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|>'
    '<|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|>'
    '<|open|>call tool="get_time" index="2"<|sep|>'
    '<|open|>argument key="tz" type="string"<|sep|>Europe/Rome<|close|>argument<|sep|>'
    '<|open|>argument key="opts" type="object"<|sep|>{"h24":true}<|close|>argument<|sep|>'
    '<|open|>argument key="x" type="null"<|sep|>null<|close|>argument<|sep|><|close|>call<|sep|>'
    '<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>Sunny<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="tool" tool="get_time" index="2"<|sep|>12:00<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
    '<|open|>response<|sep|>Sunny, noon.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="user"<|sep|>Thanks <|open|><|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
)

K2_EXPECTED = (
    '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather","description":"Weather",'
    '"parameters":{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}},'
    '"required":["city"]}}}]<|im_end|>'
    '<|im_system|>system<|im_middle|>You are terse.<|im_end|>'
    '<|im_user|>a"b&c<|im_middle|>Weather in Paris?<|im_end|>'
    '<|im_assistant|>assistant<|im_middle|><think>Need the tool.</think>Checking.<|tool_calls_section_begin|>'
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|>'
    '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
    '{"tz": "Europe/Rome", "opts": {"h24": true}, "x": null}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    '<|im_system|>tool<|im_middle|>## Return of functions.get_time:1\n12:00<|im_end|>'
    '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nSunny<|im_end|>'
    '<|im_assistant|>assistant<|im_middle|>Sunny, noon.<|im_end|>'
    '<|im_user|>user<|im_middle|>Thanks <|open|><|im_end|>'
    '<|im_assistant|>assistant<|im_middle|>'
)


def test_k3_conversation_renders_exactly():
    prompt = K3Format().render(CONVERSATION, tools=TOOLS, thinking="high")
    assert prompt.text == K3_EXPECTED
    assert prompt.thinking


def test_k2_conversation_renders_exactly():
    prompt = K2Format(think_tokens=True).render(CONVERSATION, tools=TOOLS, thinking="high")
    assert prompt.text == K2_EXPECTED
    assert not prompt.thinking  # the K2 reply opens <think> itself


def test_k3_user_text_spelling_a_marker_is_not_a_special_token(tmp_path):
    write_byte_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    prompt = K3Format().render(CONVERSATION, tools=TOOLS, thinking="high")
    ids = prompt.token_ids(tok)
    open_id = tok.special_tokens["<|open|>"]
    assert ids.count(open_id) == sum(1 for s in prompt.segments if s.special and s.text == "<|open|>")
    assert ids.count(open_id) == K3_EXPECTED.count("<|open|>") - 1  # all but the user's
    assert tok.decode(ids) == K3_EXPECTED
    assert ids[-1] == tok.special_tokens["<|sep|>"]
    assert chat_format_for(tok).stop_token_ids(tok) == [tok.special_tokens["<|end_of_msg|>"]]


def test_k3_thinking_off_and_default():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning_content": "r"},
            {"role": "user", "content": "again"}]
    off = K3Format().render(msgs, thinking="off").text
    assert off == (
        '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>yo<|close|>response<|sep|>'
        '<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>again<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    )
    default = K3Format().render(msgs).text
    assert "`thinking_effort=max`." in default
    assert default.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert '<|open|>think<|sep|>r<|close|>think<|sep|>' in default
    assert not K3Format().render(msgs, add_generation_prompt=False).text.endswith("<|open|>think<|sep|>")


@pytest.mark.parametrize("fmt", [K3Format(), K2Format()])
def test_unknown_effort_is_an_error_naming_it(fmt):
    with pytest.raises(ValueError, match="'medium'"):
        fmt.render([{"role": "user", "content": "x"}], thinking="medium")
    with pytest.raises(ValueError, match="'extreme'"):
        thinking_effort("extreme")


def test_thinking_effort_sources():
    assert thinking_effort() == "max"
    assert thinking_effort("low") == "low"
    assert thinking_effort("none") == "off"
    assert thinking_effort(None, {"thinking": False}) == "off"
    assert thinking_effort("high", {"enable_thinking": False}) == "off"
    assert thinking_effort(None, {"thinking_effort": "high"}) == "high"


def test_k3_tool_results_in_their_own_order_when_ids_do_not_match():
    msgs = [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "function": {"name": "f", "arguments": ""}},
            {"id": "b", "function": {"name": "g", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "b", "content": "1"},
        {"role": "tool", "tool_call_id": "zzz", "name": "h", "content": "2"},
    ]
    text = K3Format().render(msgs, thinking="off", add_generation_prompt=False).text
    assert text == (
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
        '<|open|>call tool="f" index="1"<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="g" index="2"<|sep|><|open|>json type="object"<|sep|>not json<|close|>json<|sep|>'
        '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="tool" tool="f" index="1"<|sep|>1<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="tool" tool="h" index="2"<|sep|>2<|close|>message<|sep|><|end_of_msg|>'
    )


def test_k3_system_tools_choice_format_and_images():
    msgs = [
        {"role": "developer", "content": "", "tools": [{"name": "z", "b": 1, "a": "é"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "?"}]},
    ]
    text = K3Format().render(msgs, thinking="off", tool_choice="required",
                             response_format={"type": "json_object"}).text
    assert text == (
        '<|open|>message role="system" type="tool-declare"<|sep|>## New Tools Available\nThe system dynamically extends '
        'the toolset via lazy-loading.\nYou have access to all existing and extended tools.\nHere are the specs for the '
        'extended tools.\n\n```json\n[{"a":"é","b":1,"name":"z"}]\n```<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|><|kimi_image_placeholder|>?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with `tool_choice=required`.\n'
        'You MUST call tools in the next message.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="system" type="response-format"<|sep|>The system is invoked with '
        '`response_format=json_object`.\nYou MUST answer with a raw JSON object: no code fences, no other text.'
        '<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    )
    none = K3Format().render([{"role": "user", "content": "x"}], thinking="off", tool_choice="none").text
    assert ('The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.'
            in none)


def test_k2_defaults_and_thinking_off():
    msgs = [{"role": "user", "content": "hi"}]
    assert K2Format(default_system=KIMI_LINEAR_DEFAULT_SYSTEM).render(msgs, thinking="off").text == (
        "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
        "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    text = K2Format(think_tokens=True).render(msgs, thinking="off").text
    assert text == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>"
    )
    # K2.5's image text (vision.md §4); the engine refuses images for a model without a tower
    out = K2Format().render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert "<|im_user|>user<|im_middle|><|media_begin|>image<|media_content|><|media_pad|><|media_end|><|im_end|>" in out.text
    assert out.images == [{"type": "image_url", "image_url": {"url": "x"}}] and not out.image_size_in_header


def test_chooser_and_stop_tokens(tmp_path):
    write_byte_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(chat_format_for(tok), K3Format)

    class K2Tok:
        def __init__(self):
            self.special_tokens = {"<|im_end|>": 5, "[EOS]": 6, "<think>": 7}

    fmt = chat_format_for(K2Tok(), {"model_type": "kimi_linear"})
    assert isinstance(fmt, K2Format) and fmt.think_tokens
    assert fmt.default_system == KIMI_LINEAR_DEFAULT_SYSTEM
    assert fmt.stop_token_ids(K2Tok()) == [5, 6]


CONTINUED = [{"role": "user", "content": "Write f."}, {"role": "assistant", "content": "def f(x):", "reasoning_content": "easy"}]


@pytest.mark.parametrize("fmt, thinking", [(K3Format(), "high"), (K3Format(), "off"), (K2Format(), "high"),
                                           (K2Format(), "off")])
def test_continue_final_message_stops_right_after_its_content(fmt, thinking):
    """As transformers defines it: the full render of the conversation, cut right after the final
    message's content; the tool-choice instruction still comes before the continued message."""
    full = fmt.render(CONTINUED, thinking=thinking, add_generation_prompt=False).text
    cut = fmt.render(CONTINUED, thinking=thinking, add_generation_prompt=False, continue_final_message=True)
    assert cut.text == full[:full.rindex("def f(x):") + len("def f(x):")]
    assert not cut.thinking
    named = {"type": "function", "function": {"name": "get_weather"}}
    with_choice = fmt.render(CONTINUED, thinking=thinking, tools=TOOLS, tool_choice=named,
                             add_generation_prompt=False, continue_final_message=True).text
    opener = '<|open|>message role="assistant"' if isinstance(fmt, K3Format) else "<|im_assistant|>"
    continued = cut.text[cut.text.rindex(opener):]
    assert with_choice.endswith(continued)  # the continued message is last, after the instruction
    assert "MUST call the tool `get_weather`" in with_choice[:-len(continued)]


def test_k3_continue_inside_the_reasoning():
    msgs = [CONTINUED[0], {"role": "assistant", "content": "", "reasoning_content": "First,"}]
    cut = K3Format().render(msgs, thinking="high", add_generation_prompt=False, continue_final_message=True)
    assert cut.text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>First,')
    assert cut.thinking  # the reply starts in the reasoning channel


@pytest.mark.parametrize("fmt", [K3Format(), K2Format()])
def test_continue_final_message_needs_a_plain_assistant_message_last(fmt):
    with pytest.raises(ValueError, match="must be the assistant's, not 'user'"):
        fmt.render(CONTINUED[:1], continue_final_message=True, add_generation_prompt=False)
    call = {**CONTINUED[1], "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}
    with pytest.raises(ValueError, match="tool_calls"):
        fmt.render([CONTINUED[0], call], continue_final_message=True, add_generation_prompt=False)
