"""One memory pool for both caches of a hybrid model: KDA state blocks and MLA KV pages.

The engine splits it in two: the books (:class:`~tidal.cache.allocator.PoolAllocator`, in the
engine core) and the bytes (:class:`~tidal.cache.storage.PoolStorage`, in the worker), joined by
the copy log that travels in each step plan. ``MemoryPool`` is both in one object, applying every
copy the moment the books record it: for tools and tests that allocate and read bytes directly.
"""

from __future__ import annotations

from typing import Hashable

import torch

from tidal.cache.allocator import (  # noqa: F401 - the pool's public names
    FREE,
    KV,
    STATE,
    CacheOwner,
    Evictor,
    PoolAllocator,
    PoolCopy,
    PoolUsage,
)
from tidal.cache.storage import PoolCacheView, PoolStorage
from tidal.config import ModelConfig
from tidal.plan import PoolLayout


class MemoryPool(PoolAllocator):
    """An allocator with its storage attached: copies are applied as they are recorded."""

    def __init__(
        self,
        config: ModelConfig,
        layout: PoolLayout,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        dcp_rank: int = 0,
    ) -> None:
        super().__init__(layout)
        self.storage = PoolStorage(config, layout, dtype, device, dcp_rank=dcp_rank)

    def __getattr__(self, name: str):
        """The storage's attributes (buffer, config, dtype, device, read/write methods)."""
        if name == "storage":
            raise AttributeError(name)
        return getattr(self.storage, name)

    def _record(self, copy: PoolCopy) -> None:
        self.storage.apply([copy])

    def cache_view(self, owners: list[Hashable], query_lens: list[int], cached_lens: list[int]) -> PoolCacheView:
        """The step cache of ``owners`` (each holds its state block and the step's pages)."""
        return PoolCacheView(self.storage, [self.state_block(o) for o in owners],
                             [self.page_table(o) for o in owners], query_lens, cached_lens)
