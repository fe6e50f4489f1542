"""The DSPARK slot loop's C kernel (tidal.ops.markov_draft) against its float64 reference."""

import pytest
import torch

from tidal.model.layers import inference_layout
from tidal.ops.cpu_kernels import markov_draft_kernel
from tidal.ops.markov_draft import draft_slots, draft_slots_reference


@pytest.fixture(autouse=True)
def kernel():
    if markov_draft_kernel() is None:
        pytest.skip("no C compiler here")


@pytest.mark.parametrize("rank", [0, 5, 32])
@pytest.mark.parametrize("min_reach", [0.0, 0.3])
def test_slot_loop_matches_float64(rank, min_reach):
    """Blocks of several sizes (one wanting none), logits spread like a drafter's (a few sure slots,
    some unsure): the same drafts as float64, confidences within float32 rounding, blocks cut where
    the reach falls below the cut, -1 / 0 past each block's end; a block's result does not depend on
    the blocks beside it."""
    gen = torch.Generator().manual_seed(rank * 7 + int(min_reach * 10))
    B, S, V = 5, 6, 1000
    head = torch.randn(B, S, V, generator=gen) * 3
    head[:, :, 17] += torch.linspace(0, 14, S)  # later slots surer of one token, the first ones not
    m_in = torch.randn(V, rank, generator=gen) if rank else None
    m_out = inference_layout(torch.randn(V, rank, generator=gen) * 0.5) if rank else None
    prev = torch.randint(0, V, (B,), generator=gen)
    wanted = torch.tensor([6, 4, 1, 0, 5])
    got = draft_slots(head, m_in, m_out, prev, wanted, min_reach)
    assert got is not None
    drafted, conf = got
    want_tokens, want_conf = draft_slots_reference(head, m_in, m_out, prev, wanted, min_reach)
    for b in range(B):
        n = len(want_tokens[b])
        assert drafted[b, :n].tolist() == want_tokens[b], b
        assert conf[b, :n].tolist() == pytest.approx(want_conf[b], rel=1e-5, abs=1e-7), b
        assert drafted[b, n:].tolist() == [-1] * (S - n) and conf[b, n:].tolist() == [0.0] * (S - n)
        alone = draft_slots(head[b : b + 1], m_in, m_out, prev[b : b + 1], wanted[b : b + 1], min_reach)
        assert torch.equal(alone[0][0], drafted[b]) and torch.equal(alone[1][0], conf[b])
    if min_reach:
        assert any(0 < len(t) < int(w) for t, w in zip(want_tokens, wanted)), want_tokens  # a cut block


def test_confidence_of_extreme_logits():
    """A slot with one logit far above the rest (confidence 1) or all equal (1 / V)."""
    V = 300
    head = torch.zeros(2, 1, V)
    head[0, 0, 3] = 200.0
    drafted, conf = draft_slots(head, None, None, torch.tensor([0, 0]), torch.tensor([1, 1]), 0.0)
    assert drafted[:, 0].tolist() == [3, 0] and conf[0, 0].item() == 1.0
    assert conf[1, 0].item() == pytest.approx(1 / V, rel=1e-6)


def test_layouts_it_does_not_take_fall_back():
    """A row-major Markov output weight or a non-float32 head: None (the caller's torch loop runs)."""
    V, r = 64, 4
    head = torch.randn(1, 2, V)
    args = (torch.tensor([1]), torch.tensor([2]), 0.0)
    assert draft_slots(head, torch.randn(V, r), torch.randn(V, r), *args) is None
    assert draft_slots(head.double(), None, None, *args) is None
