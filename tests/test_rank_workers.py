"""One worker process per rank behind the engine core: the core schedules once, broadcasts each
step's plan, samples once on rank 0's gathered logits. Real processes joined by gloo."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import parallel_ranks as pr  # noqa: E402
from tidal import LLM, SamplingParams  # noqa: E402
from tidal.engine.faults import StepFailedError, WorkerLostError  # noqa: E402
from tidal.model.checkpoint import read_config  # noqa: E402
from tidal.plan.planner import plan_for_pool  # noqa: E402
from tidal.plan.weights import weight_breakdown  # noqa: E402


def test_rank_workers_serve_like_tp1_and_a_dead_rank_fails_fast(tmp_path) -> None:
    ckpt = str(pr.make_checkpoint("k3", tmp_path / "k3"))
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 33 + i, 2, 8, 40 + 3 * i][: 3 + i]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=0)
    kw = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, page_size=pr.PAGE)
    want = LLM(ckpt, **kw).generate(prompts, params)
    llm = LLM(ckpt, tp_size=2, dcp_size=2, **kw)
    try:
        # What each rank process allocated is what the planner says from the config alone; the
        # logical context is the per-rank KV tokens x dcp.
        config = read_config(Path(ckpt))
        plan = plan_for_pool(config, kw["kv_cache_memory_bytes"], tp_size=2, dcp_size=2, page_size=pr.PAGE,
                             dtype=torch.float32)
        per_rank_weights = sum(s.per_rank_bytes for s in weight_breakdown(config, tp_size=2))
        assert [m.weight_bytes for m in llm.workers.memory] == [per_rank_weights] * 2
        assert [m.pool_bytes for m in llm.workers.memory] == [plan.layout.num_blocks * plan.layout.block_bytes] * 2
        assert [m.kv_tokens for m in llm.workers.memory] == [plan.kv_tokens_per_rank] * 2
        assert llm.engine.layout.kv_tokens_logical == 2 * plan.kv_tokens_per_rank == plan.kv_tokens_logical
        assert llm.engine.layout.max_context_len() == plan.layout.max_context_len()
        got = llm.generate(prompts, params)
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for a, b in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:]):
                (ta, la), = a.items()
                assert abs(la.logprob - b[ta].logprob) < 1e-3
        assert llm.workers.alive()  # a heartbeat round trip
        llm.workers.procs[1].kill()
        start = time.monotonic()
        with pytest.raises(StepFailedError, match=r"rank 1's worker \(pid \d+\) exited \(killed by signal 9\)") as lost:
            llm.generate(prompts, params)
        assert time.monotonic() - start < 30
        assert isinstance(lost.value.__cause__, WorkerLostError)
        assert not llm.workers.alive()  # what /health reads: 503 from now on
        with pytest.raises(StepFailedError, match=r"rank 1's worker"):  # later requests fail at once, naming it
            llm.generate(prompts[:1], params)
    finally:
        llm.close()
    assert all(p.poll() is not None for p in llm.workers.procs)
