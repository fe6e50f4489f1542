"""Recount a pool's books from its owners' tables: free + held == total, every page's holders are
exactly the table entries that name it, and the prefix cache's snapshots are state blocks it owns.
Run after a failed step; any finding means the pool can no longer be trusted."""

from __future__ import annotations

from tidal.cache.allocator import FREE, KV, STATE, PoolAllocator


def recount(pool: PoolAllocator, prefix_cache=None) -> list[str]:
    """What does not add up (empty: consistent)."""
    problems: list[str] = []
    ppb = pool.pages_per_block
    holders: dict[int, list[tuple[object, int]]] = {}
    for owner, table in pool._tables.items():
        for i, page in enumerate(table):
            holders.setdefault(page, []).append((owner, i))
    recorded = {p: sorted(map(repr, h)) for p, h in pool._holders.items()}
    counted = {p: sorted(map(repr, h)) for p, h in holders.items()}
    if recorded != counted:
        bad = sorted(set(recorded) ^ set(counted) | {p for p in recorded if counted.get(p) != recorded[p]})
        problems.append(f"page reference counts disagree with the owners' tables for {len(bad)} page(s), "
                        f"e.g. page {bad[0]}")
    free_slots = sum(len(s) for s in pool._slot_free.values())
    kv_blocks = [b for b, k in enumerate(pool._kind) if k == KV]
    if len(holders) + free_slots != len(kv_blocks) * ppb:
        problems.append(f"KV blocks hold {len(kv_blocks) * ppb} pages but {len(holders)} are held and "
                        f"{free_slots} free")
    if pool._used_pages != len(holders):
        problems.append(f"the pool counts {pool._used_pages} used pages, the tables hold {len(holders)}")
    states = sorted(pool._states.values())
    if len(set(states)) != len(states) or any(pool._kind[b] != STATE for b in states):
        problems.append("a state block is shared or not marked as a state block")
    if sum(1 for k in pool._kind if k == STATE) != len(states):
        problems.append("blocks marked as states do not match the owners' states")
    free = sorted(pool._free_blocks)
    if any(pool._kind[b] != FREE for b in free) or sum(1 for k in pool._kind if k == FREE) != len(free):
        problems.append("the free-block list disagrees with the blocks' kinds")
    held_units = ppb * len(states) + len(holders)
    if pool.free_pages + held_units != pool.total_pages:
        problems.append(f"free ({pool.free_pages}) + held ({held_units}) != total ({pool.total_pages}) page units")
    if prefix_cache is not None:
        snap = {n for n in prefix_cache.nodes() if n.snapshot}
        if any(not pool.has_state(n) for n in snap):
            problems.append("a prefix-cache snapshot has no state block")
    return problems
