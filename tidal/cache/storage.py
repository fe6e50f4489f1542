"""The pool's bytes: one preallocated buffer of ``num_blocks`` blocks, and the copies the allocator
asks for (:mod:`tidal.cache.allocator`). It lives in the worker that runs the model; which block
or page belongs to whom is the allocator's business, never this file's.

States and latents are read and written through typed views of the one byte buffer (float32 for
recurrent states, the model dtype for conv states and latents); every offset is a multiple of its
element size because the layout's block and page sizes are. A state block holds all recurrent
states, then all conv states, at fixed offsets per KDA layer; a KV block holds ``pages_per_block``
pages of [MLA layer, page_size, kv_lora_rank + rope].
"""

from __future__ import annotations

import torch

from tidal.cache.allocator import CopyPages, CopyState, PoolCopy, ReplayStates, ZeroState
from tidal.config import ModelConfig
from tidal.model.context import SimpleCache
from tidal.model.layers import compute_dtype
from tidal.ops.mla import gather_pages
from tidal.plan import PoolLayout


class PoolStorage:
    """The pool's tensors for one layout, dtype and device."""

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
        # stores the layout.page_size of them with position % dcp_size == dcp_rank: page_size (the
        # allocator's) is logical, stored_page_size is rows per page.
        self.dcp_rank, self.dcp_size = dcp_rank, layout.dcp_size
        self.stored_page_size = layout.page_size
        self.page_size, self.pages_per_block = layout.page_size * layout.dcp_size, layout.pages_per_block
        self.num_blocks, self.block_bytes = layout.num_blocks, layout.block_bytes
        es = torch.empty(0, dtype=dtype).element_size()
        page_bytes = config.num_mla_layers * self.stored_page_size * config.mla_cache_width * es
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
        conv_shape, rec_shape = config.kda_conv_state_shape, config.kda_recurrent_state_shape
        conv_bytes = conv_shape[0] * conv_shape[1] * es
        rec_bytes = rec_shape[0] * rec_shape[1] * rec_shape[2] * 4
        state_bytes = config.num_kda_layers * (conv_bytes + rec_bytes)
        if state_bytes > layout.state_bytes or state_bytes > self.block_bytes:
            raise ValueError(
                f"a {dtype} KDA state takes {state_bytes} bytes, the layout gives {layout.state_bytes}; "
                f"build the layout with conv_dtype_bytes={es}"
            )
        self._rec_views, self._conv_views = [], []
        for i in range(config.num_kda_layers):
            r0 = i * rec_bytes
            c0 = config.num_kda_layers * rec_bytes + i * conv_bytes
            self._rec_views.append(f32[:, r0 // 4 : (r0 + rec_bytes) // 4].unflatten(1, rec_shape))
            self._conv_views.append(typed[:, c0 // es : (c0 + conv_bytes) // es].unflatten(1, conv_shape))
        self._state_bytes = state_bytes

    # ---- the allocator's copies ----------------------------------------------------------------
    @property
    def kv_token_rows(self) -> int:
        """Latent rows this storage holds with every block as KV pages (with DCP: this rank's share)."""
        blocks, ppb, _, rows, _ = self._pages.shape
        return blocks * ppb * rows

    def apply(self, copies: list[PoolCopy]) -> None:
        """Apply the allocator's copies in the order it recorded them."""
        for c in copies:
            if isinstance(c, ZeroState):
                self.buffer[c.block, : self._state_bytes].zero_()
            elif isinstance(c, CopyState):
                self.buffer[c.dst, : self._state_bytes] = self.buffer[c.src, : self._state_bytes]
            elif isinstance(c, CopyPages):
                self._copy_pages(c.src, c.dst)
            elif isinstance(c, ReplayStates):
                from tidal.spec.rollback import replay_states  # the replay window's format lives there

                replay_states(self, self.config, c)
            else:
                raise TypeError(f"unknown pool copy {c!r}")

    def _copy_pages(self, src: list[int], dst: list[int]) -> None:
        ppb, dev = self.pages_per_block, self.device
        if len(src) == 1:
            self._pages[dst[0] // ppb, dst[0] % ppb] = self._pages[src[0] // ppb, src[0] % ppb]
            return
        s = torch.tensor(src, dtype=torch.long, device=dev)
        d = torch.tensor(dst, dtype=torch.long, device=dev)
        self._pages[d // ppb, d % ppb] = self._pages[s // ppb, s % ppb]

    # ---- byte access ---------------------------------------------------------------------------
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

    def snapshot(self, state_block: int, pages: list[int], length: int) -> SimpleCache:
        """A reference cache of one sequence holding a copy of what the pool keeps for it: the KDA
        states of ``state_block`` and the MLA latents of its first ``length`` tokens (``pages``, in
        token order) -- what a forward of further tokens on top needs (whole-name choice), without
        recomputing the sequence. ValueError with DCP, where this rank holds a share of the latents."""
        if self.dcp_size > 1:
            raise ValueError("a pool snapshot needs every latent: not with decode context parallelism")
        if len(pages) * self.page_size < length:
            raise ValueError(f"{len(pages)} pages hold fewer than {length} tokens")
        cache = SimpleCache(self.config, 1, self.dtype, self.device)
        for i in range(self.config.num_kda_layers):
            cache.set_kda_state(i, self._conv_views[i][state_block : state_block + 1].clone(),
                                self._rec_views[i][state_block : state_block + 1].clone())
        ids = torch.tensor(pages[: -(-length // self.page_size)], dtype=torch.long, device=self.device)
        blocks, slots = ids // self.pages_per_block, ids % self.pages_per_block
        for layer in range(self.config.num_mla_layers):
            cache.set_mla(layer, 0, self.read_latents(layer, blocks, slots, length))  # a gather: a copy
        return cache

    def latent_pages(self, mla_layer: int) -> torch.Tensor:
        """One MLA layer's rows in every page: a strided view [num_blocks * pages_per_block, ps, C]
        indexed by global page id."""
        return self._pages.flatten(0, 1)[:, mla_layer]


class PoolCacheView:
    """The :class:`~tidal.model.context.SequenceCache` of one step over the pool storage: for each
    sequence in batch order its state block and the pages holding its ``cached_lens[b] +
    query_lens[b]`` tokens (what a step plan carries)."""

    def __init__(
        self, storage: PoolStorage, state_slots: list[int], page_tables: list[list[int]],
        query_lens: list[int], cached_lens: list[int],
    ) -> None:
        self.storage = storage
        dev, ps, ppb = storage.device, storage.page_size, storage.pages_per_block
        n, r = storage.dcp_size, storage.dcp_rank  # this rank stores logical tokens t with t % n == r
        self.state_slots = list(state_slots)
        wb, ws, wp, rows = [], [], [], []
        self._tables: list[list[int]] = []
        self._lengths: list[int] = []  # rows stored on this rank
        start = 0
        for b, (table, q, c) in enumerate(zip(page_tables, query_lens, cached_lens)):
            total = c + q
            if len(table) * ps < total:
                raise ValueError(f"sequence {b} holds {len(table)} pages, too few for {total} tokens")
            for t in range(c + (r - c) % n, total, n):
                page = table[t // ps]
                wb.append(page // ppb)
                ws.append(page % ppb)
                wp.append(t % ps // n)
                rows.append(start + t - c)
            start += q
            self._tables.append(table[: -(-total // ps)])
            self._lengths.append(max(0, -(-(total - r) // n)))
        self._write = tuple(torch.tensor(x, dtype=torch.long, device=dev) for x in (wb, ws, wp))
        # which of the step's latents this rank stores (None: all of them)
        self._write_rows = torch.tensor(rows, dtype=torch.long, device=dev) if n > 1 else None
        self._reads: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._write_targets: tuple[torch.Tensor, torch.Tensor] | None = None  # mla_write_rows, once per step

    def kda_storage(self, kda_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.storage.state_storage(kda_layer)

    def mla_write(self, mla_layer: int, latents: torch.Tensor) -> None:
        if self._write_rows is not None:
            latents = latents.index_select(0, self._write_rows)
        self.storage.write_latents(mla_layer, *self._write, latents)

    def mla_write_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(global page id [T], row in the page [T]) of each of the step's latents, in token order, for
        kernels that write them in place (``tidal.ops.fused_decode.mla_layer_step``); None where this
        rank stores only some of them (decode context parallelism)."""
        if self._write_rows is not None:
            return None
        if self._write_targets is None:
            blocks, slots, pos = self._write
            self._write_targets = ((blocks * self.storage.pages_per_block + slots).contiguous(), pos.contiguous())
        return self._write_targets

    def mla_read(self, mla_layer: int, seq: int) -> torch.Tensor:
        pages, _ = self._page_index((seq,))
        rows = self.storage.latent_pages(mla_layer).index_select(0, pages[0])
        return rows.flatten(0, 1)[: self._lengths[seq]]

    def mla_read_padded(self, mla_layer: int, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One gather of whole pages for all ``seqs``; rows past each length are zeroed."""
        pages, lengths = self._page_index(tuple(seqs))
        return gather_pages(self.storage.latent_pages(mla_layer), pages, lengths), lengths

    def mla_pages(self, mla_layer: int, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the layer's pages [P, ps, C], page ids [n, max pages], lengths [n]) of ``seqs``, for
        kernels that read the pages in place (``tidal.ops.mla.mla_paged_decode``)."""
        return (self.storage.latent_pages(mla_layer), *self._page_index(tuple(seqs)))

    def _page_index(self, seqs: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Page ids [n, max pages] of the sequences (short tables padded with their own first
        page) and lengths [n]; built once per step for each set of sequences."""
        if seqs not in self._reads:
            dev = self.storage.device
            width = max(len(self._tables[b]) for b in seqs)
            pages = [self._tables[b] + self._tables[b][:1] * (width - len(self._tables[b])) for b in seqs]
            self._reads[seqs] = (
                torch.tensor(pages, dtype=torch.long, device=dev),
                torch.tensor([self._lengths[b] for b in seqs], dtype=torch.long, device=dev),
            )
        return self._reads[seqs]
