"""Subnormals flushed to zero on the threads that run a CPU engine's steps (tidal.ops.float_mode):
the calling thread and its OpenMP pool, set by the worker on whichever thread runs the steps, off
under TIDAL_FLUSH_DENORMALS=0; and the chunked KDA prefill, where decays make subnormals, still
equals its float64 reference in that mode."""

from __future__ import annotations

import threading

import pytest
import torch

from tidal import LLM, SamplingParams
from tidal.embedded import embedded_model_dir
from tidal.ops import float_mode
from tidal.ops.cpu_kernels import float_mode_kernels
from tidal.ops.kda import kda_chunked, kda_recurrent

pytestmark = pytest.mark.skipif(float_mode_kernels() is None, reason="no C compiler here")

TINY = 1e-39  # below the smallest normal float32 (1.18e-38)


@pytest.fixture(autouse=True)
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def subnormal_products() -> torch.Tensor:
    """A product large enough that torch splits it over its pool, every result subnormal."""
    return torch.full((1 << 20,), 1e-20) * torch.full((1 << 20,), 1e-19)


def test_flush_sets_the_caller_and_its_pool():
    float_mode.flush_denormals(False)
    assert not float_mode.flushing_denormals()
    assert (subnormal_products() > 0).all()
    assert float_mode.flush_denormals(True) and float_mode.flushing_denormals()
    assert (subnormal_products() == 0).all()  # both threads' halves
    assert torch.tensor([TINY]).mul(1.0).item() == 0.0  # a subnormal input reads as zero
    assert float_mode.flush_denormals(False) and not float_mode.flushing_denormals()
    assert (subnormal_products() > 0).all()


@pytest.mark.parametrize("env", [None, "0"])
def test_the_worker_flushes_the_thread_that_runs_its_steps(monkeypatch, env):
    if env is not None:
        monkeypatch.setenv("TIDAL_FLUSH_DENORMALS", env)
    llm = LLM(str(embedded_model_dir()), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    seen = {}

    def run() -> None:
        seen["before"] = float_mode.flushing_denormals()
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, temperature=0.0))
        seen["after"] = float_mode.flushing_denormals()
        seen["products"] = bool((subnormal_products() == 0).all())

    thread = threading.Thread(target=run)  # a thread of its own: a fresh MXCSR and OpenMP pool
    thread.start()
    thread.join()
    assert seen["before"] is False
    assert seen["after"] is seen["products"] is (env is None)


def test_chunked_kda_with_vanishing_decays_equals_float64_when_flushing():
    """Decays at the gate's floor: exp(G) over a chunk underflows through the subnormal range, the
    case flushing speeds up; the chunked form still equals the float64 recurrence."""
    float_mode.flush_denormals(True)
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, V = 1, 150, 2, 32, 16
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = -4.0 - torch.rand(B, T, H, K, generator=gen)  # log decay per token in [-5, -4]
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, K, V, generator=gen)
    with torch.inference_mode():
        out, last = kda_chunked(q, k, v, g, beta, state.clone())
        ref, ref_last = kda_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double(), state.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last.double(), ref_last, rtol=1e-4, atol=1e-4)
