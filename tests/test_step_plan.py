"""The step-plan protocol between the engine core and its worker (tidal.engine.plan / worker):
plans survive the wire format, a fresh worker fed a run's recorded plans reproduces its logits bit
for bit (so every write to the pool's storage travels in the plans), and the copies in them are
what makes that so."""

from __future__ import annotations

import random

import pytest
import torch

from tidal import SamplingParams
from tidal.cache.allocator import CopyPages, CopyState, ZeroState
from tidal.engine.core import EngineConfig, EngineCore
from tidal.engine.plan import StepPlan, decode_plan, encode_plan
from tidal.engine.worker import Worker
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.plan import pool_layout
from tidal.presets import tiny_k3

PAGE = 4


@pytest.fixture(scope="module")
def model() -> KimiForCausalLM:
    return init_weights(KimiForCausalLM(tiny_k3()), seed=0).eval()


def record(engine: EngineCore) -> list[torch.Tensor | None]:
    """Keep every plan the engine runs (``engine.plan_recorder``) and, in the returned list, the
    logits its worker gave for each."""
    engine.plan_recorder = []
    logits: list[torch.Tensor | None] = []
    execute = engine.worker.execute

    def recording_execute(plan):
        out = execute(plan)
        logits.append(None if out is None else out.clone())
        return out

    engine.worker.execute = recording_execute
    return logits


@pytest.fixture(scope="module")
def recorded(model) -> tuple[EngineCore, list[StepPlan], list[torch.Tensor | None]]:
    """Three turns of 8 conversations sharing a system prompt in a 10-block pool with a 10-token
    budget: prefix hits (state copies, copy-on-write pages), snapshots, evictions, preemptions."""
    block = pool_layout(model.config, 1 << 30, page_size=PAGE, kv_dtype_bytes=4, conv_dtype_bytes=4).block_bytes
    engine = EngineCore(model, EngineConfig(max_num_batched_tokens=10, page_size=PAGE,
                                            kv_cache_memory_bytes=10 * block, prefix_snapshot_interval=6))
    logits = record(engine)
    rng = random.Random(5)
    vocab = model.config.vocab_size
    system = [rng.randrange(vocab) for _ in range(9)]
    convs = {str(i): system + [rng.randrange(vocab) for _ in range(rng.randint(3, 9))] for i in range(8)}
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True)
    for turn in range(3):
        for k, p in convs.items():
            engine.add_request(f"{k}/{turn}", p, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        for k in convs:
            convs[k] += done[f"{k}/{turn}"].outputs[0].token_ids + [rng.randrange(vocab) for _ in range(2)]
    m = engine.metrics()
    assert m.prefix_cache_hits > 0 and m.num_preemptions > 0 and m.num_compactions > 0
    return engine, engine.plan_recorder, logits


def replay(model, engine: EngineCore, plans: list[StepPlan]) -> list[torch.Tensor | None]:
    worker = Worker(model, engine.layout, cuda_graph=False)
    return [worker.execute(p) for p in plans]


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def test_plans_round_trip_the_wire_format(recorded):
    _, plans, _ = recorded
    for plan in plans:
        assert decode_plan(encode_plan(plan)) == plan


def test_a_fresh_worker_replaying_the_plans_gives_the_same_logits(model, recorded):
    engine, plans, logits = recorded
    kinds = {type(c) for p in plans for c in p.copies}
    assert {ZeroState, CopyState, CopyPages} <= kinds  # the run exercised every kind of copy
    got = replay(model, engine, [decode_plan(encode_plan(p)) for p in plans])
    assert len(got) == len(logits) and all(same(a, b) for a, b in zip(got, logits))


def test_the_copies_carry_what_the_replay_needs(model, recorded):
    engine, plans, logits = recorded
    stripped = [StepPlan(**{**vars(p), "copies": [c for c in p.copies if isinstance(c, ZeroState)]}) for p in plans]
    got = replay(model, engine, stripped)
    assert not all(same(a, b) for a, b in zip(got, logits))


def test_a_worker_takes_plans_in_order(model, recorded):
    engine, plans, _ = recorded
    worker = Worker(model, engine.layout, cuda_graph=False)
    with pytest.raises(RuntimeError, match="got the plan of step 2"):
        worker.execute(plans[1])
