"""Sampler against per-row float64 references, and SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.engine.sampler import SampleRow, filter_logits, process_logits, prompt_logprobs, sample
from tidal.sampling_params import SamplingParams


def reference_allowed(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Tokens a row may sample, by the textbook definitions, one row at a time in float64."""
    x = logits.double() / (p.temperature or 1.0)
    order = sorted(range(len(x)), key=lambda i: -x[i].item())
    if p.top_k > 0:
        order = order[: p.top_k]
    probs = torch.softmax(x[order], dim=0)
    keep, mass = [], 0.0
    for tok, pr in zip(order, probs.tolist()):
        if p.top_p < 1.0 and mass >= p.top_p:
            break
        keep.append(tok)
        mass += pr
    if p.min_p > 0:
        probs = torch.softmax(x[keep], dim=0)
        top = probs.max().item()
        keep = [t for t, pr in zip(keep, probs.tolist()) if pr >= p.min_p * top]
    return set(keep)


PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=0.5, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=2.0, top_k=1),
]


def test_filters_match_reference():
    torch.manual_seed(0)
    logits = torch.randn(len(PARAMS), 40) * 3
    x = filter_logits(logits, [SampleRow(p) for p in PARAMS])
    for row, p in enumerate(PARAMS):
        got = set(torch.nonzero(torch.isfinite(x[row])).flatten().tolist())
        assert got == reference_allowed(logits[row], p), p


def test_samples_follow_the_filtered_distribution():
    torch.manual_seed(1)
    V, n = 12, 6000
    logits = torch.randn(V) * 1.5
    p = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    allowed = sorted(reference_allowed(logits, p))
    x = logits.double()[allowed] / p.temperature
    expected = dict(zip(allowed, torch.softmax(x, 0).tolist()))
    tokens = [r.token_id for r in sample(logits.repeat(n, 1), [SampleRow(p)] * n)]
    assert set(tokens) <= set(allowed)
    for tok, prob in expected.items():
        freq = tokens.count(tok) / n
        assert abs(freq - prob) < 4 * math.sqrt(prob * (1 - prob) / n) + 1e-3, (tok, freq, prob)


def test_greedy_and_banned_tokens():
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    greedy = SamplingParams(temperature=0)
    top = logits.argmax(-1).tolist()
    out = sample(logits, [SampleRow(greedy)] * 4)
    assert [r.token_id for r in out] == top
    banned = sample(logits, [SampleRow(greedy, banned=(t,)) for t in top])
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    assert [r.token_id for r in banned] == second
    hot = SamplingParams(temperature=5.0)
    for r in sample(logits.repeat(50, 1), [SampleRow(hot, banned=tuple(range(29)))] * 200):
        assert r.token_id == 29


def test_seeded_rows_ignore_the_rest_of_the_batch():
    torch.manual_seed(3)
    logits = torch.randn(5, 50)
    p = SamplingParams(temperature=1.0, seed=7)

    def seeded_tokens(batch_rows: list[int], target: int) -> list[int]:
        gen = torch.Generator().manual_seed(7)
        out = []
        for _ in range(20):
            rows = [SampleRow(p if i == target else SamplingParams(temperature=1.0),
                              gen if i == target else None) for i in batch_rows]
            res = sample(logits[batch_rows], rows)
            out.append(res[batch_rows.index(target)].token_id)
        return out

    alone = seeded_tokens([2], 2)
    assert seeded_tokens([0, 1, 2, 3, 4], 2) == alone
    assert seeded_tokens([4, 2, 0], 2) == alone
    assert len(set(alone)) > 1  # it really samples


def test_logprobs_and_ranks():
    torch.manual_seed(4)
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=1.0, logprobs=0),
              SamplingParams(temperature=1.0, logprobs=-1)]
    res = sample(logits, [SampleRow(p) for p in params])
    ref = logits.double().log_softmax(-1)
    for row, r in enumerate(res):
        assert r.logprob == pytest.approx(ref[row, r.token_id].item(), abs=1e-5)
        assert r.rank == 1 + int((ref[row] > ref[row, r.token_id]).sum())
        order = ref[row].argsort(descending=True).tolist()
        n = [3, 0, 20][row]
        assert [t for t, _ in r.top] == order[:n]
    targets = [5, 0, 19]
    for (lp, rank, top), row, t in zip(prompt_logprobs(logits, targets, 2), range(3), targets):
        assert lp == pytest.approx(ref[row, t].item(), abs=1e-5)
        assert rank == 1 + int((ref[row] > ref[row, t]).sum())
        assert [tok for tok, _ in top] == ref[row].argsort(descending=True)[:2].tolist()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(seed=1.5), "seed"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(logprobs=-3), "logprobs"),
        (dict(prompt_logprobs=1.0), "prompt_logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


def test_param_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 1.0, 1.0, -1, 0.0)
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert not SamplingParams(top_k=0).top_k_active


# ---- penalties, logit_bias (against hand computations) -------------------------------------------

def test_repetition_penalty_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    # prompt [0, 1], output [1, 4]: tokens 0, 1, 4 seen; 0 positive -> /2, 1 and 4 negative -> *2
    row = SampleRow(p, token_ids=[0, 1, 1, 4], prompt_len=2)
    x = process_logits(logits, [row])
    assert x[0].tolist() == [1.0, -2.0, 0.5, 3.0, -4.0, 1.0]


def test_frequency_and_presence_penalties_by_hand():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # prompt [3] is not penalised by these two; output has token 2 three times and token 0 once
    row = SampleRow(p, token_ids=[3, 2, 0, 2, 2], prompt_len=1)
    x = process_logits(logits, [row])
    assert x[0].tolist() == [1.0 - 0.5 - 0.25, 1.0, 1.0 - 1.5 - 0.25, 1.0, 1.0]


def test_penalties_rows_are_independent_and_unpenalised_rows_untouched():
    torch.manual_seed(3)
    logits = torch.randn(3, 16)
    rows = [SampleRow(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4),
                      token_ids=[1, 2, 2, 5, 9, 9, 9], prompt_len=3),
            SampleRow(SamplingParams()),
            SampleRow(SamplingParams(presence_penalty=1.0), token_ids=[7, 7, 8], prompt_len=1)]
    x = process_logits(logits, rows)
    # float64, token by token
    ref = logits.double().clone()
    for t in {1, 2, 5, 9}:
        ref[0, t] = ref[0, t] / 1.3 if ref[0, t] > 0 else ref[0, t] * 1.3
    for t, c in {5: 1, 9: 3}.items():  # output tokens only (prompt: 1, 2, 2)
        ref[0, t] -= 0.7 * c - 0.4
    ref[2, 7] -= 1.0
    ref[2, 8] -= 1.0
    torch.testing.assert_close(x.double(), ref, rtol=1e-6, atol=1e-6)


def test_logit_bias_moves_greedy_and_the_distribution():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    greedy = SamplingParams(temperature=0, logit_bias={2: 3.5})  # 0 + 3.5 > 3
    assert sample(logits, [SampleRow(greedy)])[0].token_id == 2
    assert sample(logits, [SampleRow(SamplingParams(temperature=0, logit_bias={0: -100}))])[0].token_id == 1
    p = SamplingParams(temperature=1.0, logit_bias={3: 2.0, 0: -1.0})
    n = 8000
    tokens = [r.token_id for r in sample(logits.repeat(n, 1), [SampleRow(p)] * n)]
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0, 1.0], dtype=torch.float64), 0).tolist()
    for tok, prob in enumerate(expected):
        freq = tokens.count(tok) / n
        assert abs(freq - prob) < 4 * math.sqrt(prob * (1 - prob) / n), (tok, freq, prob)


def test_seeded_rows_with_penalties_do_not_depend_on_the_batch():
    torch.manual_seed(4)
    logits = torch.randn(4, 64)
    p = SamplingParams(temperature=1.2, frequency_penalty=0.3, logit_bias={5: 1.0}, seed=11)

    def row(seed_gen: bool):
        g = torch.Generator().manual_seed(11) if seed_gen else None
        return SampleRow(p, g, token_ids=[1, 2, 3, 3], prompt_len=1)

    alone = sample(logits[:1], [row(True)])[0].token_id
    mixed = sample(logits, [row(True), row(False), row(False), row(False)])[0].token_id
    assert alone == mixed


def test_penalty_and_bias_validation():
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(ValueError, match="token 3"):
        SamplingParams(logit_bias={3: 101})
    assert SamplingParams(n=3, seed=5).for_sample(2).seed == 7
    assert SamplingParams(n=3).for_sample(2).n == 1
