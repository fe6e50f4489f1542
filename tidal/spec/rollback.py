"""Pool memory of verified chains and the two exact rollbacks of the KDA state.

A chain of m positions needs, beyond a plain decode, pages for its m-1 drafted tokens and:

- "swap": m-1 state blocks, one per drafted position (position 0 updates the request's own
  block). Commit keeps the accepted position's block by exchanging it with the request's
  (``PoolAllocator.swap_states``: books only, no copy), then frees the others.
- "replay": a replay window, ceil(m / positions per block) blocks holding each position's KDA
  kernel inputs (pre-conv q|k|v, then q, k, v, g, beta) for every KDA layer in float32. The
  request's block is the checkpoint; commit records a ``ReplayStates`` copy (the worker's
  storage replays the accepted positions into it with the same decode kernel, the conv window
  shifting in the stored rows, before the next step's model runs), then frees the window.

Either way the memory is taken from free or evictable pool units (the prefix cache's LRU, as any
allocation; never by preempting a request) and is held for one step: after the commit the request holds one state block
and pages for its committed tokens, as a plain decode would. MLA latents of rejected positions
sit past the committed length: the pages holding only them are freed, the rest are overwritten
by the next step.
"""

from __future__ import annotations

from typing import Hashable

import torch

from tidal.cache.allocator import PoolAllocator, ReplayStates
from tidal.cache.storage import PoolStorage
from tidal.config import ModelConfig
from tidal.ops.kda import kda_decode_step_

SWAP, REPLAY = "swap", "replay"


def _fields(config: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """name -> (float32 offset in a layer's record, shape) of one position's stored inputs."""
    H, K = config.kda_num_heads, config.kda_head_dim
    shapes = {"qkv": (3 * H * K,), "q": (H, K), "k": (H, K), "v": (H, K), "g": (H, K), "beta": (H,)}
    out, off = {}, 0
    for name, shape in shapes.items():
        out[name] = (off, shape)
        off += int(torch.Size(shape).numel())
    return out


def replay_record_floats(config: ModelConfig) -> int:
    """float32 values one chain position stores for all KDA layers."""
    f = _fields(config)
    last = f["beta"]
    return config.num_kda_layers * (last[0] + last[1][0])


def extra_blocks(config: ModelConfig, block_bytes: int, method: str, chain_len: int) -> int:
    """State-sized blocks a chain of ``chain_len`` positions takes beyond a plain decode (the
    planner shows this; the engine allocates exactly it)."""
    if chain_len <= 1:
        return 0
    if method == SWAP:
        return chain_len - 1
    per_block = block_bytes // (4 * replay_record_floats(config))
    if per_block < 1:
        raise ValueError(f"one chain position's replay record ({4 * replay_record_floats(config)} B) exceeds a "
                         f"pool block ({block_bytes} B)")
    return -(-chain_len // per_block)


class ReplayWindow:
    """Float32 records in pool blocks: chain position j of batch position b lives in block
    ``blocks[b][j // per_block]`` at record ``j % per_block`` (views of the worker's storage)."""

    def __init__(self, pool: PoolStorage, config: ModelConfig) -> None:
        self.pool, self.config = pool, config
        self.fields = _fields(config)
        rec = replay_record_floats(config)
        self.per_layer = rec // config.num_kda_layers
        self.per_block = pool.block_bytes // (4 * rec)
        f32 = pool.buffer.view(torch.float32)
        self.view = f32[:, : self.per_block * rec].unflatten(1, (self.per_block, config.num_kda_layers, self.per_layer))
        self.blocks: dict[int, list[int]] = {}

    def _index(self, seqs: list[int], j: int) -> tuple[torch.Tensor, int]:
        blocks = torch.tensor([self.blocks[b][j // self.per_block] for b in seqs], dtype=torch.long,
                              device=self.pool.device)
        return blocks, j % self.per_block

    def store(self, layer: int, seqs: list[int], j: int, values: dict[str, torch.Tensor]) -> None:
        blocks, r = self._index(seqs, j)
        for name, t in values.items():
            off, shape = self.fields[name]
            size = int(torch.Size(shape).numel())
            self.view[blocks, r, layer, off : off + size] = t.reshape(len(seqs), size).to(torch.float32)

    def load(self, layer: int, seqs: list[int], j: int) -> dict[str, torch.Tensor]:
        blocks, r = self._index(seqs, j)
        rows = self.view[blocks, r, layer]
        return {name: rows[:, off : off + int(torch.Size(shape).numel())].reshape(len(seqs), *shape)
                for name, (off, shape) in self.fields.items()}


class ChainMemory:
    """Allocates, lays out, commits and frees the extra memory of one step's chains."""

    def __init__(self, pool: PoolAllocator, config: ModelConfig, method: str) -> None:
        if method not in (SWAP, REPLAY):
            raise ValueError(f"rollback method must be {SWAP!r} or {REPLAY!r}, got {method!r}")
        self.pool, self.config, self.method = pool, config, method
        self._owners: dict[str, list[Hashable]] = {}  # request id -> its extra state owners

    def extra_blocks(self, chain_len: int) -> int:
        return extra_blocks(self.config, self.pool.layout.block_bytes, self.method, chain_len)

    def acquire(self, rid: str, cached: int, chain_len: int) -> bool:
        """Pages for the chain and its extra blocks, from free units or evictable cache memory;
        False (nothing taken) when they are not available now."""
        pool = self.pool
        blocks = self.extra_blocks(chain_len)
        need = pool.pages_needed(rid, cached + chain_len) + blocks * pool.pages_per_block
        if not pool.make_room(need):
            return False
        owners: list[Hashable] = [(rid, "spec", i) for i in range(blocks)]
        ok = pool.reserve(rid, cached + chain_len)
        for o in owners:
            ok = ok and pool.alloc_state(o, zero=False)
        if not ok:  # cannot happen: the room is made
            raise RuntimeError(f"chain memory of {rid!r}: {need} free page units did not fit")
        self._owners[rid] = owners
        return True

    def slots(self, rid: str) -> list[int]:
        """What a step plan carries for ``rid``'s chain: the state slot of each chain position
        ("swap": its own block, then the extra blocks) or its replay window blocks ("replay")."""
        pool = self.pool
        extra = [pool.state_block(o) for o in self._owners[rid]]
        return [pool.state_block(rid), *extra] if self.method == SWAP else extra

    def commit(self, kept: dict[str, int]) -> None:
        """Leave each chain's request (by id) with the state after chain position ``kept[rid]``;
        then free the chains' extra blocks. Books only: the replay is a recorded copy."""
        pool = self.pool
        if self.method == SWAP:
            for rid, j in kept.items():
                if j > 0:
                    pool.swap_states(rid, self._owners[rid][j - 1])
        elif kept:
            rids = list(kept)
            pool.replay_states(rids, [self._owners[r] for r in rids], [kept[r] + 1 for r in rids])
        for rid in kept:
            self.release(rid)

    def release(self, rid: str) -> None:
        """Free a request's extra blocks (after its commit, or when its step failed)."""
        for o in self._owners.pop(rid, []):
            self.pool.free_state(o)

    def release_all(self) -> None:
        for rid in list(self._owners):
            self.release(rid)


def replay_states(storage: PoolStorage, config: ModelConfig, copy: ReplayStates) -> None:
    """Apply a :class:`ReplayStates` copy: chain positions ``0 .. counts[i]-1`` of window
    ``windows[i]`` stepped into state block ``slots[i]``, all chains batched per position."""
    window = ReplayWindow(storage, config)
    window.blocks = dict(enumerate(copy.windows))
    dev = storage.device
    for layer in range(config.num_kda_layers):
        conv, rec = storage.state_storage(layer)
        for j in range(max(copy.counts, default=0)):
            seqs = [i for i, n in enumerate(copy.counts) if n > j]
            x = window.load(layer, seqs, j)
            slots = torch.tensor([copy.slots[i] for i in seqs], dtype=torch.long, device=dev)
            # causal_conv_step's new window: the old one shifted by the new pre-conv row.
            old = conv[slots]
            conv[slots] = torch.cat([old[:, 1:], x["qkv"].to(old.dtype).unsqueeze(1)], dim=1)
            state = rec[slots]
            kda_decode_step_(x["q"], x["k"], x["v"], x["g"], x["beta"], state)
            rec[slots] = state
