"""Prefix cache for the hybrid model: exact outputs with hits at several depths, multi-turn hits,
memory pressure with a pool of few blocks, LRU order, and exact reference counts.

The engine tests compare a caching engine against one with the cache disabled on a tiny random K3
model (float32). Greedy tokens must be identical. Logprobs are compared to 5e-4: a hit changes
where prefill chunks start, and on this model chunking alone (two cache-less engines with budgets
2048 and 7) already moves logprobs by up to 1e-4 in float32; a wrong state or page moves them by
far more than that.

The scheduler test needs no model: a fake "forward" writes, for every computed token, KV rows that
identify the token's whole prefix and a state that identifies the sequence so far; before every
step each scheduled request's pages and state must hold exactly what its own computed prefix
would have written -- whatever it shared, copied or had remapped by compaction.
"""

from __future__ import annotations

import logging
import random
from collections import Counter

import pytest
import torch

from tidal import LLM, SamplingParams
from tidal.cache.pool import MemoryPool
from tidal.cache.prefix import Node, PrefixCache
from tidal.engine.core import EngineConfig, EngineCore
from tidal.engine.request import Request, RequestOutput
from tidal.engine.scheduler import ScheduledBatch, Scheduler
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.plan import pool_layout, prefix_snapshot_interval
from tidal.presets import tiny_k3

PAGE = 4
INTERVAL = 8


@pytest.fixture(scope="module")
def model() -> KimiForCausalLM:
    torch.manual_seed(0)
    return init_weights(KimiForCausalLM(tiny_k3()), seed=0).eval()


def block_bytes() -> int:
    return pool_layout(tiny_k3(), 1 << 30, page_size=PAGE, kv_dtype_bytes=4, conv_dtype_bytes=4).block_bytes


def make_engine(model, *, blocks: int = 64, budget: int = 2048, cache: bool = True) -> EngineCore:
    cfg = EngineConfig(max_num_batched_tokens=budget, page_size=PAGE, kv_cache_memory_bytes=blocks * block_bytes(),
                       enable_prefix_caching=cache, prefix_snapshot_interval=INTERVAL)
    return EngineCore(model, cfg)


def run(engine: EngineCore, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, RequestOutput]:
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    out: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        out.update({o.request_id: o for o in engine.step() if o.finished})
    return out


def assert_same(got: RequestOutput, want: RequestOutput) -> None:
    g, w = got.outputs[0], want.outputs[0]
    assert g.token_ids == w.token_ids, got.request_id
    if w.logprobs is not None:
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=5e-4)
    if want.prompt_logprobs is not None:
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs)
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=5e-4) and a[t].rank == b[t].rank


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(250) for _ in range(n)]


def test_hits_at_several_depths_are_exact(model):
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    base = rand_tokens(rng, 30)
    cold = make_engine(model, cache=False)
    warm = make_engine(model, budget=INTERVAL)
    [b] = run(warm, {"base": base}, greedy).values()
    assert b.num_cached_tokens == 0
    assert_same(b, run(cold, {"base": base}, greedy)["base"])
    reply = b.outputs[0].token_ids
    # The base request, in chunks of 8, left snapshots at 8, 16, 24 (interval), 30 (prompt end) and 35 (finish:
    # prompt + reply - 1, its last token was never computed).
    cases = {  # prompt -> the hit it must get
        "inside-first-page": (base[:13] + rand_tokens(rng, 7), 8),
        "interval": (base[:27] + rand_tokens(rng, 5), 24),
        "same-prompt": (list(base), 24),  # the last token is never served from the cache
        "prompt-end": (base + reply[:3] + rand_tokens(rng, 4), 30),  # 30 % PAGE != 0: a copied page
        "finish": (base + reply[:5] + rand_tokens(rng, 9), 35),
        "whole-previous": (base + reply, 35),
        "miss": (rand_tokens(rng, 18), 0),
    }
    want = run(cold, {k: p for k, (p, _) in cases.items()}, greedy)
    got = run(warm, {k: p for k, (p, _) in cases.items()}, greedy)
    for k, (_, depth) in cases.items():
        assert got[k].num_cached_tokens == depth, k
        assert_same(got[k], want[k])
    m = warm.metrics()
    assert m.prefix_cache_hits == sum(d for _, d in cases.values())
    assert m.prefix_cache_queries == len(base) + sum(len(p) for p, _ in cases.values())
    assert cold.metrics().prefix_cache_queries == 0
    # A second round hits what the first round's requests cached (and splits their edges).
    again = {k: p + got[k].outputs[0].token_ids + [1, 2, 3] for k, (p, _) in cases.items()}
    got2 = run(warm, {k + "2": p for k, p in again.items()}, greedy)
    want2 = run(cold, {k + "2": p for k, p in again.items()}, greedy)
    for k in again:
        assert got2[k + "2"].num_cached_tokens == len(cases[k][0]) + 5, k  # the previous finish
        assert_same(got2[k + "2"], want2[k + "2"])


def test_prompt_logprobs_skip_the_cache_and_are_exact(model):
    rng = random.Random(1)
    base = rand_tokens(rng, 21)
    warm = make_engine(model)
    cold = make_engine(model, cache=False)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    run(warm, {"base": base}, plain)
    scored = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    prompt = base + rand_tokens(rng, 6)
    got = run(warm, {"p": prompt}, scored)["p"]
    assert got.num_cached_tokens == 0  # every prompt position's logits are needed
    assert_same(got, run(cold, {"p": prompt}, scored)["p"])
    # ... but it still fills the cache: its end is the next request's hit.
    nxt = prompt + got.outputs[0].token_ids + [5]
    follow = run(warm, {"n": nxt}, plain)["n"]
    assert follow.num_cached_tokens == len(prompt) + 3
    assert_same(follow, run(cold, {"n": nxt}, plain)["n"])


def test_five_turn_conversations_hit_the_previous_turns(model):
    llm = LLM(model, skip_tokenizer_init=True, kv_cache_memory_bytes=64 * block_bytes(), page_size=PAGE,
              max_num_batched_tokens=10, prefix_snapshot_interval=INTERVAL)
    cold = LLM(model, skip_tokenizer_init=True, kv_cache_memory_bytes=64 * block_bytes(), page_size=PAGE,
               enable_prefix_caching=False)
    rng = random.Random(2)
    convs = [rand_tokens(rng, rng.randint(5, 15)) for _ in range(2)]
    previous = [0, 0]
    for turn in range(5):
        params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 9), ignore_eos=True) for _ in convs]
        outs = llm.generate([{"prompt_token_ids": c} for c in convs], params)
        refs = cold.generate([{"prompt_token_ids": c} for c in convs], params)
        for i, (out, ref) in enumerate(zip(outs, refs)):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            assert ref.num_cached_tokens == 0
            # The previous turn (prompt + reply) is cached but its last token, never computed.
            assert out.num_cached_tokens == max(0, previous[i] - 1)
            assert out.num_cached_tokens >= (previous[i] - 1) // INTERVAL * INTERVAL
            previous[i] = len(convs[i]) + len(out.outputs[0].token_ids)
            convs[i] = convs[i] + out.outputs[0].token_ids + rand_tokens(rng, rng.randint(3, 12))
    m = llm.engine.metrics()
    assert m.prefix_cache_hits > 0.5 * m.prefix_cache_queries


def test_memory_pressure_all_complete_exact_and_flush_restores_the_pool(model):
    """12 blocks (a snapshot is a block) and 8 concurrent conversations of 3 turns: snapshots are
    evicted, requests preempted; every answer is still the cold engine's, and flushing the cache
    returns the pool to its starting state."""
    engine = make_engine(model, blocks=12, budget=10)
    cold = make_engine(model, cache=False)
    start = engine.pool.usage()
    rng = random.Random(3)
    system = rand_tokens(rng, 10)  # a shared system prompt
    convs = {str(i): system + rand_tokens(rng, rng.randint(4, 14)) for i in range(8)}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cached = 0
    for turn in range(3):
        got = run(engine, {f"{k}/{turn}": p for k, p in convs.items()}, params)
        want = run(cold, {f"{k}/{turn}": p for k, p in convs.items()}, params)
        for k, prompt in convs.items():
            rid = f"{k}/{turn}"
            assert got[rid].finished and got[rid].outputs[0].finish_reason == "length"
            assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
            cached += got[rid].num_cached_tokens
            convs[k] = prompt + got[rid].outputs[0].token_ids + rand_tokens(rng, rng.randint(2, 6))
    m = engine.metrics()
    assert m.num_requests_finished == 24 and m.num_requests_aborted == 0
    assert m.prefix_cache_evicted_snapshots > 0 and m.num_preemptions > 0 and cached > 0
    assert m.prefix_cache_hits == cached
    assert engine.pool.usage() != start  # the cache holds what the last turn left
    assert engine.flush_prefix_cache()
    assert engine.pool.usage() == start
    assert engine.metrics().prefix_cache_snapshots == 0 and engine.pool.cache_only_pages == 0
    # Flushing while requests run leaves them their pages: they finish exactly.
    for k, p in convs.items():
        engine.add_request(k, p, params)
    engine.step()
    engine.step()
    assert engine.flush_prefix_cache()
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    want = run(cold, {k + "x": p for k, p in convs.items()}, params)
    assert all(done[k].outputs[0].token_ids == want[k + "x"].outputs[0].token_ids for k in convs)
    assert not make_engine(model, cache=False).flush_prefix_cache()


# ---- the cache on a pool, without a model ----------------------------------------------------------


def make_pool(num_blocks: int) -> MemoryPool:
    layout = pool_layout(tiny_k3(), num_blocks * block_bytes(), page_size=PAGE, kv_dtype_bytes=4,
                         conv_dtype_bytes=4)
    return MemoryPool(tiny_k3(), layout, torch.float32)


def prefix_codes(tokens: list[int]) -> list[int]:
    """A number for every prefix tokens[:t+1] (exact in float32)."""
    out, h = [], 7
    for tok in tokens:
        h = (h * 1000003 + tok + 1) % 8388593
        out.append(h)
    return out


def fake_forward(pool: MemoryPool, req: Request, start: int, n: int) -> None:
    """Write what a model would: KV rows of tokens [start, start + n), then the state after them."""
    rid, ps, ppb = req.request_id, pool.page_size, pool.pages_per_block
    codes = prefix_codes(req.token_ids[: start + n])
    table = pool.page_table(rid)
    pages = [table[t // ps] for t in range(start, start + n)]
    b, s = torch.tensor([p // ppb for p in pages]), torch.tensor([p % ppb for p in pages])
    pos = torch.tensor([t % ps for t in range(start, start + n)])
    rows = torch.tensor(codes[start:], dtype=torch.float32)[:, None].expand(n, pool.config.mla_cache_width)
    for layer in range(pool.config.num_mla_layers):
        pool.write_latents(layer, b, s, pos, rows + layer)
    block = torch.tensor([pool.state_block(rid)])
    for layer in range(pool.config.num_kda_layers):
        conv, rec = pool.read_states(layer, block)
        pool.write_states(layer, block, torch.full_like(conv, codes[-1] + layer), torch.full_like(rec, -codes[-1]))


def check_holds_its_prefix(pool: MemoryPool, req: Request) -> None:
    """The request's pages and state are exactly those of its computed tokens."""
    c, rid, ppb = req.num_computed_tokens, req.request_id, pool.pages_per_block
    block = torch.tensor([pool.state_block(rid)])
    if c == 0:
        assert all(pool.read_states(i, block)[1].abs().sum() == 0 for i in range(pool.config.num_kda_layers))
        return
    codes = torch.tensor(prefix_codes(req.token_ids[:c]), dtype=torch.float32)
    pages = pool.page_table(rid)[: pool.pages_for(c)]
    b, s = torch.tensor([p // ppb for p in pages]), torch.tensor([p % ppb for p in pages])
    for layer in range(pool.config.num_mla_layers):
        assert torch.equal(pool.read_latents(layer, b, s, c)[:, 0], codes + layer), (rid, layer)
    for layer in (0, pool.config.num_kda_layers - 1):
        conv, rec = pool.read_states(layer, block)
        assert bool((conv == codes[-1] + layer).all()) and bool((rec == -codes[-1]).all()), rid


def check_counts(pool: MemoryPool, cache: PrefixCache) -> None:
    """Reference counts, used and cache-only pages and free capacity, recounted from the tables."""
    refs = Counter(p for table in pool._tables.values() for p in table)
    assert refs == Counter({p: pool.refcount(p) for p in pool._holders})
    assert pool._used_pages == len(refs)
    only = sum(1 for p in refs if all(isinstance(o, Node) for o, _ in pool._holders[p]))
    assert pool.cache_only_pages == only
    assert pool.free_pages == pool.total_pages - pool.pages_per_block * len(pool._states) - len(refs)
    ps = pool.page_size
    for node in cache.nodes():
        assert len(pool.page_table(node)) == (node.end - 1) // ps - node.start // ps + 1
        assert node.parent.children[node.tokens[0]] is node and node.alive
        assert node.snapshot == pool.has_state(node) == (node in cache._snapshots)
        assert node.children or node.snapshot  # every leaf has a snapshot


def fake_step(sched: Scheduler) -> ScheduledBatch:
    """One engine step with the fake forward: check what each scheduled request holds, compute,
    commit, sample a token that depends on the sequence, snapshot and finish as EngineCore does."""
    pool = sched.pool
    batch = sched.schedule()
    for req, n, c in zip(batch.requests, batch.query_lens, batch.cached_lens):
        assert c == req.num_computed_tokens and 1 <= n <= req.num_uncomputed
        check_holds_its_prefix(pool, req)
    for req, n, c in zip(batch.requests, batch.query_lens, batch.cached_lens):
        fake_forward(pool, req, c, n)
        req.num_computed_tokens += n
    due = [r for r, c, n in zip(batch.requests, batch.cached_lens, batch.query_lens) if sched.snapshot_due(r, c, n)]
    for req in batch.requests:
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(prefix_codes(req.token_ids)[-1] % 3)
            if req.finished:
                sched.finish(req)
    for req in due:
        if not req.finished:
            sched.snapshot(req)
    return batch


def make_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, eos_token_ids=(), max_tokens=max_tokens)


@pytest.mark.parametrize("blocks,live_cap,max_out", [(24, 4, 16), (12, 12, 30)], ids=["roomy", "tight"])
def test_scheduler_with_cache_keeps_exact_contents_and_counts(blocks, live_cap, max_out):
    """Random requests, many continuing earlier sequences, through the real scheduler with a fake
    forward. Roomy: the cache keeps much and is hit often. Tight: requests are preempted and
    snapshots evicted constantly."""
    rng = random.Random(blocks)
    pool = make_pool(blocks)
    cache = PrefixCache(pool, snapshot_interval=8)
    sched = Scheduler(pool, 13, cache)
    start = pool.usage()
    history: list[list[int]] = [[]]
    live: list[Request] = []
    hits = 0
    for step in range(600):
        if len(live) < live_cap and rng.random() < 0.5:  # a new request, often continuing an old sequence
            base = rng.choice(history)[: rng.randint(0, 60)]
            req = make_request(f"r{step}", base + [rng.randrange(3) for _ in range(rng.randint(1, 12))],
                               rng.randint(1, max_out))
            sched.add(req)
            live.append(req)
        running = list(sched.running)
        batch = fake_step(sched)
        hits += sum(1 for r, c in zip(batch.requests, batch.cached_lens) if c > 0 and r not in running)
        for req in [r for r in live if r.finished]:
            live.remove(req)
            history.append(req.token_ids)
        if live and rng.random() < 0.02:  # abort one
            victim = rng.choice(live)
            sched.remove(victim)
            live.remove(victim)
        check_counts(pool, cache)
        if rng.random() < 0.01:  # evicting everything frees exactly what the cache says it can
            free, evictable = pool.free_pages, cache.evictable_units()
            cache.flush()
            assert pool.free_pages == free + evictable
            check_counts(pool, cache)
    while live:
        sched.remove(live.pop())
    assert cache.num_evicted_snapshots > 0 and pool.num_compactions > 0
    assert hits >= 40 if live_cap == 4 else sched.num_preemptions >= 10
    cache.flush()
    assert pool.usage() == start


def test_preempted_request_resumes_from_its_prefix():
    pool = make_pool(8)
    cache = PrefixCache(pool, snapshot_interval=0)
    sched = Scheduler(pool, 64, cache)
    a, b = make_request("a", [1, 2, 0] * 5, 30), make_request("b", [2, 1] * 9, 30)
    sched.add(a)
    sched.add(b)
    for _ in range(6):
        fake_step(sched)
    lost = b.num_computed_tokens
    sched._preempt(b, ScheduledBatch())  # as when the pool runs out
    sched.remove(a)
    batch = fake_step(sched)  # checks b holds exactly its prefix
    assert batch.requests == [b] and batch.cached_lens == [lost] and lost == 18 + 5
    assert sched.recomputed_tokens == 0
    while not b.finished:
        fake_step(sched)


def test_a_hit_that_cannot_copy_takes_the_snapshot():
    """A pool too full for a second state block: the hit takes the cached snapshot itself."""
    pool = make_pool(4)
    cache = PrefixCache(pool, snapshot_interval=0)
    sched = Scheduler(pool, 64, cache)
    first = make_request("first", [1, 0, 2] * 10, 1)
    sched.add(first)
    fake_step(sched)
    assert first.finished and cache.num_snapshots == 1  # 30 tokens: 8 pages and the state
    other = make_request("other", [2, 2, 1, 1], 100)
    sched.add(other)
    fake_step(sched)
    assert cache.num_snapshots == 2  # other's prompt end
    follow = make_request("follow", first.token_ids + [0, 1, 1], 3)
    sched.add(follow)
    batch = fake_step(sched)  # the copy needs 10 + 2 pages, 10 are available: take
    assert follow in batch.requests and batch.cached_lens[batch.requests.index(follow)] == 30
    # Taken, not copied; and other's snapshot was evicted for follow's pages.
    assert not cache.has_snapshot_at(first.token_ids[:30]) and cache.num_snapshots == 0
    while not follow.finished:
        fake_step(sched)
    assert cache.has_snapshot_at(follow.token_ids[:-1])


def insert_sequence(pool: MemoryPool, cache: PrefixCache, owner: str, tokens: list[int], move: bool = True) -> None:
    assert pool.alloc_state(owner) and pool.reserve(owner, len(tokens))
    assert cache.insert(tokens, owner, move_state=move)
    pool.free(owner)


def test_lru_eviction_order():
    pool = make_pool(20)
    cache = PrefixCache(pool, snapshot_interval=0)
    ppb = pool.pages_per_block
    a, b, c = [1] * 12, [2] * 12, [3] * 12
    for name, seq in zip("abc", (a, b, c)):
        insert_sequence(pool, cache, name, seq)
    hit = cache.match(a + [9], 13)
    assert hit is not None and hit.depth == 12
    cache.touch(hit.node)  # a was used after c: b is now the least recent
    free = pool.free_pages
    cache.evict(1)
    assert pool.free_pages == free + ppb + 3  # b's snapshot and its 3 pages
    assert cache.match(b + [9], 13) is None and cache.match(a + [9], 13) and cache.match(c + [9], 13)
    cache.evict(1)
    assert cache.match(c + [9], 13) is None and cache.match(a + [9], 13)
    # One path used at once (snapshots at 8 and 16): the shallower snapshot goes first, its node
    # stays for the deeper one; then the leaf goes with every page, and its snapshot-less parent.
    d = [4] * 16
    assert pool.alloc_state("d") and pool.reserve("d", 16)
    assert cache.insert(d[:8], "d") and cache.insert(d, "d", move_state=True)
    pool.free("d")
    cache.touch(cache.match(d + [9], 17).node)
    cache.touch(cache.match(a + [9], 13).node)
    free = pool.free_pages
    cache.evict(1)
    assert pool.free_pages == free + ppb
    assert cache.match(d[:8] + [9], 9) is None and cache.match(d + [9], 17).depth == 16
    cache.evict(1)
    assert pool.free_pages == free + 2 * ppb + 4 and cache.match(d + [9], 17) is None
    assert cache.match(a + [9], 13).depth == 12
    cache.evict(1)
    assert cache.num_snapshots == 0 and not cache.nodes() and pool.free_pages == pool.total_pages


def test_evictable_is_exact_while_a_hit_is_pinned():
    """The pinned path keeps pages the admitted request does not share (the parent's version of a
    boundary page): they must not count as evictable."""
    pool = make_pool(20)
    cache = PrefixCache(pool, snapshot_interval=0)
    seq = [5, 6, 7] * 7
    assert pool.alloc_state("x") and pool.reserve("x", 10)
    assert cache.insert(seq[:10], "x")  # edge [0, 10), its last page partial
    assert pool.alloc_state("y") and pool.reserve("y", 20)
    assert cache.insert(seq[:20], "y", move_state=True)  # edge [10, 20) with y's own boundary page
    pool.free("x")
    pool.free("y")
    insert_sequence(pool, cache, "z", [9] * 12)  # something else to evict
    hit = cache.match(seq + [1], 21)
    assert hit.depth == 20
    cache.pin(hit.node)
    evictable = cache.evictable_units()
    pool.share("r", hit.pages)  # as admission does: pin, check, share
    assert cache.evictable_units() == evictable
    parent_last = pool.page_table(hit.node.parent)[-1]
    assert parent_last not in hit.pages and pool.is_cache_only(parent_last)
    free = pool.free_pages
    assert pool.make_room(free + evictable)  # evicts everything it counted, and that is enough
    assert pool.free_pages == free + evictable and cache.evictable_units() == 0
    cache.unpin()
    assert cache.match(seq + [1], 21).depth == 20 and cache.match([9] * 13, 13) is None
    pool.free("r")
    cache.flush()
    assert pool.free_pages == pool.total_pages


def test_a_small_interval_never_shrinks_prefill_chunks(model):
    """Interval 8 under a budget of 20: chunks stay 20 tokens and each one, having gone 8 or more
    past the last snapshot, ends in one -- never a chunk cut to the interval."""
    engine = make_engine(model, budget=20)
    chunks: list[int] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        chunks.extend(batch.query_lens)
        return batch

    engine.scheduler.schedule = recording_schedule
    prompt = rand_tokens(random.Random(5), 70)
    run(engine, {"r": prompt}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert chunks == [20, 20, 20, 10, 1]
    depths = sorted(n.end for n in engine.prefix_cache.nodes() if n.snapshot)
    assert depths == [20, 40, 60, 70, 71]  # chunk ends, prompt end, finish


def test_default_interval_is_derived_from_the_model_and_logged(model, caplog):
    cfg = EngineConfig(page_size=PAGE, kv_cache_memory_bytes=16 * block_bytes())
    with caplog.at_level(logging.DEBUG, logger="tidal.engine"):
        engine = EngineCore(model, cfg)
    lay = engine.layout
    derived = prefix_snapshot_interval(lay.state_bytes, lay.page_bytes // PAGE, PAGE)
    assert derived * lay.page_bytes // PAGE >= lay.state_bytes > (derived - PAGE) * lay.page_bytes // PAGE
    assert engine.prefix_cache.snapshot_interval == engine.plan.prefix_snapshot_interval == derived
    assert f"snapshot after every {derived} prefill tokens (derived" in caplog.text
    override = EngineCore(model, EngineConfig(page_size=PAGE, kv_cache_memory_bytes=16 * block_bytes(),
                                              prefix_snapshot_interval=24))
    assert override.prefix_cache.snapshot_interval == 24
