"""The DSPARK drafter (tidal.spec.dspark) on a tiny random K3 target (float32): a drafter trained
here for seconds on the target's greedy continuations (tidal.spec.dspark_train) drafts blocks that
are partly accepted; greedy output with it equals plain decoding for many requests in one batch
(finishes inside a block, stop tokens, preemption, prefix hits) under both rollback methods; the
hidden states the drafter is handed are the target's at exactly the committed positions; a drafter
reading its slots shifted by one is rejected at once; bad drafter files fail with errors naming
the problem; the shipped drafter belongs to the shipped embedded model."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch

from tidal import SamplingParams
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.ops import dense
from tidal.presets import tiny_k3
from tidal.spec.config import SpeculativeConfig
from tidal.spec.drafter import Draft
from tidal.spec.dspark import CONFIG_FILE, DsparkConfig, DsparkDrafter, DsparkModel, load_drafter, save_drafter
from tidal.spec.dspark_train import anchors_of, block_batch, cache_from_sequences, tap_forward, train_drafter

from test_engine import drive, one_thread, random_prompts  # noqa: F401 - one_thread: autouse
from test_spec import METHODS, make_engine, outputs, spec_config, truth_of

BLOCK = 4
TAPS = [1, 3, 5]


@pytest.fixture(scope="module")
def model() -> KimiForCausalLM:
    return init_weights(KimiForCausalLM(tiny_k3()), seed=0).eval()


def drafter_config(model, **kw) -> DsparkConfig:
    c = model.config
    base = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, target_num_layers=c.num_hidden_layers,
                tap_layers=TAPS, block_size=BLOCK, num_layers=1, num_heads=2, head_dim=32, intermediate_size=128,
                markov_rank=16, window=16)
    return DsparkConfig(**{**base, **kw})


def greedy_jobs(prompts, max_tokens, seed=0):
    rng = random.Random(seed)
    return [(i // 4, str(i), p, SamplingParams(temperature=0, max_tokens=rng.randint(*max_tokens), ignore_eos=True))
            for i, p in enumerate(prompts)]


# The tiny random target's continuations follow no pattern a drafter can learn in seconds: the
# drafter is trained on (and the tests run) these prompts, so that its blocks are partly right.
PROMPTS = random_prompts(21, 12, 10)


@pytest.fixture(scope="module")
def trained(model, tmp_path_factory) -> Path:
    """A drafter trained for a few seconds on the tiny target's own greedy continuations."""
    torch.manual_seed(0)
    prompts = PROMPTS
    jobs = [(0, str(i), p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for i, p in enumerate(prompts)]
    seqs = list(truth_of(jobs, drive(make_engine(model), jobs)).values())
    cache = cache_from_sequences(model, seqs, [len(p) for p in prompts], ["test"] * len(seqs), TAPS)
    drafter = DsparkModel(drafter_config(model)).init_weights(0)
    train_drafter(drafter, model, cache, anchors_of(cache, BLOCK), steps=100, batch_size=32, lr=4e-3, gamma=2.0,
                  seed=0, log=lambda _: None)
    return save_drafter(drafter, tmp_path_factory.mktemp("dspark"))


def dspark(path, replay=False, block=BLOCK) -> SpeculativeConfig:
    return spec_config("DSPARK", draft_model_path=str(path), dspark_block_size=block,
                       enable_linear_replayssm_spec=replay)


@pytest.mark.parametrize("replay, budget", [(False, 2048), (True, 7)])
def test_greedy_equal_with_the_trained_drafter(model, trained, replay, budget):
    """Many requests in one batch, arriving over steps (prefills beside blocks), some ending inside
    a block (max_tokens, a stop token); chunked prefills too: outputs equal plain decoding, and
    the drafter's blocks are partly accepted (every rollback length occurs)."""
    prompts = PROMPTS
    base = drive(make_engine(model), greedy_jobs(prompts, (3, 24)))
    stops = {str(i): base[str(i)].outputs[0].token_ids[len(base[str(i)].outputs[0].token_ids) // 2]
             for i in range(0, len(prompts), 3)}
    jobs = [(a, rid, p, SamplingParams(temperature=0, max_tokens=sp.max_tokens, ignore_eos=True,
                                       stop_token_ids=[stops[rid]] if rid in stops else None))
            for a, rid, p, sp in greedy_jobs(prompts, (3, 24))]
    want = drive(make_engine(model), jobs)
    assert any(o.outputs[0].finish_reason == "stop" for o in want.values())
    engine = make_engine(model, budget=budget, spec=dspark(trained, replay))
    assert outputs(drive(engine, jobs)) == outputs(want)
    m = engine.spec.metrics
    assert m.num_chains > 5 and 0 < m.num_accepted_tokens < m.num_drafted_tokens
    assert m.avg_accept_length > 1.3, m.avg_accept_length
    assert sum(1 for c in m.accept_length_counts if c) >= 2  # partial accepts: rollbacks


@pytest.mark.parametrize("replay", METHODS)
def test_greedy_equal_with_chains_cut_by_confidence(model, trained, replay):
    """The policy verifies a drafted token only while the drafter's confidence, multiplied along
    the block and calibrated on the chains verified before, stays at the least it asks for (here a
    fixed 0.01, the policy alternating chains and plain steps): chains of several lengths, fewer
    drafted tokens than with every block verified whole, outputs equal plain decoding either way."""
    from test_spec_policy import Alternating

    jobs = greedy_jobs(PROMPTS, (3, 24))
    want = outputs(drive(make_engine(model), jobs))
    drafted = {}
    for least in (0.0, 0.01):
        engine = make_engine(model, spec=dspark(trained, replay))
        engine.spec.policy = Alternating(skip_first=False, confidence_floor=least, confidence_cap=least)
        engine.spec.backoff.min_rate = 0.0  # no request pauses
        assert outputs(drive(engine, jobs)) == want, least
        m = engine.spec.metrics
        drafted[least] = m.num_drafted_tokens
        assert m.num_chains > 5 and m.num_accepted_tokens > 0
    assert drafted[0.01] < 0.8 * drafted[0.0], drafted
    assert len({c for c in m.position_drafted}) >= 3, m.position_drafted  # cut at several lengths
    # the calibration measured chains of several lengths, and holds no chain's reach after the run
    cal = engine.spec.calibration
    assert len(cal.predicted) >= 3 and cal.reached[0] > 0 and not engine.spec._reach


@pytest.mark.parametrize("replay, blocks", [(False, 6), (True, 6), (False, 64)])
def test_preemption_and_prefix_hits_with_dspark(model, trained, replay, blocks):
    """A pool of a few requests (preemption, recompute: the drafter sees the recomputed positions
    again), or second turns hitting the prefix cache the first ones left (the drafter has no taps
    of the cached positions): same outputs as without speculation."""
    prompts = PROMPTS[:6]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = [(0, str(i), p, params) for i, p in enumerate(prompts)]
    turns = truth_of(first, drive(make_engine(model), first))
    jobs = first + [(30, f"next{i}", turns[str(i)] + [5, 6], params) for i in range(len(prompts))]
    run = first if blocks < 64 else jobs
    want = drive(make_engine(model, blocks=blocks), run)
    engine = make_engine(model, blocks=blocks, spec=dspark(trained, replay))
    assert outputs(drive(engine, run)) == outputs(want)
    m = engine.metrics()
    assert engine.spec.metrics.num_accepted_tokens > 0
    assert (m.num_preemptions > 0) if blocks < 64 else (m.prefix_cache_hits > 0)


class Recording(DsparkDrafter):
    """The real drafter, keeping every (request, position, tapped row) it is handed."""

    def __init__(self, inner: DsparkDrafter) -> None:
        self.__dict__.update(inner.__dict__)
        self.seen: dict[tuple[str, int], torch.Tensor] = {}
        self.decodes = 0  # positions handed over by observe_decodes

    def observe_many(self, items):
        for request_id, start, taps in items:
            for i in range(taps.shape[0]):
                self.seen[(request_id, start + i)] = taps[i].clone()
        super().observe_many(items)

    def observe_decodes(self, request_ids, positions, taps):
        for i, (request_id, pos) in enumerate(zip(request_ids, positions)):
            self.seen[(request_id, pos)] = taps[i].clone()
        self.decodes += len(request_ids)
        super().observe_decodes(request_ids, positions, taps)


def test_drafter_sees_the_targets_taps_at_committed_positions(model, trained):
    """Every position the drafter is handed is a committed position of its request, each committed
    position before the last is handed (a fresh cache, no prefix hits, whole prompts: the tap
    window covers them), and the rows are the target's hidden states there (a plain prefill over
    the final sequence, to float32 rounding: other kernels). Catches a chain handing over a
    rejected position or an off-by-one row."""
    prompts = PROMPTS[:4]
    jobs = [(0, str(i), p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) for i, p in enumerate(prompts)]
    engine = make_engine(model, spec=dspark(trained), enable_prefix_caching=False)
    rec = Recording(engine.spec.drafter)
    engine.spec.drafter = rec
    truth = truth_of(jobs, drive(engine, jobs))
    assert engine.spec.metrics.num_accepted_tokens > 0 and rec.decodes > 0
    for rid, seq in truth.items():
        ref = tap_forward(model, [seq], TAPS)[0]
        got = sorted(pos for r, pos in rec.seen if r == rid)
        assert got == list(range(len(seq) - 1)), rid  # the last token is never run
        for pos in got:
            assert torch.allclose(rec.seen[(rid, pos)], ref[pos], atol=1e-3, rtol=1e-3), (rid, pos)


class Shifted:
    """The trained drafter's proposals read one slot late (draft j from slot j+1): the DSpark
    off-by-one pitfall."""

    def __init__(self, inner: DsparkDrafter) -> None:
        self.inner = inner
        self.tap_layers, self.tap_window = inner.tap_layers, inner.tap_window

    def observe(self, *a):
        self.inner.observe(*a)

    def propose(self, rid, token_ids, k):
        d = self.inner.propose(rid, token_ids, k + 1)
        return Draft(d.tokens[1:]) if d is not None and len(d.tokens) > 1 else None

    def forget(self, rid):
        self.inner.forget(rid)


def test_slots_read_one_late_are_rejected(model, trained):
    prompts = PROMPTS[4:]
    jobs = [(0, str(i), p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) for i, p in enumerate(prompts)]
    want = drive(make_engine(model), jobs)
    right = make_engine(model, spec=dspark(trained, block=BLOCK - 1))
    assert outputs(drive(right, jobs)) == outputs(want)
    shifted = make_engine(model, spec=dspark(trained, block=BLOCK - 1))
    shifted.spec.drafter = Shifted(shifted.spec.drafter)
    assert outputs(drive(shifted, jobs)) == outputs(want)
    good, bad = right.spec.metrics.position_acceptance()[0], shifted.spec.metrics.position_acceptance()[0]
    assert good > 0.25 and bad < good / 2, (good, bad)


def test_smaller_block_drafts_the_same_first_tokens(model, trained):
    """Causal slots: a block of 2 drafts the first 2 tokens of a block of 4."""
    d = DsparkDrafter(load_drafter(trained), model)
    seq = random_prompts(26, 1, 20)[0] * 2
    d.observe("r", 0, tap_forward(model, [seq], TAPS)[0][:-1])
    assert d.propose("r", seq, 2).tokens == d.propose("r", seq, 4).tokens[:2]


def test_block_batch_labels_are_the_next_tokens(model, trained):
    seqs = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6]]
    cache = cache_from_sequences(model, seqs, [3, 2], ["a", "b"], TAPS)
    anchors = anchors_of(cache, BLOCK)
    assert cache.tokens[anchors].tolist() == [3, 4, 5, 6, 8, 7]  # last prompt token .. second-to-last
    b = block_batch(cache, anchors, window=4, block=BLOCK)
    assert b["labels"][0].tolist() == [4, 5, 6, 7] and b["lab_valid"][0].tolist() == [True] * 4
    assert b["labels"][4][:2].tolist() == [7, 6] and b["lab_valid"][4].tolist() == [True, True, False, False]
    assert b["anchor_pos"].tolist() == [2, 3, 4, 5, 1, 2]
    assert b["ctx_pos"][0].tolist() == [-2, -1, 0, 1]  # the window before anchor position 2
    assert b["ctx_valid"][0].tolist() == [False, False, True, True]
    assert torch.equal(b["ctx"][0, 2:], cache.taps[0:2].float())
    assert b["ctx_valid"][4].tolist() == [False, False, False, True]  # seq 1's anchor 1: only its position 0
    assert torch.equal(b["ctx"][4, 3], cache.taps[7].float())


def test_bad_drafter_paths_and_configs_name_the_problem(model, trained, tmp_path):
    def engine_error(path, block=BLOCK):
        with pytest.raises(ValueError) as e:
            make_engine(model, spec=dspark(path, block=block))
        return str(e.value)

    assert "not a directory" in engine_error(tmp_path / "missing")
    assert CONFIG_FILE in engine_error(tmp_path)
    for key, value, words in (("vocab_size", 1000, "vocab_size 1000"), ("tap_layers", [1, 9], "tap_layers"),
                              ("hidden_size", 32, "hidden_size 32"), ("target_num_layers", 4, "4 layers"),
                              ("bogus", 1, "unknown")):
        bad = tmp_path / key
        bad.mkdir()
        cfg = json.loads((trained / CONFIG_FILE).read_text())
        cfg[key] = value
        (bad / CONFIG_FILE).write_text(json.dumps(cfg))
        (bad / "model.safetensors").write_bytes((trained / "model.safetensors").read_bytes())
        assert words in engine_error(bad), key
    assert "exceeds the drafter's trained block size" in engine_error(trained, block=BLOCK + 1)
    shapes = tmp_path / "shapes"
    save_drafter(DsparkModel(drafter_config(model, intermediate_size=64)), shapes)
    (shapes / CONFIG_FILE).write_text((trained / CONFIG_FILE).read_text())
    assert "shape" in engine_error(shapes)
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / CONFIG_FILE).write_text((trained / CONFIG_FILE).read_text())
    (torn / "model.safetensors").write_bytes(b"not a safetensors file")
    assert "cannot read" in engine_error(torn)
    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        SpeculativeConfig("DSPARK")


SHIPPED = Path(__file__).resolve().parents[1] / "tidal" / "assets" / "embedded-dspark"


@pytest.mark.skipif(not SHIPPED.exists(), reason="no drafter shipped")
def test_shipped_drafter_belongs_to_the_shipped_model():
    """The drafter beside the embedded model was trained on it (retrain it with the README's
    command whenever the embedded model changes) and fits the size budget."""
    from tidal.model.checkpoint import load_model
    from tidal.spec.dspark import check_target, target_fingerprint

    embedded = SHIPPED.parent / "embedded"
    size = sum(f.stat().st_size for f in SHIPPED.iterdir())
    assert size <= 5 * 2**20 and size + sum(f.stat().st_size for f in embedded.iterdir()) <= 30 * 2**20
    cfg = DsparkConfig.read(SHIPPED)
    target = load_model(embedded, torch.float32)
    check_target(cfg, target.config)
    assert cfg.target_fingerprint == target_fingerprint(target), "retrain: tidal train --drafter dspark"
    load_drafter(SHIPPED)


@pytest.mark.parametrize("one_product_rows", [0, 16], ids=["slot-by-slot", "one-product"])
def test_cached_context_proposes_the_reference_tokens(model, one_product_rows, monkeypatch):
    """The serving drafter (its LM head slot by slot, or every slot in one product) (context keys/values cached per request in a ring of ``window`` rows,
    all requests drafted in one pass) against the uncached reference, with a fresh random drafter
    (Markov head on): several steps, requests of different lengths (longer than the window: the
    ring wraps), prompts handed over only partly (gaps), requests leaving and others taking their
    cache slots; every proposal is the same tokens, whether a position's keys/values were filled when
    it was handed over (a prompt, a chain's several positions) or at the next draft (plain decodes,
    steps without drafting in between). A request that finds every slot taken gets no draft, and a
    request that left leaves its slot free."""
    from tidal.spec import dspark
    from tidal.spec.dspark import DsparkReferenceDrafter

    monkeypatch.setattr(dspark, "ONE_PRODUCT_ROWS", one_product_rows)
    cfg = drafter_config(model, num_layers=2, window=8)
    m = DsparkModel(cfg).init_weights(7)
    with torch.no_grad():
        m.markov_out.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(8))
    fast, ref = DsparkDrafter(m, model, max_requests=3), DsparkReferenceDrafter(m, model)
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(4)
    width = len(TAPS) * model.config.hidden_size
    tokens: dict[str, list[int]] = {}

    def hand_over(items):
        items = [(rid, start, torch.randn(n, width, generator=gen)) for rid, start, n in items]
        fast.observe_many(items)
        ref.observe_many(items)

    def pending(rid):
        return fast.cache.pending(torch.tensor([fast.cache.slot(rid)]))[0].numel()

    def join(rid, length, seen):
        tokens[rid] = [rng.randrange(model.config.vocab_size) for _ in range(length + 1)]
        hand_over([(rid, length - seen, seen)])  # the prompt's last `seen` positions (a tap window)
        assert pending(rid) == 0  # a prefill's positions are filled as they are handed over

    join("a", 5, 5)
    join("b", 23, 6)
    proposed = compared = cut = 0
    for step in range(14):
        if step == 3:
            join("c", 11, 11)
        if step == 5:
            fast.forget("a"), ref.forget("a"), tokens.pop("a")
            assert fast.cache.num_free == 1
        if step == 6:
            join("d", 2, 2)
            assert fast.cache.num_free == 0
        asks = [(rid, list(ids), rng.randint(1, BLOCK)) for rid, ids in tokens.items()]
        least = [0.0, 0.0, 1e-3, 1e-4][step % 4]  # cuts blocks: this drafter is unsure (about 0.04 a token)
        got, want = fast.propose_many(asks, least), ref.propose_many(asks, least)
        for (rid, _, k), g, w in zip(asks, got, want):
            assert (g is None) == (w is None), (step, rid)
            if g is not None:
                assert g.tokens == w.tokens and len(g.tokens) <= k, (step, rid, g.tokens, w.tokens)
                assert len(g.tokens) == k or least > 0
                cut += len(g.tokens) < k
                assert g.confidence == pytest.approx(w.confidence, rel=1e-4, abs=1e-6), (step, rid)
                compared += 1
                proposed += len(set(g.tokens)) > 1
        news = []
        for rid, ids in tokens.items():  # each request commits 1..3 tokens: its positions n-1 .. are handed over
            m_new = rng.randint(1, 3)
            news.append((rid, len(ids) - 1, m_new))
            ids += [rng.randrange(model.config.vocab_size) for _ in range(m_new)]
        hand_over(news)
        for rid, _, m_new in news:  # a chain's positions are filled now, a plain decode's at the next draft
            assert pending(rid) == (1 if m_new == 1 else 0), (step, rid, m_new)
        if step % 4 == 3:  # some steps decode plainly: single positions pile up, filled when drafting resumes
            hand_over([(rid, len(ids) - 1, 1) for rid, ids in tokens.items()])
            for ids in tokens.values():
                ids.append(rng.randrange(model.config.vocab_size))
    assert compared >= 35 and proposed > compared // 3 and 3 <= cut < compared // 2, (compared, proposed, cut)
    fast.observe_many([("e", 0, torch.randn(3, width, generator=gen))])  # every slot is taken
    assert fast.propose("e", [1, 2, 3, 4], 2) is None and ref.propose("e", [1, 2, 3, 4], 2) is None
    for rid in list(tokens):
        fast.forget(rid)
    assert fast.cache.num_free == 3 and bool((fast.cache.pos == -1).all())


@pytest.mark.parametrize("bf16_head", [False, True], ids=["own-head-copy", "target-twin"])
def test_counted_memory_is_what_the_drafter_holds(model, tmp_path, bf16_head):
    """The bytes the engine takes out of the pool for the drafter (``nbytes``, the same function
    ``memory_bytes`` reads from a drafter directory) are the tensors it holds after drafting: its
    float32 weights, their bf16 copies, the bf16 LM head and the context cache. A float32 target
    whose LM head holds bf16 values (a bf16 checkpoint) keeps an exact bf16 copy for its own
    decode (``dense.bf16_twin``): the drafter reads that one, and the bytes counted for its copy
    pay for it."""
    if bf16_head:
        model = copy.deepcopy(model)
        with torch.no_grad():
            model.lm_head.weight.copy_(model.lm_head.weight.bfloat16().float())
    cfg = drafter_config(model, num_layers=2)
    path = save_drafter(DsparkModel(cfg).init_weights(3), tmp_path)
    d = DsparkDrafter(load_drafter(path), model, max_requests=5)
    seq = random_prompts(27, 1, 20)[0]
    d.observe("r", 0, tap_forward(model, [seq], TAPS)[0][:-1])
    assert d.propose("r", seq, BLOCK) is not None
    # derived_weight keeps (key, value, epoch) on its owner
    copies = [v[1] for owner in (d, *d.model.modules()) for k, v in vars(owner).items()
              if k.startswith("_") and isinstance(v, tuple) and len(v) == 3 and isinstance(v[1], torch.Tensor)]
    cache = [t for t in vars(d.cache).values() if isinstance(t, torch.Tensor)]
    twin = dense.bf16_twin(model.lm_head.weight)
    assert (twin is not None) == bf16_head and ("_lm_head" in vars(d)) == (not bf16_head)
    held = sum(p.nbytes for p in d.model.parameters()) + sum(t.nbytes for t in copies + cache)
    held += twin.nbytes if bf16_head else 0
    assert d.nbytes == held == DsparkDrafter.memory_bytes(str(path), 5)


def test_plain_decodes_handed_over_in_one_tensor_fill_the_same_context(model):
    """observe_decodes (the step's plain decodes, one position each, in one tensor) leaves the context
    cache as observe_many with one item per request does, a request finding every slot taken
    included, and the next drafts are the same."""
    cfg = drafter_config(model, num_layers=2, window=8)
    m = DsparkModel(cfg).init_weights(11)
    a, b = DsparkDrafter(m, model, max_requests=2), DsparkDrafter(m, model, max_requests=2)
    gen = torch.Generator().manual_seed(2)
    width = len(cfg.tap_layers) * cfg.hidden_size
    prompts = {"x": torch.randn(5, width, generator=gen), "y": torch.randn(3, width, generator=gen)}
    for d in (a, b):
        d.observe_many([(rid, 0, t) for rid, t in prompts.items()])
    for step in range(10):  # positions past the window: the ring wraps
        ids, positions = ["x", "z", "y"], [5 + step, step, 3 + step]  # "z" finds both slots taken
        rows = torch.randn(3, width, generator=gen)
        a.observe_many([(rid, pos, rows[i : i + 1]) for i, (rid, pos) in enumerate(zip(ids, positions))])
        b.observe_decodes(ids, positions, rows)
    for name in ("k", "v", "pos", "taps", "unprojected"):
        assert torch.equal(getattr(a.cache, name), getattr(b.cache, name)), name
    assert a.cache.slot("z") is None and b.cache.slot("z") is None
    seq = list(range(2, 2 + 15))
    assert a.propose("x", seq, 4).tokens == b.propose("x", seq, 4).tokens
