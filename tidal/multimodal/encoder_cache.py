"""The vision tower's outputs, by image hash: an image the engine has seen is never encoded twice
while its embeddings fit (LRU within a byte budget). A chunk of a prefill slices its image's rows
from here, so an image split across chunks, preempted or resumed from a prefix hit is encoded
once and its rows are the same whichever chunk reads them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

DEFAULT_ENCODER_CACHE_BYTES = 256 << 20


class EncoderCache:
    def __init__(self, capacity_bytes: int = DEFAULT_ENCODER_CACHE_BYTES) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"encoder cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get_or_compute(self, key: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The cached embeddings of ``key``, or ``compute()``'s, kept when they fit the budget
        (older entries are evicted first; one larger than the budget is used once and dropped)."""
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return hit
        self.misses += 1
        value = compute()
        size = value.numel() * value.element_size()
        if size <= self.capacity_bytes:
            while self.bytes + size > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()
            self._entries[key] = value
            self.bytes += size
        return value

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
