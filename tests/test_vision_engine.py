"""Images in the engine: placeholder embeddings replaced by the tower's output, equal to an
engine-free reference; chunked prefill splitting an image changes nothing; the encoder cache runs
the tower once per image; the prefix cache keys images by content."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tidal import presets
from tidal.engine.request import ImageItem
from tidal.llm import LLM
from tidal.model.context import SimpleCache, simple_batch
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.multimodal import preprocess_image
from tidal.sampling_params import SamplingParams

POOL = 16_000_000


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return init_weights(KimiForCausalLM(presets.tiny_k3(vision=True, mxfp4=False)), seed=3).to_dtype(torch.float32)


def image(seed: int, w: int = 60, h: int = 45, cfg=None):
    arr = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    return preprocess_image(Image.fromarray(arr), cfg)


def prompt_with(img, pad: int, before: int = 5, after: int = 4) -> tuple[list[int], list[ImageItem]]:
    ids = [10 + i for i in range(before)] + [pad] * img.num_tokens + [40 + i for i in range(after)]
    return ids, [ImageItem(before, img)]


def reference_logprobs(model, ids, items) -> torch.Tensor:
    """The whole prompt in one forward over a SimpleCache, image rows replaced (no engine)."""
    cache = SimpleCache(model.config, 1, torch.float32)
    pos = torch.cat([torch.arange(it.offset, it.end) for it in items])
    with torch.no_grad():
        emb = torch.cat([model.embed_image(it.image.patches, it.image.grid) for it in items])
        hidden = model(torch.tensor(ids), simple_batch(model.config, [len(ids)], cache, [0]), (pos, emb))
        return torch.log_softmax(model.compute_logits(hidden[-1:]), -1)[0]


def run(llm, ids, items, rid="r", max_tokens=3):
    eng = llm.engine
    eng.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=5), images=items)
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished and o.request_id == rid:
                out = o
    return out


def first_logprobs(out) -> dict[int, float]:
    return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}


def test_image_request_matches_reference_and_chunking(model):
    cfg = model.config.vision
    pad = model.config.media_placeholder_token_id
    img = image(1, cfg=cfg)
    assert img.grid == (4, 6) and img.num_tokens == 6
    ids, items = prompt_with(img, pad)
    ref = reference_logprobs(model, ids, items)
    for batched in (2048, 7, 3):  # 7 and 3 cut the image's span between chunks
        llm = LLM(model, kv_cache_memory_bytes=POOL, max_num_batched_tokens=batched, enable_prefix_caching=False)
        got = first_logprobs(run(llm, ids, items))
        for t, lp in got.items():
            assert lp == pytest.approx(float(ref[t]), abs=1e-4), (batched, t)
    # a different image at the same place changes the logits
    other_ids, other_items = prompt_with(image(2, cfg=cfg), pad)
    assert other_ids == ids
    diff = (reference_logprobs(model, other_ids, other_items) - ref).abs().max()
    assert diff > 1e-3


def test_encoder_cache_and_prefix_cache_key_images_by_content(model):
    cfg = model.config.vision
    pad = model.config.media_placeholder_token_id
    llm = LLM(model, kv_cache_memory_bytes=POOL, prefix_snapshot_interval=0)
    eng = llm.engine
    a, b = image(1, cfg=cfg), image(2, cfg=cfg)
    ids, items = prompt_with(a, pad)
    first = run(llm, ids, items, "t1")
    assert eng.encoder_cache.misses == 1
    # next turn of the same conversation: the cache serves everything up to the last turn's end
    turn2 = ids + first.outputs[0].token_ids + [50, 51, 52]
    second = run(llm, turn2, items, "t2")
    assert second.num_cached_tokens >= len(ids) > items[0].end
    assert eng.encoder_cache.misses == 1  # the tower did not run again (nothing past the hit needs it)
    # the same token ids with different pixels: no hit past the image's first placeholder
    third = run(llm, turn2, [ImageItem(items[0].offset, b)], "t3")
    assert third.num_cached_tokens <= items[0].offset
    assert eng.encoder_cache.misses == 2
    assert first_logprobs(third) != first_logprobs(second)
    # and the first image again, fresh request with the prefix flushed: encoder cache hit
    eng.flush_prefix_cache()
    hits = eng.encoder_cache.hits
    run(llm, ids, items, "t4")
    assert eng.encoder_cache.hits == hits + 1 and eng.encoder_cache.misses == 2


def test_engine_refuses_bad_image_spans_and_text_only_models(model):
    cfg = model.config.vision
    pad = model.config.media_placeholder_token_id
    llm = LLM(model, kv_cache_memory_bytes=POOL)
    img = image(1, cfg=cfg)
    ids, items = prompt_with(img, pad)
    with pytest.raises(ValueError, match="not all placeholder tokens"):
        llm.engine.add_request("x", ids, SamplingParams(max_tokens=1), images=[ImageItem(2, img)])
    with pytest.raises(ValueError, match="image placeholder tokens \\(252\\) but no images"):
        llm.engine.add_request("w", ids, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="leaves the prompt"):
        llm.engine.add_request("y", ids[:8], SamplingParams(max_tokens=1), images=items)
    text_only = LLM(init_weights(KimiForCausalLM(presets.tiny_k3(mxfp4=False))), kv_cache_memory_bytes=POOL)
    with pytest.raises(ValueError, match="this model takes no images"):
        text_only.engine.add_request("z", ids, SamplingParams(max_tokens=1), images=items)
    assert not llm.engine.has_unfinished_requests()
