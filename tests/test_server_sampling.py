"""Sampling extras through the official SDK against the live server: n > 1 (seeded, streamed and
not), logit_bias, penalties, and their errors. The sampler's arithmetic is checked against hand
computations in test_sampler.py; here the wiring."""

from __future__ import annotations

import openai
import pytest
from live_server import MODEL
from test_server import claude, oai, server, tok  # noqa: F401 - shared fixtures

HOT = {"temperature": 1.5, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


def test_chat_n3_seeded_samples_differ_and_reproduce(oai):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "n": 3, "seed": 5, **HOT}
    a = oai.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [(c.message.reasoning_content or "") + (c.message.content or "") for c in a.choices]
    assert len(set(texts)) == 3
    b = oai.chat.completions.create(**kw)
    assert [(c.message.reasoning_content or "") + (c.message.content or "") for c in b.choices] == texts
    assert a.usage.completion_tokens == 3 * 8
    one = oai.chat.completions.create(**{**kw, "n": 1, "seed": 7})  # sample 2 is seeded seed + 2
    assert (one.choices[0].message.reasoning_content or "") + (one.choices[0].message.content or "") == texts[2]
    streamed = ["", "", ""]
    for chunk in oai.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            d = c.delta
            streamed[c.index] += (getattr(d, "reasoning_content", None) or "") + (d.content or "")
    assert streamed == texts


def test_completions_n_with_several_prompts(oai):
    r = oai.completions.create(model=MODEL, prompt=["def f(", "import"], n=2, seed=3, **HOT)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text != r.choices[1].text
    alone = oai.completions.create(model=MODEL, prompt="import", seed=4, **HOT)
    assert alone.choices[0].text == r.choices[3].text
    assert r.usage.completion_tokens == 4 * 8
    single = oai.completions.create(model=MODEL, prompt=["def f(", "import"], seed=3, **HOT)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # each prompt counted once


def test_logit_bias_forces_a_token(oai, tok):
    [t] = tok.encode(" the")
    r = oai.completions.create(model=MODEL, prompt="x = 1", max_tokens=4, temperature=0, logit_bias={str(t): 100},
                               extra_body={"ignore_eos": True})
    assert r.choices[0].text == " the" * 4


def test_penalties_are_accepted(oai):
    r = oai.completions.create(model=MODEL, prompt="a a a a", max_tokens=6, temperature=0, presence_penalty=1.5,
                               frequency_penalty=1.0, extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    assert r.usage.completion_tokens == 6


def test_logit_bias_outside_the_vocabulary_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"9000": 5})
    assert "token id 9000" in str(e.value) and "8192" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=2, presence_penalty=3)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                    logit_bias={"abc": 1})


def test_completions_heal_text_prompts_and_report_the_prompt_as_sent(oai, tok):
    cut = "def f(x):\n"  # "\n" + indentation is one token: the plain run writes no body
    ids = tok.encode(cut)
    unsplit = tok.decode(ids[:-1])
    kw = {"model": MODEL, "max_tokens": 10, "temperature": 0}
    healed = oai.completions.create(prompt=cut, **kw)
    whole = oai.completions.create(prompt=unsplit, **kw)
    assert cut + healed.choices[0].text == unsplit + whole.choices[0].text
    assert (healed.usage.prompt_tokens, healed.usage.completion_tokens) == (len(ids), 10)  # the prompt as sent
    off = oai.completions.create(prompt=cut, extra_body={"token_healing": False}, **kw)
    assert off.choices[0].text != healed.choices[0].text
    assert oai.completions.create(prompt=ids, **kw).choices[0].text == off.choices[0].text  # token ids: as sent
    streamed = "".join(c.choices[0].text for c in oai.completions.create(prompt=cut, stream=True, **kw))
    assert streamed == healed.choices[0].text
    echo = oai.completions.create(prompt=cut, echo=True, logprobs=1, **kw)
    echo_off = oai.completions.create(prompt=cut, echo=True, logprobs=1, extra_body={"token_healing": False}, **kw)
    assert echo.choices[0].text == cut + healed.choices[0].text
    lp, lp_off = echo.choices[0].logprobs, echo_off.choices[0].logprobs
    assert lp.tokens[:len(ids)] == lp_off.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and "".join(lp.tokens) == echo.choices[0].text
    assert len(lp.tokens) == len(ids) + 10 and lp.tokens[len(ids)] == "   "  # "\n   " past the prompt's "\n"
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(lp_off.token_logprobs[1:len(ids)], abs=1e-4)
