"""Derived weights (tidal.model.layers.derived_weight): recomputed when a parameter changes, and
within a model runner's frozen weights (frozen_weights) checked once per epoch, then trusted."""

from __future__ import annotations

import torch
from torch import nn

from tidal.model.layers import derived_weight, frozen_weights, kept_derived, trusted_derived, weights_epoch


def owner_of(*shape: int) -> tuple[nn.Module, nn.Parameter]:
    m = nn.Module()
    m.w = nn.Parameter(torch.randn(*shape), requires_grad=False)
    return m, m.w


def doubled(m: nn.Module, calls: list[int]) -> torch.Tensor:
    w = m.w
    return derived_weight(m, "_doubled", (w,), lambda: calls.append(1) or w * 2)


def test_recomputed_when_a_parameter_changes_outside_frozen_weights():
    m, w = owner_of(3, 4)
    calls: list[int] = []
    first = doubled(m, calls)
    assert doubled(m, calls) is first and len(calls) == 1
    with torch.no_grad():
        w.add_(1.0)  # an in-place write
    assert torch.equal(doubled(m, calls), w * 2) and len(calls) == 2
    m.w.data = torch.randn(3, 4)  # new storage
    assert torch.equal(doubled(m, calls), m.w * 2) and len(calls) == 3
    m.w.data = m.w.data.to(torch.float64)  # another dtype
    assert doubled(m, calls).dtype == torch.float64 and len(calls) == 4


def test_frozen_weights_check_once_per_epoch_then_trust():
    m, w = owner_of(2, 2)
    calls: list[int] = []
    doubled(m, calls)
    with torch.no_grad():
        w.add_(1.0)  # before the epoch: its first use sees the change
    epoch = weights_epoch()
    assert trusted_derived(m, "_doubled") is None  # not inside frozen_weights
    with frozen_weights(epoch):
        assert trusted_derived(m, "_doubled") is None  # not checked under this epoch yet
        got = doubled(m, calls)
        assert torch.equal(got, w * 2) and len(calls) == 2
        assert trusted_derived(m, "_doubled") is got
        with torch.no_grad():
            w.add_(1.0)  # a write inside breaks the promise: the kept value is trusted
        assert doubled(m, calls) is got and len(calls) == 2
    assert trusted_derived(m, "_doubled") is None  # outside again: checked, and recomputed
    assert torch.equal(doubled(m, calls), w * 2) and len(calls) == 3
    with frozen_weights(weights_epoch()):  # a new epoch checks again
        assert trusted_derived(m, "_doubled") is None
        doubled(m, calls)
        assert len(calls) == 3


def test_a_kept_method_runs_once_per_epoch():
    """kept_derived: within frozen_weights the kept value is returned without running the method
    (which gathers the parameters); outside it the method runs at every call."""

    class Owner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 2), requires_grad=False)
            self.runs = 0

        @kept_derived("_doubled")
        def doubled(self) -> torch.Tensor:
            self.runs += 1
            return derived_weight(self, "_doubled", (self.w,), lambda: self.w * 2)

    m = Owner()
    m.doubled(), m.doubled()
    assert m.runs == 2
    with frozen_weights(weights_epoch()):
        first = m.doubled()
        assert m.doubled() is first and m.doubled() is first and m.runs == 3


def test_a_runner_steps_inside_its_epoch():
    """The engine's runner runs its steps with the model's weights frozen under its own epoch: a
    decode step leaves the layers' step plans checked under it."""
    from tidal import LLM, SamplingParams
    from tidal.embedded import embedded_model_dir

    llm = LLM(embedded_model_dir(), dtype="bfloat16", enable_prefix_caching=False, kv_cache_memory_bytes=32_000_000)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(temperature=0, max_tokens=3))
    runner = llm.engine.worker.runner
    kept = [mod.__dict__["_step_plan_cached"] for mod in runner.model.modules() if "_step_plan_cached" in mod.__dict__]
    assert kept and all(entry[2] == runner.weights_epoch for entry in kept)
