"""CUDA graphs of the decode step, one per batch-size bucket (SGLang's ``cuda_graph_runner``).

A decode step of B sequences runs as the graph of the smallest bucket >= B. Everything the step
reads that changes between steps lives in static buffers the graph was captured with: token ids,
KDA state slots, varlen offsets, the MLA page table and lengths, and the latent write targets.
Padded rows (B .. bucket-1) are inert: slot -1 (the conv kernel skips it), a repeated varlen offset
(fla's recurrent kernel sees no token), length 0 (the MLA kernel reads no page) and a latent write
that repeats row 0's (same target, same value). Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import torch

from tidal.cache.storage import PoolStorage
from tidal.model.context import ForwardBatch
from tidal.model.kimi import KimiForCausalLM

DEFAULT_MAX_BS = 128


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 32, every 16 up to 128, every 32 beyond, and max_bs itself."""
    sizes = [1, 2, 4] + list(range(8, 33, 8)) + list(range(48, 129, 16)) + list(range(160, max_bs + 1, 32))
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


class GraphCacheView:
    """The SequenceCache of a captured decode step: the pool's storage, indexed by static buffers."""

    def __init__(self, storage: PoolStorage, size: int, max_pages: int) -> None:
        dev = storage.device
        self.storage = storage
        self.size = size
        self.state_slots = [-1] * size  # the device kernels read slots from ``slots``
        self.slots = torch.full((size,), -1, dtype=torch.int32, device=dev)
        self.cu = torch.zeros(size + 1, dtype=torch.long, device=dev)
        self.table = torch.zeros(size, max_pages, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(size, dtype=torch.long, device=dev)
        self.write = torch.zeros(3, size, dtype=torch.long, device=dev)  # block, slot in block, row in page
        self.write_src = torch.zeros(size, dtype=torch.long, device=dev)

    def kda_storage(self, kda_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.storage.state_storage(kda_layer)

    def mla_write(self, mla_layer: int, latents: torch.Tensor) -> None:
        self.storage.write_latents(mla_layer, *self.write, latents.index_select(0, self.write_src))

    def mla_pages(self, mla_layer: int, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.storage.latent_pages(mla_layer), self.table, self.lengths

    def fill(self, page_tables: list[list[int]], state_slots: list[int], cached_lens: list[int]) -> None:
        """Point the buffers at this step's B <= size sequences (one host-to-device copy each):
        their pages for cached_len + 1 tokens and state slots, as a step plan has them."""
        B, n = len(page_tables), self.size
        ps, ppb, width = self.storage.page_size, self.storage.pages_per_block, self.table.shape[1]
        table = torch.zeros(n, width, dtype=torch.long)
        lengths = torch.zeros(n, dtype=torch.long)
        write = torch.zeros(3, n, dtype=torch.long)
        for b, (pages, c) in enumerate(zip(page_tables, cached_lens)):
            pages = pages[: c // ps + 1]
            if len(pages) > width:
                raise ValueError(f"sequence {b} holds {len(pages)} pages, the graphs were captured for {width}")
            table[b, : len(pages)] = torch.tensor(pages)
            lengths[b] = c + 1
            page = pages[c // ps]
            write[:, b] = torch.tensor([page // ppb, page % ppb, c % ps])
        write[:, B:] = write[:, :1]
        slots = torch.full((n,), -1, dtype=torch.int32)
        slots[:B] = torch.tensor(state_slots, dtype=torch.int32)
        cu = torch.arange(n + 1).clamp_(max=B)
        src = torch.arange(n).masked_fill_(torch.arange(n) >= B, 0)
        for dst, value in ((self.table, table), (self.lengths, lengths), (self.write, write), (self.slots, slots),
                           (self.cu, cu), (self.write_src, src)):
            dst.copy_(value, non_blocking=True)


class DecodeGraphs:
    """Decode graphs of one model and pool storage for every bucket, captured by :meth:`capture_all`
    while the pool is still empty (the warm-up runs write one latent row into block 0)."""

    def __init__(self, model: KimiForCausalLM, storage: PoolStorage, max_bs: int, max_context: int) -> None:
        self.model, self.storage = model, storage
        self.buckets = batch_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.max_pages = -(-max_context // storage.page_size)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, GraphCacheView, torch.Tensor, torch.Tensor]] = {}
        self._mempool = torch.cuda.graph_pool_handle()

    def bucket(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def run(self, page_tables: list[list[int]], state_slots: list[int], token_ids: list[int],
            cached_lens: list[int]) -> torch.Tensor:
        """The decode step of B sequences (one new token each, in ``token_ids``) -> hidden [B, d]."""
        size = self.bucket(len(token_ids))
        assert size is not None and size in self._graphs, "run() is for batches of at most max_bs sequences"
        graph, view, ids, hidden = self._graphs[size]
        view.fill(page_tables, state_slots, cached_lens)
        ids.copy_(torch.tensor(token_ids + [0] * (size - len(token_ids))), non_blocking=True)
        graph.replay()
        return hidden[: len(token_ids)]

    def capture_all(self) -> None:
        for size in sorted(self.buckets, reverse=True):  # the largest first: later ones reuse its memory
            self._graphs[size] = self._capture(size)
        torch.cuda.synchronize(self.storage.device)

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, GraphCacheView, torch.Tensor, torch.Tensor]:
        dev = self.storage.device
        view = GraphCacheView(self.storage, size, self.max_pages)  # all rows padded: the warm-up touches nothing
        view.cu.zero_()
        ids = torch.zeros(size, dtype=torch.long, device=dev)
        batch = ForwardBatch(query_lens=[1] * size, cached_lens=[1] * size, cache=view)  # type: ignore[arg-type]
        batch.set_device_index("tokens", dev, torch.arange(size, device=dev))
        batch.set_device_index("slots", dev, view.slots)
        batch.set_device_index("cu", dev, view.cu)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # compiles the Triton kernels outside the capture
                self.model(ids, batch)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._mempool, stream=stream):
            hidden = self.model(ids, batch)
        return graph, view, ids, hidden
