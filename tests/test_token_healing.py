"""Token healing: a prompt that ends inside what the tokenizer would have made one token is backed
off by its last token and the output is constrained to start with that token's bytes.

On the embedded model, hand-made boundary cases (a newline before indentation, the middle of a
word) give what the unsplit prompt gives, where the plain run derails; the prompt is reported as
sent (ids, prompt logprobs); stop strings and max_tokens count from the prompt's end. On tiny
random models: a merge tokenizer heals (the first token is the masked argmax), a byte-level one
has nothing to heal."""

from __future__ import annotations

import pytest
import torch
from test_tokenizer import make_tiktoken_dir

from tidal import LLM, SamplingParams
from tidal.config import ModelConfig
from tidal.engine.grammar import TokenTrie, healing_split
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.presets import tiny_k3_dict
from tidal.sampling_params import StructuredOutputsParams
from tidal.tokenizer import load_tokenizer

GREEDY = {"temperature": 0.0, "max_tokens": 12}
# (cut prompt, where it ends): each ends on a token that a longer token extends. The plain run
# differs from the unsplit prompt's continuation on every one (checked below).
BOUNDARIES = [
    "def f(x):\n",  # "\n" + indentation is one token in training
    "def clamp(x, lo, hi):\n",
    "def __ini",  # mid-word: __init__
    "    return self._ge",  # mid-word: the model's _get_value
    'if __name__ == "__ma',
]


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_bytes=32_000_000)


def run(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**{**GREEDY, **kw}))[0]


@pytest.mark.parametrize("cut", BOUNDARIES)
def test_healed_prompt_gives_what_the_unsplit_prompt_gives(llm, cut):
    tok = llm.engine.tokenizer
    ids = tok.encode(cut)
    unsplit = tok.decode(ids[:-1])  # the prompt ending at the last boundary the tokenizer made
    assert healing_split(ids, llm.engine.token_trie()) == ids[-1]
    whole = unsplit + run(llm, unsplit).outputs[0].text
    healed = run(llm, cut, token_healing=True)
    plain = run(llm, cut).outputs[0].text
    assert whole.startswith(cut)
    assert cut + healed.outputs[0].text == whole
    assert cut + plain != whole  # without healing the boundary derails the continuation
    out = healed.outputs[0]
    # Here the first token runs past the cut (the indent, the rest of the word): it is the first
    # completion token, and what it shows past the prompt is its text.
    assert tok.decode(out.token_ids).startswith(tok.decode(ids[-1:])) and len(out.token_ids) == GREEDY["max_tokens"]
    assert healed.prompt_token_ids == ids  # the prompt as sent


def test_prompt_logprobs_describe_the_prompt_as_sent(llm):
    cut = "def clamp(x, lo, hi):\n"
    healed = run(llm, cut, token_healing=True, prompt_logprobs=3)
    plain = run(llm, cut, prompt_logprobs=3)
    assert len(healed.prompt_logprobs) == len(plain.prompt_logprobs) == len(plain.prompt_token_ids)
    assert healed.prompt_logprobs[0] is None
    for h, p, t in zip(healed.prompt_logprobs[1:], plain.prompt_logprobs[1:], plain.prompt_token_ids[1:]):
        assert set(h) == set(p) and t in h
        for k in p:
            assert h[k].logprob == pytest.approx(p[k].logprob, abs=1e-4) and h[k].rank == p[k].rank


def test_stop_strings_and_max_tokens_count_from_the_prompt_end(llm):
    cut = "def f(x):\n"
    whole = run(llm, cut, token_healing=True, max_tokens=30).outputs[0].text
    assert whole.startswith("    ") and "\n" in whole  # the healed "\n" comes back as the indent's token
    stopped = run(llm, cut, token_healing=True, max_tokens=30, stop=["\n"]).outputs[0]
    assert stopped.finish_reason == "stop" and stopped.text == whole[:whole.index("\n")]
    one = run(llm, cut, token_healing=True, max_tokens=1).outputs[0]
    assert len(one.token_ids) == 1 and one.text == "   "  # "\n   ", less the prompt's "\n"


@pytest.mark.parametrize("cut", ["The quick bro", "xyz", "def f(x):\n"])
def test_sampled_outputs_continue_the_prompt_and_their_logprobs_spell_the_text(llm, cut):
    """Tokens that only re-spell the prompt's end are no completion tokens; the first that runs
    past it is, named by what it shows past the prompt; so the tokens spell the text."""
    tok = llm.engine.tokenizer
    ids = tok.encode(cut)
    for seed in range(4):
        out = run(llm, cut, token_healing=True, temperature=1.0, seed=seed, max_tokens=6, logprobs=0,
                  min_tokens=6).outputs[0]
        assert len(out.token_ids) == len(out.logprobs) == 6
        assert "".join(e[t].decoded_token for t, e in zip(out.token_ids, out.logprobs)) == out.text
        respelled = tok.decode(ids[-1:])
        first = tok.decode(out.token_ids[:1])
        assert first.startswith(respelled) or not respelled.startswith(first)  # never contradicts the cut


def test_nothing_to_heal(llm):
    tok = llm.engine.tokenizer
    trie = llm.engine.token_trie()
    assert healing_split(tok.encode("def"), trie) is None  # a single token: the prompt would be empty
    assert healing_split([*tok.encode("x = 1"), tok.eos_token_id], trie) is None  # a special token
    # Under an output constraint healing is off (the grammar starts at the prompt's end).
    so = StructuredOutputsParams(regex=r"[0-9]{3}")
    out = run(llm, "def f(x):\n", token_healing=True, structured_outputs=so).outputs[0]
    assert len(out.text) == 3 and out.text.isdigit()


def test_trie_extends_matches_brute_force(llm):
    tok = llm.engine.tokenizer
    trie = TokenTrie(tok, tok.vocab_size)
    ordinary = [tok.token_bytes(t) for t in range(tok.vocab_size) if t not in tok.special_ids]
    for t in list(range(0, tok.vocab_size, 97)):
        b = tok.token_bytes(t)
        if t in tok.special_ids or not b:
            continue
        assert trie.extends(b) == any(o.startswith(b) and len(o) > len(b) for o in ordinary), b


# ---- tiny random models --------------------------------------------------------------------------

def tiny_llm(tokenizer) -> LLM:
    vocab = (tokenizer.vocab_size + 63) // 64 * 64
    d = tiny_k3_dict(vocab_size=vocab, mxfp4=False)
    d["text_config"]["eos_token_id"] = d["eos_token_id"] = tokenizer.eos_token_id
    torch.manual_seed(0)
    model = init_weights(KimiForCausalLM(ModelConfig.from_dict(d)), seed=2)
    return LLM(model, tokenizer=tokenizer, kv_cache_memory_bytes=8_000_000)


def test_tiny_merge_tokenizer_heals_to_the_masked_argmax(tmp_path):
    make_tiktoken_dir(tmp_path)
    tok = load_tokenizer(tmp_path)
    llm = tiny_llm(tok)
    cut = "say hel"  # "he" + "l", and "ll" / "hell" / "hello" are tokens
    ids = tok.encode(cut)
    assert tok.token_bytes(ids[-1]) == b"l"
    healed = llm.generate([cut], SamplingParams(temperature=0, max_tokens=4, token_healing=True))[0]
    # The reference: the backed-off prompt's next-token distribution, argmax over the tokens
    # that start with "l" (or are a prefix of it: none shorter).
    ref = llm.generate([{"prompt_token_ids": ids[:-1]}], SamplingParams(temperature=0, max_tokens=1, logprobs=-1))
    ref = ref[0].outputs[0]
    dist = ref.logprobs[0]
    starts_l = [t for t in range(tok.vocab_size) if t not in tok.special_ids and tok.token_bytes(t).startswith(b"l")]
    want = max(starts_l, key=lambda t: dist[t].logprob)
    out = healed.outputs[0]
    assert healed.prompt_token_ids == ids
    if tok.token_bytes(want) == b"l":  # it re-spelled the prompt: from there on, the plain run
        plain = llm.generate([cut], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
        assert (out.token_ids, out.text) == (plain.token_ids, plain.text)
    else:
        assert out.token_ids[0] == want
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)[1:]


def test_tiny_byte_tokenizer_has_nothing_to_heal(tmp_path):
    from tidal.embedded import write_byte_tokenizer

    write_byte_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    llm = tiny_llm(tok)
    prompt = "def f(x):\n"
    assert healing_split(tok.encode(prompt), llm.engine.token_trie()) is None
    a, b = (llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, token_healing=h))[0] for h in (0, 1))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt_token_ids == b.prompt_token_ids


def test_tiny_respelling_byte_by_byte_still_gives_max_tokens(tmp_path):
    """A left-out token re-spelled one byte at a time (forced by logit_bias): those tokens are no
    completion tokens, and max_tokens completion tokens still follow."""
    make_tiktoken_dir(tmp_path)
    tok = load_tokenizer(tmp_path)
    llm = tiny_llm(tok)
    cut = "say hello"
    assert tok.token_bytes(tok.encode(cut)[-1]) == b"hello"
    bias = {tok.encode(c)[0]: 100.0 for c in "helo"}  # the single-byte tokens
    out = llm.generate([cut], SamplingParams(temperature=0, max_tokens=3, token_healing=True, logit_bias=bias,
                                             logprobs=0))[0].outputs[0]
    assert len(out.token_ids) == 3 and set(out.token_ids) <= set(bias) and out.finish_reason == "length"
    assert out.text == tok.decode(out.token_ids) and len(out.logprobs) == 3
