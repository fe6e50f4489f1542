import pytest
import torch

from tidal.ops.short_conv import causal_conv_step
from tidal.ops.triton.short_conv import conv_step_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_step_on_pool_slots_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    N, W, C = 7, 4, 300  # C not a multiple of the channel block
    # a strided view, as the pool's: each slot's [W-1, C] rows inside a wider block
    storage = torch.randn(N, W * C + 5, generator=gen).to(dtype)
    state = storage[:, 3 : 3 + (W - 1) * C].unflatten(1, (W - 1, C))
    weight = torch.randn(C, W, generator=gen)
    slots = torch.tensor([5, 1, -1, 2])  # -1: a padded row, skipped
    x = torch.randn(len(slots), C, generator=gen).to(dtype)
    before, outside = state.clone(), storage.clone()
    out = torch.full_like(x, 7.0)
    conv_step_(x, weight, state, slots, out=out)
    live = slots >= 0
    ref_y, ref_state = causal_conv_step(x[live], weight, before[slots[live]])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out[live], ref_y, **tol)
    assert torch.equal(state[slots[live]], ref_state)  # the state only moves values
    assert (out[~live] == 7.0).all()
    untouched = [s for s in range(N) if s not in slots.tolist()]
    assert torch.equal(state[untouched], before[untouched])
    end = 3 + (W - 1) * C
    assert torch.equal(storage[:, :3], outside[:, :3]) and torch.equal(storage[:, end:], outside[:, end:])
