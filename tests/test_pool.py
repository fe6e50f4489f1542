"""The shared memory pool: planner layout, exact capacity, fullest-first pages, compaction, shared
(reference-counted, copy-on-write) pages, and the pool-backed SequenceCache against the
SimpleCache reference."""

from __future__ import annotations

import random

import pytest
import torch

from tidal.cache.pool import FREE, KV, STATE, MemoryPool
from tidal.model.context import ForwardBatch, SimpleCache, simple_batch
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.plan import pool_layout
from tidal.presets import tiny_k3


def make_pool(num_blocks: int = 6, page_size: int = 4, dtype: torch.dtype = torch.float32) -> MemoryPool:
    config = tiny_k3()
    es = torch.empty(0, dtype=dtype).element_size()
    probe = pool_layout(config, 1 << 30, page_size=page_size, kv_dtype_bytes=es, conv_dtype_bytes=es)
    layout = pool_layout(config, num_blocks * probe.block_bytes + 7, page_size=page_size, kv_dtype_bytes=es,
                         conv_dtype_bytes=es)
    return MemoryPool(config, layout, dtype)


def test_capacity_is_the_planners():
    pool = make_pool(num_blocks=9)
    lay = pool.layout
    assert pool.num_blocks == lay.num_blocks == 9
    assert pool.buffer.numel() <= lay.pool_bytes
    assert pool.free_pages == lay.num_blocks * lay.pages_per_block
    # The longest request the pool holds alone is the planner's max_context_len.
    longest = lay.max_context_len()
    assert pool.alloc_state("r") and pool.reserve("r", longest)
    assert not pool.reserve("r", longest + 1)
    pool.free("r")
    # n requests of a context length fit exactly when the planner says so.
    for ctx in (1, 5, 37, 100):
        n = lay.max_requests(ctx)
        for i in range(n):
            assert pool.alloc_state(i) and pool.reserve(i, ctx), (ctx, i)
        assert not (pool.alloc_state(n) and pool.reserve(n, ctx))
        for i in range(n + 1):
            pool.free(i)
        assert pool.usage().free_blocks == lay.num_blocks


def test_pages_fill_fullest_block_first_and_empty_blocks_return():
    pool = make_pool(num_blocks=6)
    ppb = pool.pages_per_block
    ps = pool.page_size
    pool.reserve("a", ps * ppb)  # one full KV block
    pool.reserve("b", ps * 2)  # a second KV block, partly filled
    block_b = pool.page_table("b")[0] // ppb
    pool.reserve("c", ps * 1)
    assert pool.page_table("c")[0] // ppb == block_b  # the partly filled block, not a fresh one
    kinds = [pool._kind[b] for b in range(pool.num_blocks)]
    assert kinds.count(KV) == 2 and kinds.count(FREE) == 4
    pool.free("b")
    pool.free("c")
    assert [pool._kind[b] for b in range(pool.num_blocks)].count(KV) == 1


def test_state_blocks_are_zeroed_and_hold_bytes():
    pool = make_pool()
    assert pool.alloc_state("a")
    blocks = torch.tensor([pool.state_block("a")])
    conv, rec = pool.read_states(0, blocks)
    assert conv.abs().sum() == 0 and rec.abs().sum() == 0
    new_conv, new_rec = torch.randn_like(conv), torch.randn_like(rec)
    pool.write_states(0, blocks, new_conv, new_rec)
    conv, rec = pool.read_states(0, blocks)
    assert torch.equal(conv, new_conv) and torch.equal(rec, new_rec)
    assert torch.equal(pool.read_states(1, blocks)[1], torch.zeros_like(rec))  # other layers untouched


def test_compaction_frees_a_block_and_keeps_data():
    pool = make_pool(num_blocks=4)
    ppb, ps, C = pool.pages_per_block, pool.page_size, pool.config.mla_cache_width
    # Fill the whole pool with pages of 2*ppb owners, then free every other owner: no block is
    # FREE, but half the pages are.
    owners = list(range(4 * ppb))
    data = {}
    for o in owners:
        assert pool.reserve(o, ps)
        page = pool.page_table(o)[0]
        rows = torch.randn(ps, C)
        data[o] = rows
        b, s = torch.tensor([page // ppb]), torch.tensor([page % ppb])
        pool.write_latents(1, b.repeat(ps), s.repeat(ps), torch.arange(ps), rows)
    rng = random.Random(0)
    for o in rng.sample(owners, 2 * ppb):
        pool.free(o)
        del data[o]
    assert pool.usage().free_blocks == 0 and pool.free_pages == 2 * ppb
    assert pool.alloc_state("s") and pool.alloc_state("t")
    assert pool.num_compactions == 2 and pool.free_pages == 0
    assert [pool._kind[b] for b in range(4)].count(STATE) == 2
    for o, rows in data.items():
        page = pool.page_table(o)[0]
        got = pool.read_latents(1, torch.tensor([page // ppb]), torch.tensor([page % ppb]), ps)
        assert torch.equal(got, rows)


def test_random_alloc_free_is_exact_and_returns_to_start():
    pool = make_pool(num_blocks=7)
    start = pool.usage()
    rng = random.Random(1)
    held: dict[int, tuple[bool, int]] = {}  # owner -> (has state, tokens)
    ppb, ps = pool.pages_per_block, pool.page_size
    for step in range(600):
        o = rng.randrange(12)
        op = rng.random()
        if op < 0.2:
            pool.free(o)
            held.pop(o, None)
        elif op < 0.45 and not held.get(o, (False, 0))[0]:
            expect = pool.free_pages >= ppb
            assert pool.alloc_state(o) == expect
            if expect:
                held[o] = (True, held.get(o, (False, 0))[1])
        else:
            tokens = held.get(o, (False, 0))[1] + rng.randint(1, 3 * ps)
            need = pool.pages_needed(o, tokens)
            expect = need <= pool.free_pages
            assert pool.reserve(o, tokens) == expect
            if expect:
                held[o] = (held.get(o, (False, 0))[0], tokens)
        used = sum(ppb * s + -(-t // ps) for s, t in held.values())
        assert pool.free_pages == pool.total_pages - used
        u = pool.usage()
        assert u.free_blocks + u.state_blocks + u.kv_blocks == pool.num_blocks
    for o in list(held):
        pool.free(o)
    assert pool.usage() == start
    assert pool.num_compactions > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_cache_matches_simple_cache(dtype):
    """Same model steps (chunked prefill, then mixed prefill + decode) over the pool and over the
    reference SimpleCache give the same logits."""
    config = tiny_k3()
    torch.manual_seed(0)
    model = init_weights(KimiForCausalLM(config), seed=0).to_dtype(dtype).eval()
    pool = make_pool(num_blocks=12, dtype=dtype)
    ref = SimpleCache(config, 2, dtype)
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (13,), generator=rng), torch.randint(0, 250, (6,), generator=rng)]
    steps = [  # (query_lens, cached_lens, tokens)
        ([5, 6], [0, 0], torch.cat([prompts[0][:5], prompts[1]])),
        ([8, 1], [5, 6], torch.cat([prompts[0][5:], torch.tensor([7])])),
        ([1, 1], [13, 7], torch.tensor([3, 9])),
        ([1, 1], [14, 8], torch.tensor([11, 200])),
    ]
    pool.alloc_state("a")
    pool.alloc_state("b")
    # Scramble page ownership so pages are not contiguous.
    pool.reserve("x", 3 * pool.page_size)
    with torch.inference_mode():
        for q, c, ids in steps:
            for o, qq, cc in zip("ab", q, c):
                assert pool.reserve(o, qq + cc)
            if pool.page_table("x"):  # churn other pages between steps
                pool.free("x")
            else:
                pool.reserve("x", 2)
            view = pool.cache_view(["a", "b"], q, c)
            got = model.compute_logits(model(ids, ForwardBatch(q, c, view)))
            want = model.compute_logits(model(ids, simple_batch(config, q, ref, c)))
            # equal up to rounding: the pool's decode reads its pages in place (C kernel on the CPU)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_shared_pages_are_refcounted_copied_on_write_and_remapped_by_compaction():
    pool = make_pool(num_blocks=4)
    start = pool.usage()
    ppb, ps, C = pool.pages_per_block, pool.page_size, pool.config.mla_cache_width

    def write(page: int, rows: torch.Tensor) -> None:
        b, s = torch.tensor([page // ppb]), torch.tensor([page % ppb])
        pool.write_latents(0, b.repeat(ps), s.repeat(ps), torch.arange(ps), rows)

    def read(page: int) -> torch.Tensor:
        return pool.read_latents(0, torch.tensor([page // ppb]), torch.tensor([page % ppb]), ps)

    for o in range(ppb):  # one full KV block of one-page owners
        assert pool.reserve(o, ps)
    assert pool.reserve("a", 3 * ps)  # a second KV block
    data = [torch.randn(ps, C) for _ in range(3)]
    for page, rows in zip(pool.page_table("a"), data):
        write(page, rows)
    for o in range(ppb - 4):
        pool.free(o)
    pool.share("b", pool.page_table("a")[:2])
    assert [pool.refcount(p) for p in pool.page_table("a")] == [2, 2, 1]
    used = pool.usage().used_pages
    pool.free("a")
    assert pool.usage().used_pages == used - 1  # only the page b does not hold went
    b_pages = list(pool.page_table("b"))
    assert pool.unshare_last_page("b") and pool.page_table("b") == b_pages  # sole holder: no copy
    pool.share("c", pool.page_table("b"))
    old = pool.page_table("c")[-1]
    assert pool.unshare_last_page("c")
    new = pool.page_table("c")[-1]
    assert new != old and pool.refcount(old) == 1 and pool.refcount(new) == 1 and torch.equal(read(new), data[1])
    # The third state block needs a compaction; it empties b's block (the emptiest), whose first
    # page c shares: both tables follow the move.
    for name in "xyz":
        assert pool.alloc_state(name)
    assert pool.num_compactions == 1 and pool.page_table("b") != b_pages
    assert pool.page_table("b")[0] == pool.page_table("c")[0]
    assert torch.equal(read(pool.page_table("c")[0]), data[0]) and torch.equal(read(pool.page_table("b")[1]), data[1])
    assert pool.refcount(pool.page_table("b")[0]) == 2
    for owner in ["b", "c", "x", "y", "z", *range(ppb - 4, ppb)]:
        pool.free(owner)
    assert pool.usage() == start


def test_request_states_take_the_lowest_blocks_cache_and_kv_the_highest():
    """Running requests' states stay side by side at the bottom (one strided view per decode run);
    KV blocks and the prefix cache's snapshots fill from the top; a state handed to the cache moves
    up when a higher block is free."""
    from tidal.cache.pool import CacheOwner

    pool = make_pool(num_blocks=8)
    top = pool.num_blocks - 1
    pool.alloc_state("a")
    pool.reserve("a", 1)
    snap = CacheOwner()
    pool.alloc_state(snap)
    pool.alloc_state("b")
    assert (pool.state_block("a"), pool.state_block("b")) == (0, 1)
    assert pool.state_block(snap) == top - 1 and pool.page_table("a")[0] // pool.pages_per_block == top
    pool.buffer[0, :64] = 7
    done = CacheOwner()
    pool.move_state("a", done)  # request "a" finished: its state goes to the cache, upwards
    assert pool.state_block(done) == top - 2 and bool((pool.buffer[top - 2, :64] == 7).all())
    pool.alloc_state("c")
    assert pool.state_block("c") == 0  # the freed bottom block is reused by the next request


def test_decode_on_scattered_state_blocks_matches_simple_cache():
    """States in several runs of blocks (gaps left by finished requests, batch order unlike block
    order) are stepped in place and give the reference logits."""
    config = tiny_k3()
    model = init_weights(KimiForCausalLM(config), seed=1).eval()
    pool = make_pool(num_blocks=24)
    for owner in ["e", "gap1", "d", "c", "gap2", "b", "a"]:
        pool.alloc_state(owner)
    pool.free("gap1")
    pool.free("gap2")
    owners = list("abcde")
    assert len({pool.state_block(o) for o in owners}) == 5
    ref = SimpleCache(config, 5, torch.float32)
    rng = torch.Generator().manual_seed(3)
    lens = [7, 3, 20, 1, 12]
    tokens = [torch.randint(0, 250, (n + 4,), generator=rng) for n in lens]
    steps = [(lens, [0] * 5)] + [([1] * 5, [n + i for n in lens]) for i in range(4)]
    with torch.inference_mode():
        for q, c in steps:
            ids = torch.cat([t[cc : cc + qq] for t, qq, cc in zip(tokens, q, c)])
            for o, qq, cc in zip(owners, q, c):
                assert pool.reserve(o, qq + cc)
            view = pool.cache_view(owners, q, c)
            batch = ForwardBatch(q, c, view)
            got = model.compute_logits(model(ids, batch))
            want = model.compute_logits(model(ids, simple_batch(config, q, ref, c)))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert len(batch.decode_runs(torch.device("cpu"))) > 1
