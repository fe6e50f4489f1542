"""A chat reply with no tools declared cannot call one: the server holds it to the K3 format's
skeleton (``K3Format.reply_grammar(prompt, skeleton=True)``: no ``tools`` element).

The embedded model needs it: asked "Count to three." under a terse system message at thinking off
and sampled at temperature 1, it opens a tools section on some seeds (checked below, so the test
fails if the model stops doing it and the prompt must be replaced), and a reply that the server
parses into a call of a tool nobody declared is a silent wrong answer.
"""

from __future__ import annotations

import json

import pytest
from live_server import MODEL
from test_server import claude, oai, server  # noqa: F401 - shared fixtures

from tidal import LLM, SamplingParams
from tidal.embedded import embedded_model_dir
from tidal.sampling_params import StructuredOutputsParams
from tidal.serve.chat import K2Format, K3Format
from tidal.serve.chat.prompt import RenderedPrompt

TERSE = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to three."}]
SEEDS = range(32)
FMT = K3Format()
OPENS_TOOLS = "<|open|>tools"


@pytest.fixture(scope="module")
def sampled() -> dict[str, list]:
    """Replies to TERSE at thinking off for SEEDS, free and held to the skeleton, offline."""
    llm = LLM(embedded_model_dir(), kv_cache_memory_bytes=64_000_000)
    tok = llm.engine.tokenizer
    prompt = FMT.render(TERSE, thinking="off")
    spec = StructuredOutputsParams(llguidance=FMT.reply_grammar(prompt, skeleton=True))
    out = {}
    for name, s in (("free", None), ("skeleton", spec)):
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, stop_token_ids=FMT.stop_token_ids(tok),
                                 skip_special_tokens=False, structured_outputs=s) for i in SEEDS]
        out[name] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": prompt.token_ids(tok)}] * len(SEEDS),
                                                        params)]
    return out


def calling_seeds(replies) -> list[int]:
    return [i for i, r in zip(SEEDS, replies) if OPENS_TOOLS in r.text]


def test_the_model_opens_a_tools_section_unheld_and_never_held(sampled):
    free = calling_seeds(sampled["free"])
    assert len(free) >= 2, "the embedded model no longer calls undeclared tools here: pick another prompt"
    assert calling_seeds(sampled["skeleton"]) == []
    ended = 0
    for i in free:
        r = sampled["skeleton"][i]
        assert not FMT.parse_full(r.text).tool_calls
        if r.finish_reason == "stop":  # the skeleton's end: response and message closed, then the stop token
            assert r.text.endswith("<|close|>response<|sep|><|close|>message<|sep|>"), (i, r.text)
            ended += 1
        else:  # cut by max_tokens while writing the response: text only
            assert r.finish_reason == "length" and "<|" not in r.text, (i, r.text)
    assert ended >= len(free) / 2, [sampled["skeleton"][i].text for i in free]


def test_the_skeleton_is_the_tool_choice_none_grammar():
    """With nothing declared, the skeleton is the grammar of tool_choice none (no tools element),
    thinking on and off; without ``skeleton`` nothing is constrained, as before."""
    tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for thinking in (False, True):
        prompt = RenderedPrompt(thinking=thinking)
        assert FMT.reply_grammar(prompt) is None
        bare = FMT.reply_grammar(prompt, skeleton=True)
        assert bare == FMT.reply_grammar(prompt, tools=tool, tool_choice="none")
        assert "tools" not in json.loads(bare)["grammars"][0]["lark_grammar"]
        # a content constraint or declared tools build the same grammar with or without skeleton
        assert (FMT.reply_grammar(prompt, tools=tool, skeleton=True) == FMT.reply_grammar(prompt, tools=tool))
    assert K2Format().reply_grammar(RenderedPrompt(), skeleton=True) is None  # K2 replies stay free


def test_served_replies_without_tools_call_none(oai, claude, sampled):  # noqa: F811
    """The server (chat completions, Anthropic messages, Responses) on the seeds whose free
    reply opens a tools section: no call; the chat replies are the offline held ones (the same
    grammar, seed and sampling: text, and ending at the stop token or max_tokens as they do)."""
    seeds = calling_seeds(sampled["free"])
    for i in seeds:
        r = oai.chat.completions.create(model=MODEL, messages=TERSE, reasoning_effort="off", temperature=1.0,
                                        seed=i, max_tokens=64)
        choice, held = r.choices[0], sampled["skeleton"][i]
        assert not choice.message.tool_calls, (i, choice)
        assert choice.finish_reason == held.finish_reason and choice.message.content == FMT.parse_full(held.text).content
    for _ in range(8):  # /v1/messages takes no seed: 8 draws, where the free rate is 1 in 4
        m = claude.messages.create(model=MODEL, system="You are terse.", max_tokens=64,
                                   messages=[{"role": "user", "content": "Count to three."}])
        assert m.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in m.content), m
    resp = oai.responses.create(model=MODEL, instructions="You are terse.", input="Count to three.",
                                reasoning={"effort": "low"}, max_output_tokens=64, temperature=1.0)
    assert all(item.type != "function_call" for item in resp.output), resp


def test_ignore_eos_stays_free(oai):  # noqa: F811
    """ignore_eos (bench clients: exactly max_tokens) keeps a free reply: the skeleton would end it."""
    r = oai.chat.completions.create(model=MODEL, messages=TERSE, reasoning_effort="off", max_tokens=40,
                                    temperature=1.0, seed=9, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
