"""The grammar engine (llguidance) and token healing's prefix constraint on the embedded model's
tokenizer: masks against brute-force references, random walks through the masks that always
end in text the grammar accepts, and the engine enforcing a schema end to end."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from tidal.embedded import embedded_model_dir
from tidal.engine.grammar import GrammarCompiler, PrefixConstraint, TokenTrie, allowed_tokens, unpack_bitmask
from tidal.sampling_params import SamplingParams, StructuredOutputsParams
from tidal.tokenizer import load_tokenizer

EOS = (2, 1)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(embedded_model_dir())


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, EOS)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"enum": ["S", "M", "L"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        "pos": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
                "additionalProperties": False},
    },
    "required": ["name", "size", "tags", "pos"],
    "additionalProperties": False,
}


def walk(compiler, tok, spec, seed: int, limit: int = 200) -> str:
    """Draw uniformly among the allowed tokens until only a stop token is allowed."""
    rng = random.Random(seed)
    m = compiler.compile(spec).matcher(EOS)
    out: list[int] = []
    for _ in range(limit):
        allowed = allowed_tokens([m], tok.vocab_size)[0].nonzero().flatten().tolist()
        assert allowed, tok.decode(out)
        ordinary = [t for t in allowed if t not in EOS]
        if not ordinary or (set(EOS) & set(allowed) and rng.random() < 0.5):
            return tok.decode(out)
        t = rng.choice(ordinary)
        m.accept(t)
        assert m.failed is None
        out.append(t)
    raise AssertionError(f"no end after {limit} tokens: {tok.decode(out)!r}")


def test_bitmask_unpacking_matches_bits():
    words = torch.tensor([[0b1011, -(2**31)], [0, 1]], dtype=torch.int32)
    bits = unpack_bitmask(words, 70)
    assert bits.shape == (2, 70)
    assert bits[0].nonzero().flatten().tolist() == [0, 1, 3, 63]
    assert bits[1].nonzero().flatten().tolist() == [32]


@pytest.mark.parametrize("seed", range(6))
def test_random_walks_through_a_schema_validate(compiler, tok, seed):
    text = walk(compiler, tok, StructuredOutputsParams(json=SCHEMA), seed, limit=400)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_and_lark(compiler, tok):
    for seed in range(4):
        assert re.fullmatch(r"[a-c]{2,5}-\d\d", walk(compiler, tok, StructuredOutputsParams(regex=r"[a-c]{2,5}-\d\d"), seed))
        assert walk(compiler, tok, StructuredOutputsParams(choice=["red", "green", "blue sky"]), seed) in (
            "red", "green", "blue sky")
        text = walk(compiler, tok, StructuredOutputsParams(grammar='start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'),
                    seed)
        assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", text), text
    # GBNF as llama.cpp writes it
    text = walk(compiler, tok, StructuredOutputsParams(grammar='root ::= "yes" | "no"'), 0)
    assert text in ("yes", "no")


def test_mask_forbids_what_the_grammar_cannot_continue(compiler, tok):
    m = compiler.compile(StructuredOutputsParams(json=SCHEMA)).matcher(EOS)
    allowed = allowed_tokens([m], tok.vocab_size)[0]
    for t in range(tok.vocab_size):
        if allowed[t]:
            assert "{".startswith(tok.decode([t])[:1]) and tok.decode([t]).startswith("{"), tok.decode([t])
    assert not allowed[list(EOS)].any()


def test_compiled_grammars_are_cached_and_errors_name_the_problem(compiler):
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"q": {"type": "integer"}}})
    before = compiler.num_compiled
    a, b = compiler.compile(spec), compiler.compile(StructuredOutputsParams(json=dict(spec.json)))
    assert a is b and compiler.num_compiled == before + 1
    with pytest.raises(ValueError, match="grammar"):
        compiler.compile(StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="not valid JSON"):
        compiler.compile(StructuredOutputsParams(json="{nope"))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])


@pytest.mark.parametrize("prefix", [b"\n", b"\n  ", b"ello", b"):", b"\xe4\xb8"])
def test_prefix_constraint_matches_brute_force(tok, prefix):
    trie = TokenTrie(tok, tok.vocab_size)
    got = allowed_tokens([PrefixConstraint(trie, tok, prefix)], tok.vocab_size)[0].nonzero().flatten().tolist()
    want = [t for t in range(tok.vocab_size) if t not in tok.special_ids and (b := tok.token_bytes(t))
            and (b.startswith(prefix) or prefix.startswith(b))]
    assert got == want
    c = PrefixConstraint(trie, tok, prefix)
    c.accept(want[0])
    assert c.finished or prefix.startswith(tok.token_bytes(want[0]))


def test_engine_enforces_a_schema_greedy_and_sampled():
    from tidal import LLM

    llm = LLM(kv_cache_memory_bytes=32_000_000)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 500},
                                                "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    so = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so),
              SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=so),
              SamplingParams(temperature=0, max_tokens=12)]
    outs = llm.generate(["def f(x):", "import os", "def f(x):"], params)
    for out in outs[:2]:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    assert not outs[2].outputs[0].text.startswith("{")  # the unconstrained row in the same batch


# ---- the K3 reply grammar (tidal.serve.chat.constraints) -----------------------------------------

def _reply_ids(tok, thinking: bool, calls: list[tuple[str, object]], content: str = "Sure.") -> list[int]:
    """Token ids of a reply as the K3 renderer writes an assistant turn, after the generation
    prompt (``<|open|>message role="assistant"<|sep|><|open|>think|response<|sep|>``)."""
    from tidal.serve.chat.prompt import RenderedPrompt
    from tidal.serve.chat.xtml import XtmlWriter, _assistant

    w = XtmlWriter()
    msg = {"role": "assistant", "content": content, "reasoning_content": "Let me see.",
           "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                          for i, (n, a) in enumerate(calls)]}
    _assistant(w, msg, thinking)
    # Drop open(message) and open(think | response) (3 segments each) and <|end_of_msg|>.
    return RenderedPrompt(w.out.segments[6:-1]).token_ids(tok)


def _accepts(compiler, grammar: str, ids: list[int]) -> bool:
    m = compiler.compile(StructuredOutputsParams(llguidance=grammar)).matcher(EOS).matcher
    return all(m.consume_token(t) for t in ids) and m.is_accepting()


def test_reply_grammar_accepts_rendered_calls_and_refuses_the_rest(compiler, tok):
    from tidal.serve.chat.constraints import reply_grammar

    weather = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
               "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    for thinking in (True, False):
        good = _reply_ids(tok, thinking, [("get_weather", {"city": "Paris", "days": 2})])
        plain = _reply_ids(tok, thinking, [])
        undeclared = _reply_ids(tok, thinking, [("rm_rf", {"city": "x"})])
        bad_type = _reply_ids(tok, thinking, [("get_weather", {"city": "Paris", "days": "two"})])
        missing = _reply_ids(tok, thinking, [("get_weather", {"days": 2})])
        auto = reply_grammar(thinking=thinking, tools=tools)
        assert _accepts(compiler, auto, good) and _accepts(compiler, auto, plain)
        for wrong in (undeclared, bad_type, missing):
            assert not _accepts(compiler, auto, wrong)
        required = reply_grammar(thinking=thinking, tools=tools, tool_choice="required")
        assert _accepts(compiler, required, good) and not _accepts(compiler, required, plain)
        none = reply_grammar(thinking=thinking, tools=tools, tool_choice="none")
        assert _accepts(compiler, none, plain) and not _accepts(compiler, none, good)
    with pytest.raises(ValueError, match="not among the declared tools"):
        reply_grammar(thinking=True, tools=tools, tool_choice={"type": "function", "function": {"name": "x"}})
    assert reply_grammar(thinking=True) is None
