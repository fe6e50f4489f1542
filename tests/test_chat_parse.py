"""Reply parsers on hand-written model outputs in both formats: fed whole, at every split point,
char by char and token by token (through the detokenizer), they must always give the same
reasoning, content and tool calls."""

import json

import pytest

from tidal.serve.chat import (
    ContentDelta,
    K2Format,
    K3Format,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallStart,
)
from tidal.detokenizer import Detokenizer
from tidal.tokenizer import load_tokenizer, save_tiktoken_ranks

K3 = K3Format()
K2 = K2Format()
MARKERS = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "<|im_end|>", "<think>",
           "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A tiktoken-format tokenizer with both formats' markers and a few merges, so tokens are
    sometimes several characters and sometimes a fraction of one."""
    d = tmp_path_factory.mktemp("tok")
    ranks = {bytes([b]): b for b in range(256)}
    for m in [b"th", b"in", b"er", b"on", b"ca", b"ll", b"ea", b"es", b"ar", b"re", b"ys", b"yes"]:
        ranks[m] = len(ranks)
    save_tiktoken_ranks(d / "tiktoken.model", ranks)
    names = {str(len(ranks) + k): {"content": m, "special": True} for k, m in enumerate(MARKERS)}
    (d / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": names}))
    return load_tokenizer(d)


# K3: (thinking, reply text, reasoning, content, [(tool name, arguments)]); K2: the same without thinking.
K3_CASES = {
    "full": (True,
             ('I should call 🙂 tools.<|close|>think<|sep|><|open|>response<|sep|>Let me check 中文.<|close|>response<|sep|>'
             '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
             '<|open|>argument key="city" type="string"<|sep|>Paris, "FR" \\ é\n<|close|>argument<|sep|>'
             '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
             '<|open|>call tool="search" index="2"<|sep|>'
             '<|open|>argument key="filter" type="object"<|sep|>{"tags": ["a", "b"], "n": 1.5}<|close|>argument<|sep|>'
             '<|open|>argument key="exact" type="boolean"<|sep|>true<|close|>argument<|sep|>'
             '<|open|>argument key="ids" type="array"<|sep|>[1,2]<|close|>argument<|sep|><|close|>call<|sep|>'
             '<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>'),
             "I should call 🙂 tools.", "Let me check 中文.",
             [("get_weather", {"city": 'Paris, "FR" \\ é\n', "days": 3}),
              ("search", {"filter": {"tags": ["a", "b"], "n": 1.5}, "exact": True, "ids": [1, 2]})]),
    "no_thinking": (False,
                    "Plain <b>html</b>, a < sign and <|x|>.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
                    "", "Plain <b>html</b>, a < sign and <|x|>.", []),
    "json_call": (True,
                  ('<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
                  '<|open|>call tool="run&quot;x&amp;y" index="1"<|sep|><|open|>json type="object"<|sep|>{"cmd": "ls"}'
                  '<|close|>json<|sep|><|close|>call<|sep|><|open|>call tool="noop" index="2"<|sep|><|close|>call<|sep|>'
                  '<|close|>tools<|sep|><|close|>message<|sep|>'),
                  "", "", [('run"x&y', {"cmd": "ls"}), ("noop", {})]),
    "malformed": (True,
                  ('Think <|open|> about <|close|>nothing<|sep|> here<|sep|>.<|close|>think<|sep|>'
                  '<|open|>response<|sep|>Use <|open|>bogus tag<|sep|> and <|open|>call tool="x"<|sep|>!'
                  '<|close|>response<|sep|> trailing <|open|>tools<|sep|>junk<|open|>call tool="f" index="1"<|sep|>'
                  '<|open|>argument key="n" type="number"<|sep|>not json<|close|>argument<|sep|><|close|>call<|sep|>'
                  '<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>'),
                  "Think  about nothing here.",  # the markers go, the text stays
                  'Use bogus tag and call tool="x"! trailing junk',
                  [("f", {"n": "not json"})]),
    "cut_partial_marker": (False, "a <| b <|op x <|open|", "", "a <| b <|op x <|open|", []),
    "restated_message_open": (False,
                              ('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>r<|close|>think<|sep|>'
                              '<|open|>response<|sep|>c<|close|>response<|sep|><|close|>message<|sep|>'),
                              "r", "c", []),
}

K2_CASES = {
    "full": (('<think>Plan: call 🙂.</think>Sure, 中文.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
             '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>\n<|tool_call_begin|>'
             'functions.search:1<|tool_call_argument_begin|>{"filter": {"tags": ["a"]}, "q": "x<y"}<|tool_call_end|>'
             '<|tool_calls_section_end|><|im_end|>'),
             "Plan: call 🙂.", "Sure, 中文.",
             [("get_weather", {"city": "Paris", "days": 3}), ("search", {"filter": {"tags": ["a"]}, "q": "x<y"})]),
    "reasoning_into_tools": (("<think>hmm<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                             "<|tool_call_argument_begin|><|tool_call_end|><|tool_calls_section_end|>"),
                             "hmm", "", [("f", {})]),
    "plain": ("x < y and <thinking> is not <think> here</think>", "", "x < y and <thinking> is not <think> here</think>", []),
    "malformed": (('<|tool_call_begin|>oops<|tool_call_end|> text <|tool_calls_section_begin|> junk <|tool_call_begin|>'
                  'functions.g:2<|tool_call_argument_begin|> {"a": 1} <|tool_call_end|>'),
                  "", "<|tool_call_begin|>oops<|tool_call_end|> text  junk ", [("g", {"a": 1})]),
    "leading_space": ("\n <think>r</think>\n\nAnswer<|im_end|>", "r", "\n\nAnswer", []),
}


def make_id(i):
    return f"id{i}"


def run(fmt, thinking, pieces):
    """Feed pieces; return the final reply and every event, checking the stream's shape."""
    parser = fmt.parser(thinking, make_id)
    events = []
    for p in pieces:
        events += parser.feed(p)
    events += parser.finish()
    started = set()
    for ev in events:
        if isinstance(ev, ToolCallStart):
            assert ev.index == len(started)
            started.add(ev.index)
        elif isinstance(ev, ToolCallDelta):
            assert ev.index in started
        else:
            assert isinstance(ev, (ContentDelta, ReasoningDelta)) and ev.text
    return parser.result, events


def summary(result):
    return (result.reasoning, result.content, [(c.name, c.arguments) for c in result.tool_calls])


def all_feeds(text, tok):
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    detok = Detokenizer(tok)
    yield [detok.add(t) for t in tok.encode(text, allow_special=True)] + [detok.flush()]


def check(fmt, thinking, text, reasoning, content, calls, tok):
    whole, _ = run(fmt, thinking, [text])
    assert whole.reasoning == reasoning
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    assert whole.finish_reason == ("tool_calls" if calls else "stop")
    expected = summary(whole)
    for pieces in all_feeds(text, tok):
        result, _ = run(fmt, thinking, pieces)
        assert summary(result) == expected, pieces


@pytest.mark.parametrize("case", list(K3_CASES))
def test_k3_reply(case, tok):
    thinking, text, reasoning, content, calls = K3_CASES[case]
    check(K3, thinking, text, reasoning, content, calls, tok)


@pytest.mark.parametrize("case", list(K2_CASES))
def test_k2_reply(case, tok):
    text, reasoning, content, calls = K2_CASES[case]
    check(K2, False, text, reasoning, content, calls, tok)


def test_k2_call_ids_come_from_the_model():
    result = K2.parse_full(K2_CASES["full"][0])
    assert [c.id for c in result.tool_calls] == ["functions.get_weather:0", "functions.search:1"]


CUT_CALL = ('Ok<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="a" index="1"<|sep|><|close|>call<|sep|>'
            '<|open|>call tool="f" index="2"<|sep|><|open|>argument key="q" type="string"<|sep|>ab"c')


@pytest.mark.parametrize("tail", ["", "<|clo", "<|close|>argument<|sep|><|open|>argument key=\"n\" type",
                                  "<|close|>argument<|sep|><|open|>argument key=\"n\" type=\"number\"<|sep|>1"])
def test_k3_cut_off_call_is_dropped(tail, tok):
    """A call the reply did not finish (max_tokens) never goes out, however it was cut; the
    finished one before it does, and no marker or header text reaches the content."""
    for pieces in all_feeds(CUT_CALL + tail, tok):
        result, events = run(K3, False, pieces)
        assert result.content == "Ok"
        assert [(c.name, c.arguments) for c in result.tool_calls] == [("a", "{}")]
    parser = K3.parser(False, make_id)
    parser.parse_full(CUT_CALL + tail)
    assert parser.dropped_call is not None and parser.dropped_call.name == "f"
    assert parser.dropped_call.partial_arguments.startswith('{"q":"ab\\"c')


def test_k2_cut_off_call_is_dropped():
    text = ('Hi<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1}'
            '<|tool_call_end|><|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{"city": "')
    parser = K2.parser(False, make_id)
    result = parser.parse_full(text)
    assert result.content == "Hi" and [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [("f", {"a": 1})]
    assert parser.dropped_call.name == "g"
    assert K2.parse_full("Hi<|tool_calls_section_begin|><|tool_call_begin|>functions.g").content == "Hi"
    # Markers the tokenizer has as special tokens never show up as text, even out of place.
    k2 = K2Format(other_specials=tuple(MARKERS))
    assert k2.parse_full(K2_CASES["malformed"][0]).content == "oops text  junk "
    assert k2.parse_full("a[BOS]b<|open|>c").content == "abc"


def test_k3_after_the_message_ends_text_is_content_without_markers(tok):
    """With ignore_eos the model writes on past <|end_of_msg|>: that is content, never a special
    token, and it streams as it comes (nothing waits for the end)."""
    fmt = K3Format(other_specials=tuple(MARKERS))
    text = ('<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|><|close|>message<|sep|>'
            '<|end_of_msg|>[EOS]<|open|>message role="system"<|sep|>more<|close|>message<|sep|><|end_of_msg|>x')
    for pieces in all_feeds(text, tok):
        result, _ = run(fmt, True, pieces)
        assert result.content == 'Himessage role="system"moremessagex'
    parser = fmt.parser(True, make_id)
    assert parser.feed(text[:text.index("[EOS]")]) == [ContentDelta("Hi")]
    assert parser.feed("[EOS]<|open|>message") == [ContentDelta("message")]
    assert parser.feed(' role="system"<|sep|>mo') == [ContentDelta(' role="system"mo')]


def test_k3_text_between_elements_is_not_held(tok):
    """Text after a closed element goes out as soon as it is more than whitespace."""
    parser = K3.parser(False, make_id)
    assert parser.feed("a<|close|>response<|sep|>") == [ContentDelta("a")]
    assert parser.feed("\n ") == []  # whitespace between elements: dropped if an element follows
    assert parser.feed("b") == [ContentDelta("\n b")]
    assert parser.feed("c") == [ContentDelta("c")]


def test_streamed_events_hold_back_markers():
    """Token by token, a marker never shows up in content, even half of one."""
    parser = K3.parser(thinking=True, make_id=make_id)
    text = K3_CASES["full"][1]
    seen = []
    for ch in text:
        seen.append(parser.in_reasoning)
        for ev in parser.feed(ch):
            if isinstance(ev, (ContentDelta, ReasoningDelta)):
                assert "<" not in ev.text and "|" not in ev.text
    parser.finish()
    assert seen[0] and not seen[-1]
    assert sum(seen) == len("I should call 🙂 tools.<|close|>think<|sep|>")
    starts = [ev for ev in K3.parser(True, make_id).feed(text) if isinstance(ev, ToolCallStart)]
    assert starts == [ToolCallStart(0, "id0", "get_weather"), ToolCallStart(1, "id1", "search")]


def test_rendered_history_round_trips_through_the_parser():
    """What the K3 renderer writes for an assistant turn parses back to the same turn."""
    msg = {"role": "assistant", "content": "Done <b>.", "reasoning_content": "why",
           "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": '{"s": "a\\"b", "n": 2, "o": {"k": [1]}}'}}]}
    text = K3.render([msg], thinking="high", add_generation_prompt=False).text
    reply = text[text.index('<|open|>message role="assistant"'):]
    result = K3.parse_full(reply, thinking=False)
    assert (result.reasoning, result.content) == ("why", "Done <b>.")
    assert json.loads(result.tool_calls[0].arguments) == {"s": 'a"b', "n": 2, "o": {"k": [1]}}
