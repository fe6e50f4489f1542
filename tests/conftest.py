"""Test-wide settings."""

import pytest
import torch

from tidal.ops import float_mode

# Tests run tiny models: one thread avoids OpenMP spin contention on small CPU machines, which
# makes tiny element-wise ops orders of magnitude slower when another process uses the other core.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def ieee_subnormals():
    """Each test starts with IEEE subnormals: an engine's worker flushes them to zero on the thread
    that runs its steps (tidal.ops.float_mode), which would otherwise carry into the next test."""
    yield
    if float_mode.flushing_denormals():
        float_mode.flush_denormals(False)
