"""One memory pool for both caches of a hybrid model: KDA state blocks and MLA KV pages.

The pool is one preallocated byte buffer cut into ``num_blocks`` equal blocks (the planner's
``PoolLayout``, so start-up capacity equals the planner's by construction). A block is

- FREE,
- a STATE block: one request's KDA state, conv [W-1, 3P] (model dtype) and recurrent [H, K, K]
  (float32) for every KDA layer, at fixed byte offsets inside the block, or
- a KV block: ``pages_per_block`` pages; a page holds ``page_size`` tokens x every MLA layer x
  (kv_lora_rank + rope) values in the model dtype.

There is no state:KV ratio. New pages go into the fullest partly-filled KV block first, so whole
blocks stay free for states; a KV block whose pages are all freed turns FREE again. When a state
needs a block and none is FREE but the KV blocks' free pages add up to a block, the emptiest KV
block is compacted away (its pages are copied into other KV blocks and the owners' page tables
remapped). With compaction the pool behaves as ``num_blocks * pages_per_block`` interchangeable
page units, a state costing a whole block of them: :meth:`MemoryPool.can_allocate` is therefore
exact, and a scheduler that checks it never sees an allocation fail.

Pages are reference-counted: a page may sit in several owners' tables (a request's and the prefix
cache's nodes, :mod:`tidal.cache.prefix`), and returns to the pool when the last holder lets go.
Owners that are :class:`CacheOwner` hold evictable memory: the pool's :attr:`MemoryPool.evictor`
frees it on demand, so every capacity question counts it as free (:attr:`available_pages`).

States and latents are read and written through typed views of the one byte buffer (float32 for
recurrent states, the model dtype for conv states and latents); every offset is a multiple of its
element size because the layout's block and page sizes are.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Hashable, Protocol

import torch

from tidal.config import ModelConfig
from tidal.model.layers import compute_dtype
from tidal.ops.mla import gather_pages
from tidal.plan import PoolLayout

FREE, STATE, KV = 0, 1, 2


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


class MemoryPool:
    """Block allocator over one buffer, keyed by an owner (a request id or a cache node)."""

    def __init__(
        self,
        config: ModelConfig,
        layout: PoolLayout,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        dcp_rank: int = 0,
    ) -> None:
        if not 0 <= dcp_rank < layout.dcp_size:
            raise ValueError(f"dcp_rank {dcp_rank} is not in 0..{layout.dcp_size - 1}")
        if dtype == torch.float64 or compute_dtype(dtype) != torch.float32:
            raise ValueError(f"the pool stores KDA states in float32 and latents in 16/32-bit dtypes, not {dtype}")
        self.config, self.layout, self.dtype = config, layout, dtype
        self.device = torch.device(device)
        # With DCP a page id stands for dcp_size x layout.page_size logical tokens, and this rank
        # stores the layout.page_size of them with position % dcp_size == dcp_rank: page_size (what
        # the scheduler and the prefix cache count) is logical, stored_page_size is rows per page.
        self.dcp_rank, self.dcp_size = dcp_rank, layout.dcp_size
        self.stored_page_size = layout.page_size
        self.page_size, self.pages_per_block = layout.page_size * layout.dcp_size, layout.pages_per_block
        self.num_blocks, self.block_bytes = layout.num_blocks, layout.block_bytes
        es = torch.empty(0, dtype=dtype).element_size()
        self._row_bytes = config.mla_cache_width * es
        page_bytes = config.num_mla_layers * self.stored_page_size * self._row_bytes
        if page_bytes != layout.page_bytes or self.pages_per_block * page_bytes > self.block_bytes:
            raise ValueError(
                f"layout page_bytes {layout.page_bytes} / block_bytes {self.block_bytes} do not match a "
                f"{dtype} KV page of {page_bytes} bytes; build the layout with kv_dtype_bytes={es}"
            )
        if self.block_bytes % 4:
            raise ValueError(f"block_bytes {self.block_bytes} is not a multiple of 4 (float32 states need it)")
        # empty, not zeros: on CPU the OS commits the memory only where it is written.
        self.buffer = torch.empty(self.num_blocks, self.block_bytes, dtype=torch.uint8, device=self.device)
        # Typed views of the same bytes: gathers and scatters of whole float rows run several times
        # faster than on bytes.
        typed, f32 = self.buffer.view(dtype), self.buffer.view(torch.float32)
        L, ppb, ps = config.num_mla_layers, self.pages_per_block, self.stored_page_size
        self._pages = typed[:, : ppb * page_bytes // es].unflatten(1, (ppb, L, ps, config.mla_cache_width))
        self._conv_shape = config.kda_conv_state_shape
        self._rec_shape = config.kda_recurrent_state_shape
        conv_bytes = self._conv_shape[0] * self._conv_shape[1] * es
        rec_bytes = self._rec_shape[0] * self._rec_shape[1] * self._rec_shape[2] * 4
        state_bytes = config.num_kda_layers * (conv_bytes + rec_bytes)
        if state_bytes > layout.state_bytes or state_bytes > self.block_bytes:
            raise ValueError(
                f"a {dtype} KDA state takes {state_bytes} bytes, the layout gives {layout.state_bytes}; "
                f"build the layout with conv_dtype_bytes={es}"
            )
        # State block: all recurrent states, then all conv states (offsets fixed per layer).
        self._rec_views, self._conv_views = [], []
        for i in range(config.num_kda_layers):
            r0 = i * rec_bytes
            c0 = config.num_kda_layers * rec_bytes + i * conv_bytes
            self._rec_views.append(f32[:, r0 // 4 : (r0 + rec_bytes) // 4].unflatten(1, self._rec_shape))
            self._conv_views.append(typed[:, c0 // es : (c0 + conv_bytes) // es].unflatten(1, self._conv_shape))
        self._state_bytes = state_bytes

        self._kind = [FREE] * self.num_blocks
        # Free blocks, ascending. Requests' states take the lowest, KV blocks and the prefix cache's
        # snapshots the highest: the running requests' states then sit side by side at the bottom,
        # and a decode step works on them in place through a few strided views (state_runs).
        self._free_blocks = list(range(self.num_blocks))
        self._slot_free: dict[int, list[int]] = {}  # KV block -> its free page slots
        self._by_used: list[set[int]] = [set() for _ in range(ppb + 1)]  # KV blocks by pages used
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
            self.buffer[block, : self._state_bytes].zero_()
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
        ppb = self.pages_per_block
        self._pages[new // ppb, new % ppb] = self._pages[page // ppb, page % ppb]
        table[index] = new
        self._hold(owner, new, index)
        self._release(owner, page, index)
        return True

    def copy_state(self, src: Hashable, dst: Hashable) -> None:
        """Copy ``src``'s KDA state (every layer) into ``dst``'s state block."""
        a, b = self._states[src], self._states[dst]
        self.buffer[b, : self._state_bytes] = self.buffer[a, : self._state_bytes]

    def move_state(self, src: Hashable, dst: Hashable) -> None:
        """Hand ``src``'s state block to ``dst``. A request's state handed to the prefix cache is
        copied up to the highest free block when there is one, keeping the bottom of the pool to
        the running requests' states (see ``_free_blocks``)."""
        if dst in self._states:
            raise ValueError(f"owner {dst!r} already has a state block")
        block = self._states.pop(src)
        if isinstance(dst, CacheOwner) and self._free_blocks and self._free_blocks[-1] > block:
            high = self._free_blocks.pop()
            self.buffer[high, : self._state_bytes] = self.buffer[block, : self._state_bytes]
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
        src_b = torch.tensor([p // ppb for p in moves], device=self.device)
        src_s = torch.tensor([p % ppb for p in moves], device=self.device)
        dst_b = torch.tensor([p // ppb for p in dests], device=self.device)
        dst_s = torch.tensor([p % ppb for p in dests], device=self.device)
        self._pages[dst_b, dst_s] = self._pages[src_b, src_s]
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

    def leak_page_for_test(self) -> None:
        """Test hook (tidal.engine.faults): take a page off the free books with no owner, as a
        bookkeeping bug would; the recount then fails."""
        self._take_page()

    # ---- byte access (used by PoolCacheView) ---------------------------------------------------
    def state_storage(self, kda_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one KDA layer's states in every block: conv [num_blocks, W-1, 3P] (model dtype),
        recurrent [num_blocks, H, K, V] (float32); rows of non-state blocks are meaningless."""
        return self._conv_views[kda_layer], self._rec_views[kda_layer]

    def read_states(self, kda_layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._conv_views[kda_layer][blocks], self._rec_views[kda_layer][blocks]

    def write_states(self, kda_layer: int, blocks: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor) -> None:
        self._conv_views[kda_layer][blocks] = conv.to(self.dtype)
        self._rec_views[kda_layer][blocks] = rec.to(torch.float32)

    def write_latents(
        self, mla_layer: int, blocks: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor
    ) -> None:
        self._pages[blocks, slots, mla_layer, pos] = rows.to(self.dtype)

    def read_latents(self, mla_layer: int, blocks: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
        return self._pages[blocks, slots, mla_layer].view(-1, self.config.mla_cache_width)[:length]

    def latent_pages(self, mla_layer: int) -> torch.Tensor:
        """One MLA layer's rows in every page: a strided view [num_blocks * pages_per_block, ps, C]
        indexed by global page id."""
        return self._pages.flatten(0, 1)[:, mla_layer]


class PoolCacheView:
    """The :class:`~tidal.model.context.SequenceCache` of one step over the pool: the states and
    pages of the step's owners, in batch order. The owners hold their state block and enough
    pages for ``cached_lens[b] + query_lens[b]`` tokens (the scheduler reserved them)."""

    def __init__(
        self, pool: MemoryPool, owners: list[Hashable], query_lens: list[int], cached_lens: list[int]
    ) -> None:
        self.pool = pool
        dev, ps, ppb = pool.device, pool.page_size, pool.pages_per_block
        n, r = pool.dcp_size, pool.dcp_rank  # this rank stores logical tokens t with t % n == r
        self.state_slots = [pool.state_block(o) for o in owners]
        wb, ws, wp, rows = [], [], [], []
        self._tables: list[list[int]] = []
        self._lengths: list[int] = []  # rows stored on this rank
        start = 0
        for owner, q, c in zip(owners, query_lens, cached_lens):
            table = pool.page_table(owner)
            total = c + q
            if len(table) * ps < total:
                raise ValueError(f"owner {owner!r} holds {len(table)} pages, too few for {total} tokens")
            for t in range(c + (r - c) % n, total, n):
                page = table[t // ps]
                wb.append(page // ppb)
                ws.append(page % ppb)
                wp.append(t % ps // n)
                rows.append(start + t - c)
            start += q
            self._tables.append(table[: pool.pages_for(total)])
            self._lengths.append(max(0, -(-(total - r) // n)))
        self._write = tuple(torch.tensor(x, dtype=torch.long, device=dev) for x in (wb, ws, wp))
        # which of the step's latents this rank stores (None: all of them)
        self._write_rows = torch.tensor(rows, dtype=torch.long, device=dev) if n > 1 else None
        self._reads: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def kda_storage(self, kda_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.state_storage(kda_layer)

    def mla_write(self, mla_layer: int, latents: torch.Tensor) -> None:
        if self._write_rows is not None:
            latents = latents.index_select(0, self._write_rows)
        self.pool.write_latents(mla_layer, *self._write, latents)

    def mla_read(self, mla_layer: int, seq: int) -> torch.Tensor:
        pages, _ = self._page_index((seq,))
        rows = self.pool.latent_pages(mla_layer).index_select(0, pages[0])
        return rows.flatten(0, 1)[: self._lengths[seq]]

    def mla_read_padded(self, mla_layer: int, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One gather of whole pages for all ``seqs``; rows past each length are zeroed."""
        pages, lengths = self._page_index(tuple(seqs))
        return gather_pages(self.pool.latent_pages(mla_layer), pages, lengths), lengths

    def mla_pages(self, mla_layer: int, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the layer's pages [P, ps, C], page ids [n, max pages], lengths [n]) of ``seqs``, for
        kernels that read the pages in place (``tidal.ops.mla.mla_paged_decode``)."""
        return (self.pool.latent_pages(mla_layer), *self._page_index(tuple(seqs)))

    def _page_index(self, seqs: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Page ids [n, max pages] of the sequences (short tables padded with their own first
        page) and lengths [n]; built once per step for each set of sequences."""
        if seqs not in self._reads:
            dev = self.pool.device
            width = max(len(self._tables[b]) for b in seqs)
            pages = [self._tables[b] + self._tables[b][:1] * (width - len(self._tables[b])) for b in seqs]
            self._reads[seqs] = (
                torch.tensor(pages, dtype=torch.long, device=dev),
                torch.tensor([self._lengths[b] for b in seqs], dtype=torch.long, device=dev),
            )
        return self._reads[seqs]
