"""Speculation under a grammar (tidal.spec.grammar_draft) on the embedded model: greedy output of
requests held to a JSON schema, a regex and the K3 reply skeleton, with NGRAM and with the shipped
DSPARK drafter under each rollback method, equals plain constrained decoding, with chains verified
for the constrained requests; drafts the grammar forbids are cut, never committed; the matcher is
left where plain decoding leaves it; drafting and rolling back leaves the matcher's masks as they
were, and each position's frozen mask is the one plain decoding computes there."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tidal import LLM, SamplingParams
from tidal.embedded import embedded_model_dir
from tidal.engine.grammar import GrammarCompiler, allowed_tokens
from tidal.sampling_params import StructuredOutputsParams
from tidal.serve.chat import K3Format
from tidal.spec.drafter import Draft
from tidal.spec.grammar_draft import grammar_cut, masked_probs

DRAFTER = Path(__file__).resolve().parents[1] / "tidal" / "assets" / "embedded-dspark"
FMT = K3Format()
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "items": {"type": "array", "items": {"type": "string", "enum": ["alpha", "beta", "gamma"]}, "maxItems": 6}},
    "required": ["name", "items"], "additionalProperties": False}
REGEX = r"(def f[0-9]\(x\):\n    return x \+ [0-9]\n){2,4}"
CODE = "def add(a, b):\n    return a + b\n\n" * 3 + "def "


def grammars(tok) -> list[StructuredOutputsParams]:
    reply = FMT.render([{"role": "user", "content": "Count to three."}], thinking="off")
    return [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
            StructuredOutputsParams(llguidance=FMT.reply_grammar(reply, skeleton=True))]


def jobs(tok) -> tuple[list[str], list[SamplingParams]]:
    """Six constrained requests (two per grammar, one repeating its prompt) and one free one."""
    prompts, params = [], []
    for i, so in enumerate(grammars(tok)):
        for p in (CODE, f"Request {i}: list the items as JSON, then repeat them. "):
            prompts.append(p)
            params.append(SamplingParams(temperature=0, max_tokens=40, structured_outputs=so, logprobs=1))
    prompts.append(CODE)
    params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return prompts, params


def texts(outs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module")
def plain():
    llm = LLM(embedded_model_dir(), enable_prefix_caching=False, kv_cache_memory_bytes=64_000_000)
    prompts, params = jobs(llm.engine.tokenizer)
    return llm, texts(llm.generate(prompts, params))


def speculating(**kw) -> LLM:
    llm = LLM(embedded_model_dir(), enable_prefix_caching=False, kv_cache_memory_bytes=64_000_000, **kw)
    llm.engine.spec.policy = None  # chains in every step, whatever the cost model would pick
    return llm


FLAGS = {
    "ngram-swap": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4),
    "ngram-replay": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                         enable_linear_replayssm_spec=True),
    "dspark-swap": dict(speculative_algorithm="DSPARK", speculative_draft_model_path=str(DRAFTER),
                        speculative_dspark_block_size=4),
    "dspark-replay": dict(speculative_algorithm="DSPARK", speculative_draft_model_path=str(DRAFTER),
                          speculative_dspark_block_size=4, enable_linear_replayssm_spec=True),
}


@pytest.mark.parametrize("name", FLAGS)
def test_greedy_under_grammars_equals_plain_and_chains_run(plain, name):
    """Constrained and free requests in one batch: the same tokens and finish reasons as plain
    decoding, and chains verified (drafts accepted) with only constrained requests in the batch."""
    if name.startswith("dspark") and not DRAFTER.exists():
        pytest.skip("no drafter shipped")
    base, want = plain
    llm = speculating(**FLAGS[name])
    prompts, params = jobs(llm.engine.tokenizer)
    assert texts(llm.generate(prompts, params)) == want
    m = llm.engine.spec.metrics
    before = (m.num_chains, m.num_drafted_tokens, m.num_accepted_tokens)
    assert texts(llm.generate(prompts[:-1], params[:-1])) == want[:-1]
    chains, drafted, accepted = (m.num_chains - before[0], m.num_drafted_tokens - before[1],
                                 m.num_accepted_tokens - before[2])
    assert chains > 0 and drafted > accepted > 0, (chains, drafted, accepted)


class ForbiddenDrafter:
    """Drafts the plain output's next tokens with a token the grammar forbids after the first
    ``right`` of them (None: drafts nothing but that token)."""

    def __init__(self, truth: list[int], bad: int, right: int | None = 2) -> None:
        self.truth, self.bad, self.right = truth, bad, right
        self.proposed = 0

    def propose(self, rid, token_ids, k):
        self.proposed += 1
        if self.right is None:
            return Draft([self.bad] * k)
        n = len(token_ids)
        tokens = self.truth[n : n + k]
        if not tokens:
            return None
        return Draft(tokens[: self.right] + [self.bad] + tokens[self.right :][: k - self.right - 1])

    def forget(self, rid):
        pass


def run_keeping_matcher(llm: LLM, ids: list[int], params: SamplingParams) -> tuple[list[int], object]:
    """One request's output tokens and its grammar matcher once it finished."""
    llm.engine.add_request("r", ids, params)
    matcher = llm.engine.requests["r"].constraint
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
    return tokens, matcher


def test_forbidden_drafts_are_cut_and_the_matcher_ends_where_plain_leaves_it():
    """A drafter that puts a forbidden token after two right ones: each chain verifies only the
    two (accepted), the forbidden one is never committed, the output equals plain decoding, and the
    request's matcher afterwards is in plain decoding's state (same finished, same next mask)."""
    so = StructuredOutputsParams(regex=REGEX)
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=so)
    llm = LLM(embedded_model_dir(), enable_prefix_caching=False, kv_cache_memory_bytes=64_000_000)
    tok = llm.engine.tokenizer
    ids = tok.encode(CODE)
    want, plain_matcher = run_keeping_matcher(llm, ids, params)
    bad = tok.encode("Z")[0]  # never valid: the regex has no "Z"
    spec = speculating(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    drafter = ForbiddenDrafter(list(ids) + list(want), bad)
    spec.engine.spec.drafter = drafter
    got, spec_matcher = run_keeping_matcher(spec, ids, params)
    assert got == want and bad not in got
    m = spec.engine.spec.metrics
    assert drafter.proposed > 0 and m.num_chains > 0
    assert m.num_drafted_tokens == m.num_accepted_tokens > 0  # the two right drafts, never the forbidden one
    assert m.num_drafted_tokens <= 2 * m.num_chains
    assert spec_matcher.finished == plain_matcher.finished and spec_matcher.failed is None
    V = tok.vocab_size
    assert torch.equal(allowed_tokens([spec_matcher], V), allowed_tokens([plain_matcher], V))


@pytest.fixture(scope="module")
def compiler():
    from tidal.tokenizer import load_tokenizer

    tok = load_tokenizer(embedded_model_dir())
    return tok, GrammarCompiler(tok, (2, 1))


@pytest.mark.parametrize("seed", range(3))
def test_cut_masks_are_plain_decodings_and_the_matcher_rolls_back(compiler, seed):
    """Walking a schema with random allowed tokens, each step drafting a few allowed tokens and
    then a random one: the drafts are kept up to the first the grammar forbids, position j's
    frozen mask is the mask a matcher that committed drafts[:j] computes, and the matcher's own
    mask afterwards is the one it had (rolled back exactly)."""
    tok, c = compiler
    V = tok.vocab_size
    rng = random.Random(seed)
    so = StructuredOutputsParams(json=SCHEMA)
    m = c.compile(so).matcher((2, 1))
    out: list[int] = []
    cut_some = False
    for _ in range(30):
        ahead = c.compile(so).matcher((2, 1))
        for t in out:
            ahead.accept(t)
        walk = []
        for _ in range(4):
            ordinary = [t for t in allowed_tokens([ahead], V)[0].nonzero().flatten().tolist() if t not in (1, 2)]
            if not ordinary:
                break
            walk.append(rng.choice(ordinary))
            ahead.accept(walk[-1])
        if not walk:
            break
        draft = walk[:2] + [rng.randrange(V)] + walk[2:]
        before = allowed_tokens([m], V)[0]
        kept, masks = grammar_cut(m, draft, V)
        assert kept == draft[: len(kept)] and len(kept) >= min(2, len(walk)) and len(masks) == len(kept) + 1
        cut_some |= len(kept) < len(draft)
        replay = c.compile(so).matcher((2, 1))
        for t in out:
            replay.accept(t)
        for j, mask in enumerate(masks):
            assert torch.equal(mask.allowed(V), allowed_tokens([replay], V)[0]), j
            if j < len(kept):
                replay.accept(kept[j])
        if len(kept) < len(draft):
            assert not masks[len(kept)].allows(draft[len(kept)])
        assert torch.equal(allowed_tokens([m], V)[0], before)
        out.append(walk[0])
        m.accept(walk[0])
    assert cut_some


def test_drafter_distributions_renormalised_to_the_masks(compiler):
    """q restricted to each position's allowed tokens, summing to one (what keeps rejection
    sampling lossless when forbidden drafts are cut)."""
    tok, c = compiler
    V = tok.vocab_size
    m = c.compile(StructuredOutputsParams(regex="[ab]+")).matcher((2, 1))
    a = tok.encode("a")[-1]
    kept, masks = grammar_cut(m, [a, a], V)
    assert kept == [a, a]
    q = torch.rand(2, V).softmax(dim=-1)
    r = masked_probs(q, masks)
    allowed = torch.stack([mk.allowed(V) for mk in masks[:2]])
    assert torch.allclose(r.sum(dim=-1), torch.ones(2, dtype=r.dtype))
    assert bool((r[~allowed] == 0).all())
    assert torch.allclose(r[0][allowed[0]], q[0][allowed[0]] / q[0][allowed[0]].sum())


@pytest.mark.parametrize("name", ["ngram-swap", "dspark-replay"])
def test_sampled_under_a_schema_with_speculation_is_valid_and_seeded(name):
    """temperature > 0 under a schema through the rejection sampler: chains are verified, every
    reply is JSON the schema accepts, and a seeded request repeats itself exactly."""
    import json

    import jsonschema

    if name.startswith("dspark") and not DRAFTER.exists():
        pytest.skip("no drafter shipped")
    so = StructuredOutputsParams(json=SCHEMA)
    prompts = [CODE, "The JSON: "] * 3
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=60, structured_outputs=so) for i in range(6)]
    runs = []
    for _ in range(2):
        llm = speculating(**FLAGS[name])
        outs = llm.generate(prompts, params)
        m = llm.engine.spec.metrics
        assert m.num_chains > 0 and m.num_drafted_tokens > 0
        runs.append(texts(outs))
        for o in outs:
            assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert runs[0] == runs[1]


def test_drafts_the_grammar_rejects_whole_back_off():
    """A drafter whose every draft is a token the grammar never allows: no chain is verified, the output
    is plain decoding's, and the request stops asking the drafter every step (it backs off as
    after rejected chains)."""
    so = StructuredOutputsParams(regex=REGEX)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
    llm = LLM(embedded_model_dir(), enable_prefix_caching=False, kv_cache_memory_bytes=64_000_000)
    tok = llm.engine.tokenizer
    want = llm.generate(CODE, params)[0].outputs[0].token_ids
    spec = speculating(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    drafter = ForbiddenDrafter([], tok.encode("Z")[0], right=None)
    spec.engine.spec.drafter = drafter
    got = spec.generate(CODE, params)[0].outputs[0].token_ids
    assert got == want and len(want) > 10
    assert spec.engine.spec.metrics.num_chains == 0
    assert 0 < drafter.proposed <= len(want) // 2, (drafter.proposed, len(want))
