"""A whole long prompt prefilled by the engine in chunks (tiny K3 with wide MLA: 8 heads, nope 64,
v 64): peak memory follows the KV the prompt writes, not the context times the heads (each size in a
fresh process: peak RSS is a process-wide high-water mark, tracemalloc does not see torch
tensors); and the chunked prefill's prompt log-probabilities equal the naive kernel's.

Sizes: 4k and 8k tokens, the largest whose full prefill (quadratic in the prompt) stays within
seconds on the test machine; the issue's 12k / 24k run with ``benchmarks/bench_mla_memory.py
--prefills 12288,24576``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tidal.engine.core import EngineConfig, EngineCore
from tidal.model.context import SimpleCache, simple_batch
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_mla_memory import measure_prefill, wide_mla_config  # noqa: E402


def test_full_chunked_prefill_memory_follows_the_kv_not_the_context():
    small, large = measure_prefill(4096, chunk=512), measure_prefill(8192, chunk=512)
    assert small["steps"] == 8 and large["steps"] == 16  # chunked prefill, then nothing more
    extra_kv = large["kv_bytes"] - small["kv_bytes"]
    # the naive kernel expands k and v over the context: 8 heads x (64 + 64) x 4 B per cached token,
    # per chunk; at 8k that is 4k tokens' worth more than at 4k
    expansion = 4096 * 8 * 128 * 4
    bound = 4 * extra_kv + (8 << 20)
    assert expansion > bound
    assert large["peak_rss_growth"] - small["peak_rss_growth"] < bound, (small, large)


def test_chunked_prefill_logprobs_equal_the_naive_kernel():
    torch.manual_seed(0)
    config = wide_mla_config()
    model = init_weights(KimiForCausalLM(config), seed=0).to_dtype(torch.float32).eval()
    ids = torch.randint(0, config.vocab_size, (300,), generator=torch.Generator().manual_seed(3))
    cache = SimpleCache(config, 1, torch.float32)
    with torch.inference_mode():  # the reference: one pass, the naive kernel over a SimpleCache
        h = model(ids, simple_batch(config, [300], cache, [0]))
        naive = model.compute_logits(h).log_softmax(-1)[torch.arange(299), ids[1:]]
    engine = EngineCore(model, EngineConfig(max_num_batched_tokens=64, kv_cache_memory_bytes=64 << 20,
                                            enable_prefix_caching=False))
    engine.add_request("r", ids.tolist(), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    chunked = torch.tensor([d[int(t)].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])])
    assert engine.metrics().num_requests_finished == 1
    assert torch.allclose(chunked, naive.float(), atol=1e-4), (chunked - naive).abs().max()
