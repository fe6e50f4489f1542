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
from tidal.serve.chat.prompt import RenderedPrompt
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


# ---- the K2 reply grammar (tidal.serve.chat.k2_constraints) --------------------------------------

@pytest.fixture(scope="module")
def k2(tmp_path_factory):
    """(format, tokenizer, compiler) of a byte-level tokenizer with the K2 format's special tokens."""
    from tidal.embedded import K2_SPECIAL_TOKENS, write_byte_tokenizer
    from tidal.serve.chat import chat_format_for

    out = tmp_path_factory.mktemp("k2-tok")
    write_byte_tokenizer(out, K2_SPECIAL_TOKENS, eos_token="[EOS]")
    k2_tok = load_tokenizer(out)
    return chat_format_for(k2_tok), k2_tok, GrammarCompiler(k2_tok, (k2_tok.special_tokens["[EOS]"],))


def _k2_reply(fmt, tok, calls: list[tuple[str, object]], content: str = "Sure.", reasoning: str = "") -> list[int]:
    """Token ids of a reply as the K2 renderer writes an assistant turn, after the generation
    prompt and before its stop token ``<|im_end|>``."""
    ask = [{"role": "user", "content": "hi"}]
    msg = {"role": "assistant", "content": content, "reasoning_content": reasoning,
           "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                          for i, (n, a) in enumerate(calls)]}
    prefix = fmt.render(ask, thinking="high").token_ids(tok)
    full = fmt.render([*ask, msg], thinking="high", add_generation_prompt=False).token_ids(tok)
    assert full[:len(prefix)] == prefix and full[-1] == tok.special_tokens["<|im_end|>"]
    return full[len(prefix):-1]


def _k2_accepts(fmt, compiler, ids: list[int], may_think: bool, **constraints) -> bool:
    grammar = fmt.reply_grammar(RenderedPrompt(may_think=may_think), **constraints)
    return _accepts(compiler, grammar, ids)


def test_k2_reply_grammar_accepts_rendered_calls_and_refuses_the_rest(k2):
    fmt, tok, compiler = k2
    assert fmt.name == "kimi_k2"
    weather = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
               "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
             {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    call = ("get_weather", {"city": "Paris", "days": 2})
    good = _k2_reply(fmt, tok, [call])
    bare = _k2_reply(fmt, tok, [call], content="")
    two = _k2_reply(fmt, tok, [call, ("search", {"q": "x"})], content="")
    plain = _k2_reply(fmt, tok, [])
    thought = _k2_reply(fmt, tok, [call], content="", reasoning="Let me see.")
    wrong = [_k2_reply(fmt, tok, [c]) for c in (("rm_rf", {"city": "x"}), ("get_weather", {"city": "P", "days": "2"}),
                                                 ("get_weather", {"days": 2}))]
    for may_think in (True, False):
        auto = {"tools": tools}
        assert all(_k2_accepts(fmt, compiler, ids, may_think, **auto) for ids in (good, bare, two, plain))
        assert not any(_k2_accepts(fmt, compiler, ids, may_think, **auto) for ids in wrong)
        assert _k2_accepts(fmt, compiler, thought, may_think, **auto) == may_think
        # required / named: calls and no content (OpenAI's forced call has content null)
        required = {"tools": tools, "tool_choice": "required"}
        assert _k2_accepts(fmt, compiler, bare, may_think, **required)
        assert _k2_accepts(fmt, compiler, two, may_think, **required)
        assert not any(_k2_accepts(fmt, compiler, ids, may_think, **required) for ids in (good, plain))
        assert not _k2_accepts(fmt, compiler, two, may_think, **required, parallel_tool_calls=False)
        named = {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        assert _k2_accepts(fmt, compiler, bare, may_think, **named)
        assert not _k2_accepts(fmt, compiler, two, may_think, **named)
        none = {"tools": tools, "tool_choice": "none"}
        assert _k2_accepts(fmt, compiler, plain, may_think, **none)
        assert not _k2_accepts(fmt, compiler, good, may_think, **none)
    # a content constraint holds the content, with or without calls after it
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"enum": ["x", "y"]}},
                                       "required": ["a"], "additionalProperties": False})
    assert _k2_accepts(fmt, compiler, _k2_reply(fmt, tok, [], content='{"a": "x"}'), False, content=so)
    assert not _k2_accepts(fmt, compiler, _k2_reply(fmt, tok, [], content='{"a": "z"}'), False, content=so)
    assert _k2_accepts(fmt, compiler, _k2_reply(fmt, tok, [call], content='{"a": "y"}'), False, content=so,
                       tools=tools)
    assert not _k2_accepts(fmt, compiler, plain, False, content=so)
    with pytest.raises(ValueError, match="not among the declared tools"):
        fmt.reply_grammar(RenderedPrompt(), tools=tools, tool_choice={"type": "function", "function": {"name": "x"}})
    assert fmt.reply_grammar(RenderedPrompt()) is None

