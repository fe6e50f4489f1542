"""vLLM's chat extensions through the official SDK against the live server: ``continue_final_message``
(with ``add_generation_prompt``; in chat and ``/tokenize`` alike) and ``prompt_logprobs`` in chat
and completions. What the reply is, is checked against a /v1/completions run on the very token
ids ``/tokenize`` renders."""

from __future__ import annotations

import httpx
import openai
import pytest
from live_server import MODEL
from test_server import auth, oai, server, tok  # noqa: F401 - shared fixtures

CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
MESSAGES = [{"role": "user", "content": "Write a function."}, {"role": "assistant", "content": "def f(x):"}]


def tokenize(server, messages, **kw) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages, **kw}, headers=auth(),
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_continue_final_message_continues_the_assistant_text(server, oai, tok):
    ids = tokenize(server, MESSAGES, **CONTINUE)
    assert tok.decode(ids).endswith('<|open|>response<|sep|>def f(x):')
    assert ids != tokenize(server, MESSAGES) and len(ids) < len(tokenize(server, MESSAGES, add_generation_prompt=False))
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    r = oai.chat.completions.create(**kw, extra_body={**CONTINUE, "token_healing": False})
    assert r.usage.prompt_tokens == len(ids)
    plain = oai.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                   extra_body={"skip_special_tokens": False})
    text = plain.choices[0].text
    content = r.choices[0].message.content or ""
    assert content and text.startswith(content)  # the reply parser cuts at a marker, if one comes
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        **kw, stream=True, extra_body={**CONTINUE, "token_healing": False}) if c.choices)
    assert streamed == content


def test_continued_message_ending_in_a_newline_is_healed(server, oai, tok):
    """The continued text ends inside a token ("\\n" before the indent): the healed reply is what
    the message without the newline gets, less that newline."""
    cut = [MESSAGES[0], {"role": "assistant", "content": "def f(x):\n"}]
    kw = {"model": MODEL, "temperature": 0}
    healed = oai.chat.completions.create(messages=cut, max_tokens=8, extra_body=CONTINUE, **kw)
    whole = oai.chat.completions.create(messages=MESSAGES, max_tokens=8, extra_body=CONTINUE, **kw)
    assert "\n" + healed.choices[0].message.content == whole.choices[0].message.content
    assert healed.usage.prompt_tokens == len(tokenize(server, cut, **CONTINUE))
    assert healed.usage.completion_tokens == 8


def test_continue_final_message_errors(server, oai):
    kw = {"model": MODEL, "max_tokens": 2}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(messages=MESSAGES, extra_body={"continue_final_message": True}, **kw)
    assert e.value.body["param"] == "continue_final_message" and "add_generation_prompt" in e.value.message
    with pytest.raises(openai.BadRequestError, match="must be the assistant's, not 'user'"):
        oai.chat.completions.create(messages=MESSAGES[:1], extra_body=CONTINUE, **kw)
    r = httpx.post(f"{server.url}/tokenize", headers=auth(), timeout=60,
                   json={"model": MODEL, "messages": MESSAGES, "continue_final_message": True})
    assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"]


def test_chat_prompt_logprobs(server, oai, tok):
    messages = MESSAGES[:1]
    ids = tokenize(server, messages)
    kw = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
    assert oai.chat.completions.create(**kw).model_extra.get("prompt_logprobs") is None
    for k in (0, 2):
        r = oai.chat.completions.create(**kw, extra_body={"prompt_logprobs": k})
        plp = r.model_extra["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for t, entry in zip(ids[1:], plp[1:]):
            assert entry[str(t)]["decoded_token"] == tok.decode([t])
            assert all(v["logprob"] <= 0 for v in entry.values())
            # the prompt token itself and the k likeliest
            assert {v["rank"] for v in entry.values()} == set(range(1, k + 1)) | {entry[str(t)]["rank"]}
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        oai.chat.completions.create(**kw, stream=True, extra_body={"prompt_logprobs": 1})
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(**kw, extra_body={"prompt_logprobs": -2})


def test_completion_prompt_logprobs_match_echoed_logprobs(oai, tok):
    prompt = "import numpy as np\nx = np."
    ids = tok.encode(prompt)
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = oai.completions.create(**kw, extra_body={"prompt_logprobs": 1})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    echo = oai.completions.create(**kw, echo=True, logprobs=1).choices[0].logprobs
    assert len(plp) == len(ids) and plp[0] is None and r.usage.prompt_tokens == len(ids)
    for t, entry, lp in zip(ids[1:], plp[1:], echo.token_logprobs[1:len(ids)]):
        assert entry[str(t)]["logprob"] == pytest.approx(lp, abs=1e-4)
