"""Prefix cache for a hybrid model: a radix tree over token ids whose nodes hold MLA KV pages and,
at chosen depths, snapshots of the KDA state -- all inside the one :class:`PoolAllocator`.

Why snapshots: MLA layers cache every token, so any prefix of a cached sequence is reusable, but
KDA layers keep only a running state. A hit can therefore resume only at a depth where the state
was saved (``serving-engines.md`` §1.2). The engine saves it at the end of every prompt's prefill,
after every ``snapshot_interval`` or more tokens of a prefill (at a chunk's end), and when a
request finishes or is preempted (its own state block is handed to the tree, no copy).

Layout. A node is an edge of the tree: ``tokens`` covering depths ``[start, end)``. It is a pool
owner (:class:`CacheOwner`): its page table holds the pages of the tokens it covers -- page
``start // page_size`` up to ``(end - 1) // page_size`` -- so an edge that starts mid-page holds
its own version of that boundary page (the rows before ``start`` are the same tokens' KV as in the
parent's last page). A node may own a state block: the KDA state after its last token.

Sharing. Pages are reference-counted by the pool. A hit hands the request the path's pages up to
the deepest node with a snapshot and a copy of that snapshot (or the snapshot itself, taken out of
the tree, when the pool has no room for a second block). When the depth is not page-aligned the
last page is copied (copy-on-write): the request writes its next tokens into it. Nobody writes a
page row another holder relies on: writes only append after a sequence's end, the request that
inserted a partial page appends to it only past the rows the node covers, and a hit copies it.

Eviction (LRU, never a request's memory). Nodes are not locked by running requests: a request
holds its own references to every page it uses and its own copy of the state, so evicting a node
never takes memory a request needs. The candidates are the snapshots, least recently used first
(among nodes used together -- one path -- the shallower first: the deepest is what the next turn of
that conversation hits). Dropping the snapshot of an inner node keeps the node (its pages carry
the deeper ones); a leaf that loses its snapshot is removed with its pages, and so is every
ancestor left as a leaf without a snapshot: every leaf has a snapshot. Evicting everything
frees exactly ``evictable_units()``, which the pool counts as free. The only lock is the pin an
admission holds on its hit for the few lines between checking room and copying the snapshot.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass

from tidal.cache.allocator import CacheOwner, PoolAllocator


class Node(CacheOwner):
    """One edge of the radix tree; a pool owner (hashed by identity)."""

    __slots__ = ("alive", "children", "last_access", "parent", "pinned", "snapshot", "start", "tokens")

    def __init__(self, parent: Node | None, tokens: list[int], start: int) -> None:
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.tokens = tokens
        self.start = start
        self.snapshot = False
        self.last_access = 0
        self.pinned = False
        self.alive = True

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def __repr__(self) -> str:
        return f"Node([{self.start}, {self.end}), snapshot={self.snapshot})"


@dataclass
class PrefixHit:
    """A usable prefix: ``depth`` tokens, the KV ``pages`` covering them (the last one partial
    when ``depth`` is not page-aligned) and the ``node`` whose snapshot is the state there."""

    node: Node
    depth: int
    pages: list[int]


def common_len(edge: list[int], tokens: list[int], pos: int, limit: int) -> int:
    """Length of the common prefix of ``edge`` and ``tokens[pos:limit]`` (list slices compare in C)."""
    n = min(len(edge), limit - pos)
    if edge[:n] == tokens[pos : pos + n]:
        return n
    lo, step = 0, 64
    while lo + step <= n and edge[lo : lo + step] == tokens[pos + lo : pos + lo + step]:
        lo += step
    while lo < n and edge[lo] == tokens[pos + lo]:
        lo += 1
    return lo


class PrefixCache:
    """The radix tree over one pool; it is the pool's evictor."""

    def __init__(self, pool: PoolAllocator, snapshot_interval: int) -> None:
        if snapshot_interval < 0:
            raise ValueError(f"snapshot_interval must be >= 0 (0: only at prompt and request ends), "
                             f"got {snapshot_interval}")
        if pool.evictor is not None:
            raise ValueError("the pool already has an evictor")
        self.pool = pool
        self.snapshot_interval = snapshot_interval
        self.root = Node(None, [], 0)
        self._clock = itertools.count(1)
        self._snapshots: set[Node] = set()
        self._heap: list[tuple[int, int, int, Node]] = []  # (last_access, end, seq, node), lazily pruned
        self._seq = itertools.count()
        self._pinned: Node | None = None
        self._pinned_pages: set[int] = set()  # pages of the pinned node's path
        self.num_evicted_snapshots = 0
        pool.evictor = self

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def nodes(self) -> list[Node]:
        """Every node but the root, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def match(self, tokens: list[int], limit: int) -> PrefixHit | None:
        """The deepest snapshot on ``tokens[:limit]``'s path, with the pages up to it; None when
        no snapshot lies on it. Does not count as a use (see :meth:`touch`)."""
        node, pos, best = self.root, 0, None
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None or child.end > limit or common_len(child.tokens, tokens, pos, limit) < len(child.tokens):
                break
            node, pos = child, child.end
            if node.snapshot:
                best = node
        if best is None:
            return None
        return PrefixHit(best, best.end, self.path_pages(best))

    def path_pages(self, node: Node) -> list[int]:
        """Pages of the tokens ``[0, node.end)``: each edge's table, an edge starting mid-page
        replacing its parent's last page by its own version of it."""
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        pages: list[int] = []
        for n in reversed(path):
            table = self.pool.page_table(n)
            if n.start % self.pool.page_size:
                pages[-1:] = table
            else:
                pages.extend(table)
        return pages

    def has_snapshot_at(self, tokens: list[int]) -> bool:
        node, pos, k = self.root, 0, len(tokens)
        while pos < k:
            child = node.children.get(tokens[pos])
            if child is None or child.end > k or common_len(child.tokens, tokens, pos, k) < len(child.tokens):
                return False
            node, pos = child, child.end
        return node.snapshot

    # ---- updates -------------------------------------------------------------------------------
    def touch(self, node: Node) -> None:
        """Mark ``node``'s path as used now (LRU)."""
        now = next(self._clock)
        while node is not self.root:
            node.last_access = now
            if node.snapshot:
                self._push(node)
            node = node.parent

    def insert(self, tokens: list[int], owner: Hashable, *, move_state: bool = False) -> bool:
        """Cache ``tokens`` with a snapshot at their end, from ``owner`` (a request whose page table
        holds their KV and whose state is the state after them). ``move_state`` hands the owner's
        state block to the tree (the owner is finishing); otherwise a block is allocated, evicting
        older cache memory if need be, and the state copied. False when no block was available
        (nothing inserted)."""
        k = len(tokens)
        if k == 0:
            return False
        pool = self.pool
        if len(pool.page_table(owner)) < pool.pages_for(k):
            raise ValueError(f"owner {owner!r} holds too few pages for {k} tokens")
        if not move_state:
            if self.has_snapshot_at(tokens):
                return True
            if not pool.make_room(pool.pages_per_block):
                return False
        node = self._insert_path(tokens, owner)
        if not node.snapshot:
            if move_state:
                pool.move_state(owner, node)
            else:
                ok = pool.alloc_state(node, zero=False)  # room was made: no eviction here
                assert ok
                pool.copy_state(owner, node)
            node.snapshot = True
            self._snapshots.add(node)
        self.touch(node)
        return True

    def _insert_path(self, tokens: list[int], owner: Hashable) -> Node:
        """Make the path of ``tokens`` exist (splitting an edge where it diverges); new edges take
        their pages from ``owner``'s table. Returns the node ending at ``len(tokens)``."""
        ps, k = self.pool.page_size, len(tokens)
        node, pos = self.root, 0
        while pos < k:
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = Node(node, list(tokens[pos:k]), pos)
                self.pool.share(leaf, self.pool.page_table(owner)[pos // ps : self.pool.pages_for(k)])
                node.children[tokens[pos]] = leaf
                return leaf
            m = common_len(child.tokens, tokens, pos, k)
            if m < len(child.tokens):
                child = self._split(child, m)
            node, pos = child, pos + m
        return node

    def _split(self, node: Node, m: int) -> Node:
        """Cut ``node`` after its first ``m`` tokens; returns the new upper node (no snapshot)."""
        ps = self.pool.page_size
        s, cut = node.start, node.start + m
        table = list(self.pool.page_table(node))
        upper = Node(node.parent, node.tokens[:m], s)
        upper.last_access = node.last_access
        self.pool.share(upper, table[: (cut - 1) // ps - s // ps + 1])
        self.pool.set_table(node, table[cut // ps - s // ps :])
        node.parent.children[upper.tokens[0]] = upper
        node.tokens, node.start, node.parent = node.tokens[m:], cut, upper
        upper.children[node.tokens[0]] = node
        return upper

    def take_snapshot(self, node: Node, owner: Hashable) -> None:
        """Hand ``node``'s snapshot to ``owner`` (a request resuming there under memory pressure:
        no copy, no new block); the node goes as an evicted one would."""
        self._drop_snapshot(node, owner)
        self.num_evicted_snapshots -= 1

    def pin(self, node: Node) -> None:
        """Keep ``node`` and its path from eviction while a request is admitted on it: its
        snapshot and the pages of its path stop counting as evictable."""
        assert self._pinned is None, "one pin at a time"
        node.pinned = True
        self._pinned = node
        n = node
        while n is not self.root:
            self._pinned_pages.update(self.pool.page_table(n))
            n = n.parent

    def unpin(self) -> None:
        if self._pinned is not None:
            self._pinned.pinned = False
            self._pinned = None
            self._pinned_pages.clear()

    # ---- eviction ------------------------------------------------------------------------------
    def evictable_units(self) -> int:
        """Evicting every snapshot but the pinned one frees them and every page only the cache
        holds, but the pinned path's."""
        snapshots = len(self._snapshots) - int(self._pinned is not None and self._pinned.snapshot)
        kept = sum(1 for p in self._pinned_pages if self.pool.is_cache_only(p))
        return self.pool.pages_per_block * snapshots + self.pool.cache_only_pages - kept

    def evict(self, units: int) -> None:
        target = self.pool.free_pages + units
        skipped = []
        while self.pool.free_pages < target and self._heap:
            entry = heapq.heappop(self._heap)
            node = entry[3]
            if not node.snapshot or node.last_access != entry[0] or not node.alive:
                continue  # stale entry
            if node.pinned:
                skipped.append(entry)
                continue
            self._drop_snapshot(node)
        for entry in skipped:
            heapq.heappush(self._heap, entry)

    def flush(self) -> None:
        """Drop every node: all cache memory not also held by a request returns to the pool."""
        assert self._pinned is None
        for node in self.nodes():
            node.alive = False
            self.pool.free(node)
        self.root.children.clear()
        self._snapshots.clear()
        self._heap.clear()

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.last_access, node.end, next(self._seq), node))
        if len(self._heap) > 4 * len(self._snapshots) + 64:
            self._heap = [e for e in self._heap if e[3].alive and e[3].snapshot and e[3].last_access == e[0]]
            heapq.heapify(self._heap)

    def _drop_snapshot(self, node: Node, to: Hashable | None = None) -> None:
        if to is None:
            self.pool.free_state(node)
        else:
            self.pool.move_state(node, to)
        node.snapshot = False
        self._snapshots.discard(node)
        self.num_evicted_snapshots += 1
        while node is not self.root and not node.children and not node.snapshot and not node.pinned:
            parent = node.parent
            del parent.children[node.tokens[0]]
            node.alive = False
            self.pool.free(node)
            node = parent
