"""The static buffers a captured decode graph reads (tidal.engine.cuda_graph.GraphCacheView): for
live rows the same page table, lengths, write targets and slots as the eager PoolCacheView; padded
rows inert. (Capture and replay need a GPU: scripts/gpu_check.sh.)"""

import torch

from tidal.cache.pool import MemoryPool
from tidal.engine.cuda_graph import GraphCacheView, batch_buckets
from tidal.plan import pool_layout
from tidal.presets import tiny_k3


def test_buckets_cover_every_batch_size():
    for max_bs in (1, 5, 128, 200):
        b = batch_buckets(max_bs)
        assert b[0] == 1 and b[-1] == max_bs and b == sorted(set(b))


def test_graph_buffers_match_the_eager_view():
    cfg = tiny_k3()
    layout = pool_layout(cfg, 1 << 22, page_size=4, kv_dtype_bytes=4, conv_dtype_bytes=4)
    pool = MemoryPool(cfg, layout, torch.float32)
    owners, cached = ["a", "b", "c"], [0, 9, 4]
    for o, c in zip(owners, cached):
        assert pool.alloc_state(o) and pool.reserve(o, c + 1)
    view = GraphCacheView(pool.storage, size=8, max_pages=6)
    view.fill([pool.page_table(o) for o in owners], [pool.state_block(o) for o in owners], cached)
    eager = pool.cache_view(owners, [1] * 3, cached)
    _, table, lengths = eager.mla_pages(0, [0, 1, 2])
    assert torch.equal(view.lengths[:3], lengths) and (view.lengths[3:] == 0).all()
    for b in range(3):
        n = pool.pages_for(cached[b] + 1)
        assert torch.equal(view.table[b, :n], table[b, :n])
    assert torch.equal(view.write[:, :3], torch.stack(eager._write))
    assert (view.write[:, 3:] == view.write[:, :1]).all() and (view.write_src[3:] == 0).all()
    assert view.slots[:3].tolist() == [pool.state_block(o) for o in owners] and (view.slots[3:] == -1).all()
    assert view.cu.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]
