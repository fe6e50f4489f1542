"""The pool's books: which block or page belongs to whom. No tensors live here.

The pool is ``num_blocks`` equal blocks (the planner's ``PoolLayout``, so start-up capacity equals
the planner's by construction). A block is

- FREE,
- a STATE block: one request's KDA state (every KDA layer's conv and recurrent state), or
- a KV block: ``pages_per_block`` pages; a page holds ``page_size`` tokens x every MLA layer.

There is no state:KV ratio. New pages go into the fullest partly-filled KV block first, so whole
blocks stay free for states; a KV block whose pages are all freed turns FREE again. When a state
needs a block and none is FREE but the KV blocks' free pages add up to a block, the emptiest KV
block is compacted away (its pages move into other KV blocks and the owners' page tables are
remapped). With compaction the pool behaves as ``num_blocks * pages_per_block`` interchangeable
page units, a state costing a whole block of them: :meth:`PoolAllocator.can_allocate` is therefore
exact, and a scheduler that checks it never sees an allocation fail.

Pages are reference-counted: a page may sit in several owners' tables (a request's and the prefix
cache's nodes, :mod:`tidal.cache.prefix`), and returns to the pool when the last holder lets go.
Owners that are :class:`CacheOwner` hold evictable memory: the allocator's :attr:`evictor` frees it
on demand, so every capacity question counts it as free (:attr:`available_pages`).

The bytes live elsewhere (:class:`tidal.cache.storage.PoolStorage`, in the worker that runs the
model). Every decision that moves bytes (a zeroed state, a state snapshot, a copy-on-write page,
a compaction) is recorded as a :data:`PoolCopy`, in order; the engine core sends them with the next
step's plan and the storage applies them, in that order, before it runs the model. The log is a
total order of every write to the storage: copies recorded after step k run after step k's model
writes and before step k+1's, which is when they happened in the books.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Hashable, Protocol, Union

from tidal.plan import PoolLayout

FREE, STATE, KV = 0, 1, 2


@dataclass(frozen=True)
class ZeroState:
    """Zero state block ``block`` (a new request's state starts from zeros)."""

    block: int


@dataclass(frozen=True)
class CopyState:
    """Copy the whole KDA state of block ``src`` into block ``dst``."""

    src: int
    dst: int


@dataclass(frozen=True)
class CopyPages:
    """Copy pages ``src[i]`` into pages ``dst[i]`` (global page ids; the two sets are disjoint)."""

    src: list[int]
    dst: list[int]


@dataclass(frozen=True)
class ReplayStates:
    """Speculative commit with the replay rollback (:mod:`tidal.spec.rollback`): fold chain
    positions ``0 .. counts[i]-1`` stored in the replay window blocks ``windows[i]`` into the state
    block ``slots[i]`` with the decode kernels."""

    slots: list[int]
    windows: list[list[int]]
    counts: list[int]


PoolCopy = Union[ZeroState, CopyState, CopyPages, ReplayStates]


@dataclass(frozen=True)
class PoolUsage:
    """A snapshot of the pool; ``free_pages`` counts page units (a state costs a whole block)."""

    num_blocks: int
    pages_per_block: int
    free_blocks: int
    state_blocks: int
    kv_blocks: int
    used_pages: int
    free_pages: int

    @property
    def total_pages(self) -> int:
        return self.num_blocks * self.pages_per_block

    @property
    def usage(self) -> float:
        """Fraction of the pool's page units in use (states count their whole block)."""
        return 1.0 - self.free_pages / max(1, self.total_pages)


class CacheOwner:
    """Base of owners whose memory belongs to the prefix cache: evictable, never a request's."""

    __slots__ = ()


class Evictor(Protocol):
    """What frees cache memory when requests need it (the prefix cache)."""

    def evictable_units(self) -> int:
        """Page units evicting everything possible now would free (exact)."""
        ...

    def evict(self, units: int) -> None:
        """Free at least ``units`` page units (the caller checked they are evictable)."""
        ...


class PoolAllocator:
    """Block allocator over the pool's layout, keyed by an owner (a request id or a cache node)."""

    def __init__(self, layout: PoolLayout) -> None:
        self.layout = layout
        # With DCP a page id stands for dcp_size x layout.page_size logical tokens (each rank's
        # storage keeps its share of them): page_size, what the scheduler and the prefix cache count,
        # is logical.
        self.page_size, self.pages_per_block = layout.page_size * layout.dcp_size, layout.pages_per_block
        self.num_blocks = layout.num_blocks
        self.copies: list[PoolCopy] = []  # recorded, not yet taken by take_copies()
        self._kind = [FREE] * self.num_blocks
        # Free blocks, ascending. Requests' states take the lowest, KV blocks and the prefix cache's
        # snapshots the highest: the running requests' states then sit side by side at the bottom,
        # and a decode step works on them in place through a few strided views (state_runs).
        self._free_blocks = list(range(self.num_blocks))
        self._slot_free: dict[int, list[int]] = {}  # KV block -> its free page slots
        self._by_used: list[set[int]] = [set() for _ in range(self.pages_per_block + 1)]  # KV blocks by pages used
        self._states: dict[Hashable, int] = {}
        self._tables: dict[Hashable, list[int]] = {}
        self._holders: dict[int, list[tuple[Hashable, int]]] = {}  # page id -> (owner, index in its table)
        self._used_pages = 0
        self.cache_only_pages = 0  # pages held by CacheOwners alone (evictable)
        self.evictor: Evictor | None = None
        self.num_compactions = 0
        self.pages_moved = 0

    # ---- capacity ------------------------------------------------------------------------------
    @property
    def total_pages(self) -> int:
        return self.num_blocks * self.pages_per_block

    @property
    def free_pages(self) -> int:
        """Free page units: every unheld block and every free page of a KV block."""
        return self.total_pages - self.pages_per_block * len(self._states) - self._used_pages

    @property
    def available_pages(self) -> int:
        """Free page units plus what the evictor (the prefix cache) can free on demand."""
        return self.free_pages + (self.evictor.evictable_units() if self.evictor is not None else 0)

    def usage(self) -> PoolUsage:
        kv = sum(1 for k in self._kind if k == KV)
        return PoolUsage(
            num_blocks=self.num_blocks,
            pages_per_block=self.pages_per_block,
            free_blocks=len(self._free_blocks),
            state_blocks=len(self._states),
            kv_blocks=kv,
            used_pages=self._used_pages,
            free_pages=self.free_pages,
        )

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_needed(self, owner: Hashable, num_tokens: int) -> int:
        """Pages ``owner`` must still get to hold ``num_tokens`` tokens."""
        return max(0, self.pages_for(num_tokens) - len(self._tables.get(owner, ())))

    def can_allocate(self, states: int, pages: int) -> bool:
        """Whether ``states`` new state blocks and ``pages`` new pages fit now, evicting cache memory
        if need be (exact, see module doc)."""
        return states * self.pages_per_block + pages <= self.available_pages

    def make_room(self, units: int) -> bool:
        """Evict cache memory until ``units`` page units are free; False (nothing evicted) when
        they are not available."""
        if units <= self.free_pages:
            return True
        if units > self.available_pages:
            return False
        assert self.evictor is not None
        self.evictor.evict(units - self.free_pages)
        if self.free_pages < units:
            raise RuntimeError(f"the evictor freed too little: {self.free_pages} free page units, {units} needed")
        return True

    def units_for(self, owner: Hashable, num_tokens: int) -> int:
        """Page units ``owner`` needs to hold ``num_tokens`` tokens, counting a missing state."""
        state = 0 if owner in self._states else self.pages_per_block
        return state + self.pages_needed(owner, num_tokens)

    # ---- owner tables --------------------------------------------------------------------------
    def has_state(self, owner: Hashable) -> bool:
        return owner in self._states

    def state_block(self, owner: Hashable) -> int:
        return self._states[owner]

    def page_table(self, owner: Hashable) -> list[int]:
        """Global page ids (block * pages_per_block + slot) of ``owner``, in token order."""
        return self._tables.get(owner, [])

    def refcount(self, page: int) -> int:
        """How many table entries hold ``page`` (0: free)."""
        return len(self._holders.get(page, ()))

    def is_cache_only(self, page: int) -> bool:
        holders = self._holders.get(page)
        return bool(holders) and all(isinstance(o, CacheOwner) for o, _ in holders)

    # ---- allocation ----------------------------------------------------------------------------
    def alloc_state(self, owner: Hashable, zero: bool = True) -> bool:
        """Give ``owner`` a state block (zeroed unless ``zero=False``: it is about to be copied
        over); False (nothing changed) when it does not fit even after evicting cache memory."""
        if owner in self._states:
            return True
        if not self.make_room(self.pages_per_block):
            return False
        if not self._free_blocks:
            self._compact()
        block = self._free_blocks.pop() if isinstance(owner, CacheOwner) else self._free_blocks.pop(0)
        self._kind[block] = STATE
        if zero:
            self._record(ZeroState(block))
        self._states[owner] = block
        return True

    def reserve(self, owner: Hashable, num_tokens: int) -> bool:
        """Grow ``owner``'s page table with fresh pages to hold ``num_tokens`` tokens; False
        (nothing changed) when the pages do not fit even after evicting cache memory."""
        need = self.pages_needed(owner, num_tokens)
        if need == 0:
            return True
        if not self.make_room(need):
            return False
        table = self._tables.setdefault(owner, [])
        for _ in range(need):
            page = self._take_page()
            self._hold(owner, page, len(table))
            table.append(page)
        return True

    def share(self, owner: Hashable, pages: list[int]) -> None:
        """Append pages other owners hold to ``owner``'s table (one more reference each)."""
        table = self._tables.setdefault(owner, [])
        for page in pages:
            if page not in self._holders:
                raise ValueError(f"page {page} is free, it cannot be shared")
            self._hold(owner, page, len(table))
            table.append(page)

    def set_table(self, owner: Hashable, pages: list[int]) -> None:
        """Replace ``owner``'s table by ``pages`` (held pages, e.g. a slice of its own table);
        pages no one holds any more are freed."""
        old = self._tables.pop(owner, [])
        new = list(pages)
        if new:
            self._tables[owner] = new
        for i, page in enumerate(new):
            if page not in self._holders:
                raise ValueError(f"page {page} is free, it cannot be shared")
            self._hold(owner, page, i)
        for i, page in enumerate(old):
            self._release(owner, page, i)

    def unshare_last_page(self, owner: Hashable) -> bool:
        """Copy-on-write: give ``owner`` a private copy of its last page when others hold it too
        (``owner`` is about to write into it). False when the page does not fit."""
        table = self._tables[owner]
        page, index = table[-1], len(table) - 1
        if self.refcount(page) == 1:
            return True
        if not self.make_room(1):
            return False
        new = self._take_page()
        self._record(CopyPages([page], [new]))
        table[index] = new
        self._hold(owner, new, index)
        self._release(owner, page, index)
        return True

    def copy_state(self, src: Hashable, dst: Hashable) -> None:
        """Copy ``src``'s KDA state (every layer) into ``dst``'s state block."""
        self._record(CopyState(self._states[src], self._states[dst]))

    def move_state(self, src: Hashable, dst: Hashable) -> None:
        """Hand ``src``'s state block to ``dst``. A request's state handed to the prefix cache is
        copied up to the highest free block when there is one, keeping the bottom of the pool to
        the running requests' states (see ``_free_blocks``)."""
        if dst in self._states:
            raise ValueError(f"owner {dst!r} already has a state block")
        block = self._states.pop(src)
        if isinstance(dst, CacheOwner) and self._free_blocks and self._free_blocks[-1] > block:
            high = self._free_blocks.pop()
            self._record(CopyState(block, high))
            self._kind[high], self._kind[block] = STATE, FREE
            bisect.insort(self._free_blocks, block)
            block = high
        self._states[dst] = block

    def swap_states(self, a: Hashable, b: Hashable) -> None:
        """Exchange the state blocks of two owners: bookkeeping only, no bytes move (a verified
        chain keeps the accepted position's state this way, ``tidal.spec.rollback``)."""
        self._states[a], self._states[b] = self._states[b], self._states[a]

    def truncate(self, owner: Hashable, num_tokens: int) -> None:
        """Let go of ``owner``'s pages past the first ``num_tokens`` tokens (rejected drafts)."""
        table = self._tables.get(owner)
        keep = self.pages_for(num_tokens)
        if table is None or len(table) <= keep:
            return
        for i in range(len(table) - 1, keep - 1, -1):
            self._release(owner, table.pop(), i)

    def replay_states(self, owners: list[Hashable], windows: list[list[Hashable]], counts: list[int]) -> None:
        """Record a :class:`ReplayStates` of ``owners``' state blocks from the blocks of the
        window owners (the storage replays; the books do not change)."""
        self._record(ReplayStates([self._states[o] for o in owners],
                                  [[self._states[w] for w in ws] for ws in windows], list(counts)))

    def free_state(self, owner: Hashable) -> None:
        """Release ``owner``'s state block only (its pages stay)."""
        block = self._states.pop(owner, None)
        if block is not None:
            self._kind[block] = FREE
            bisect.insort(self._free_blocks, block)

    def free(self, owner: Hashable) -> None:
        """Release ``owner``'s state block and its references to pages (unknown owners are a no-op)."""
        self.free_state(owner)
        for i, page in enumerate(self._tables.pop(owner, [])):
            self._release(owner, page, i)

    def _hold(self, owner: Hashable, page: int, index: int) -> None:
        holders = self._holders.setdefault(page, [])
        before = self.is_cache_only(page)
        holders.append((owner, index))
        self.cache_only_pages += self.is_cache_only(page) - before

    def _release(self, owner: Hashable, page: int, index: int) -> None:
        before = self.is_cache_only(page)
        holders = self._holders[page]
        holders.remove((owner, index))
        self.cache_only_pages += self.is_cache_only(page) - before
        if not holders:
            del self._holders[page]
            self._give_page(page)

    def _take_page(self) -> int:
        ppb = self.pages_per_block
        for used in range(ppb - 1, 0, -1):  # fullest partly-filled KV block first
            if self._by_used[used]:
                block = min(self._by_used[used])
                break
        else:
            block = self._free_blocks.pop()
            self._kind[block] = KV
            self._slot_free[block] = list(range(ppb - 1, -1, -1))
            used = 0
            self._by_used[0].add(block)
        self._by_used[used].discard(block)
        self._by_used[used + 1].add(block)
        self._used_pages += 1
        return block * ppb + self._slot_free[block].pop()

    def _give_page(self, page: int) -> None:
        block, slot = divmod(page, self.pages_per_block)
        free = self._slot_free[block]
        used = self.pages_per_block - len(free)
        free.append(slot)
        self._by_used[used].discard(block)
        self._used_pages -= 1
        if used == 1:
            del self._slot_free[block]
            self._kind[block] = FREE
            bisect.insort(self._free_blocks, block)
        else:
            self._by_used[used - 1].add(block)

    def _compact(self) -> None:
        """Empty the emptiest KV block into the others' free pages (caller checked there is room)."""
        ppb = self.pages_per_block
        source = next(min(s) for s in self._by_used[1:] if s)
        moves = [source * ppb + slot for slot in range(ppb) if slot not in self._slot_free[source]]
        self._by_used[ppb - len(self._slot_free[source])].discard(source)
        dests = []
        for _ in moves:
            dests.append(self._take_page())
        self._record(CopyPages(moves, dests))
        for old, new in zip(moves, dests):
            holders = self._holders.pop(old)
            self._holders[new] = holders
            for owner, index in holders:
                self._tables[owner][index] = new
        self._used_pages -= len(moves)
        del self._slot_free[source]
        self._kind[source] = FREE
        bisect.insort(self._free_blocks, source)
        self.num_compactions += 1
        self.pages_moved += len(moves)

    # ---- the copy log ----------------------------------------------------------------------------
    def _record(self, copy: PoolCopy) -> None:
        self.copies.append(copy)

    def take_copies(self) -> list[PoolCopy]:
        """The copies recorded since the last call, in order (the storage must apply them all)."""
        copies, self.copies = self.copies, []
        return copies

    def leak_page_for_test(self) -> None:
        """Test hook (tidal.engine.faults): take a page off the free books with no owner, as a
        bookkeeping bug would; the recount then fails."""
        self._take_page()
