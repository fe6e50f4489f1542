"""What the multi-rank tests run: tiny checkpoints that split 4 ways, and one engine workload that
mixes chunked prefills, decodes, preemptions, prefix-cache hits and an abort (imported by the rank
processes, so it lives outside the test module)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from tidal.config import ModelConfig
from tidal.engine.core import EngineConfig, EngineCore
from tidal.model.checkpoint import save_model
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.parallel.groups import Collectives, RankPlace
from tidal.plan import pool_layout
from tidal.presets import tiny_k3_dict, tiny_kimi_linear_dict
from tidal.sampling_params import SamplingParams

PAGE = 4
BLOCKS = 6  # tight: the workload preempts and evicts


def tiny_config(kind: str) -> ModelConfig:
    """4 KDA heads, 4 MLA heads, expert intermediate 128: TP 4 leaves MXFP4 slices of 32."""
    d = tiny_k3_dict() if kind == "k3" else tiny_kimi_linear_dict(num_layers=4)
    text = d.get("text_config", d)
    text.update(num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=128)
    text["linear_attn_config"] = dict(text["linear_attn_config"], num_heads=4)
    return ModelConfig.from_dict(d)


def make_checkpoint(kind: str, out: Path) -> Path:
    model = init_weights(KimiForCausalLM(tiny_config(kind)), seed=0).to_dtype(torch.float32)
    return save_model(model, out, dtype=torch.float32)


def block_bytes(config: ModelConfig, place: RankPlace) -> int:
    return pool_layout(config, 1 << 30, page_size=PAGE, kv_dtype_bytes=4, conv_dtype_bytes=4,
                       tp_size=place.tp_size, dcp_size=place.dcp_size).block_bytes


def run_workload(model: KimiForCausalLM, config: ModelConfig, place: RankPlace) -> dict:
    """Greedy tokens and prompt logprobs of every request, and the pool's books before/after."""
    engine = EngineCore(model.eval(), EngineConfig(max_num_batched_tokens=24, page_size=PAGE,
                                                  kv_cache_memory_bytes=BLOCKS * block_bytes(config, place)))
    start = engine.pool.usage()
    rng = random.Random(5)
    vocab = config.vocab_size - 4
    system = [rng.randrange(vocab) for _ in range(10)]
    prompts = {f"r{i}": system + [rng.randrange(vocab) for _ in range(rng.randint(3, 20))] for i in range(8)}
    lp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out: dict = {"tokens": {}, "prompt_logprobs": {}}
    # turn 0: r0 alone (its state and pages stay in the prefix cache). Turn 1: r0's next turn first
    # (a prefix hit: a request asking for prompt logprobs computes its whole prompt, so it asks for
    # none), then r1..r7 one step apart, with prompt logprobs; their long outputs outgrow the pool
    # (preemptions, evictions), decodes run next to chunked prefills, and one request is aborted.
    turns = [[("r0", 0, lp)], [("r0", 0, long)] + [(f"r{i}", i, lp if i % 2 else long) for i in range(1, 8)]]
    for turn, jobs in enumerate(turns):
        done: dict = {}
        step = 0
        if turn == 1:
            engine.add_request("aborted", system + [1, 2, 3, 4, 5, 6], long)
        while len(done) < len(jobs):
            for rid, at, params in jobs:
                if at == step:
                    engine.add_request(f"{rid}/{turn}", prompts[rid], params)
            if turn == 1 and step == 6:
                engine.abort_request("aborted")
            for o in engine.step():
                if o.finished and o.request_id != "aborted":
                    done[o.request_id] = o
            step += 1
        for rid, o in done.items():
            base = rid.split("/")[0]
            out["tokens"][rid] = list(o.outputs[0].token_ids)
            ids = prompts[base]
            out["prompt_logprobs"][rid] = [None if x is None else x[ids[i]].logprob
                                           for i, x in enumerate(o.prompt_logprobs or [])]
            prompts[base] = ids + list(o.outputs[0].token_ids) + [rng.randrange(vocab) for _ in range(3)]
    m = engine.metrics()
    out["preemptions"], out["prefix_hits"] = m.num_preemptions, m.prefix_cache_hits
    engine.flush_prefix_cache()
    out["pool_back_to_start"] = engine.pool.usage() == start
    out["state_bytes"], out["page_bytes"] = engine.layout.state_bytes, engine.layout.page_bytes
    out["num_blocks"], out["pages_per_block"] = engine.layout.num_blocks, engine.layout.pages_per_block
    out["max_context_len"] = engine.layout.max_context_len()
    out["stored_page_size"], out["logical_page_size"] = engine.worker.storage.stored_page_size, engine.pool.page_size
    out["pool_buffer_bytes"], out["block_bytes"] = engine.worker.storage.buffer.numel(), engine.layout.block_bytes
    return out


def rank_program(place: RankPlace, comm: Collectives, ckpt: str) -> dict:
    """One rank: load its shard from the checkpoint, run the workload (every rank the same steps)."""
    import time

    from tidal.model.checkpoint import read_config
    from tidal.parallel.loader import load_rank_model

    t0 = time.perf_counter()
    config = read_config(Path(ckpt))
    model = load_rank_model(ckpt, place, comm, torch.float32)
    t1 = time.perf_counter()
    result = run_workload(model, config, place)
    result["seconds"] = (t1 - t0, time.perf_counter() - t1)
    result["weight_bytes"] = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return result


def forward_program(place: RankPlace, comm: Collectives, ckpt: str) -> list:
    """Logits of four steps over the reference cache (a DCP rank's holds its slice of the latents):
    a 1-token request (DCP ranks past the first hold none of it), a 9-token prefill and a prefill in
    two chunks, then decodes next to the second chunk, then decodes."""
    from tidal.parallel.loader import load_rank_model

    return forward_steps(load_rank_model(ckpt, place, comm, torch.float32).eval(), place)


def forward_steps(model: KimiForCausalLM, place: RankPlace) -> list:
    """:func:`forward_program`'s four steps on a loaded rank model."""
    from tidal.model.context import SimpleCache, simple_batch

    cache = SimpleCache(model.config, 3, model.dtype, dcp_rank=place.dcp_rank, dcp_size=place.dcp_size)
    seqs = [[7], [3 + i for i in range(9)], [40, 41, 42]]
    lens, out = [0, 0, 0], []
    with torch.inference_mode():
        for q in ([1, 9, 3], [1, 1, 4], [1, 1, 1], [1, 1, 1]):
            ids = []
            for b in range(3):
                while len(seqs[b]) < lens[b] + q[b]:
                    seqs[b].append((seqs[b][-1] * 7 + 3) % 200)
                ids.extend(seqs[b][lens[b] : lens[b] + q[b]])
            h = model(torch.tensor(ids), simple_batch(model.config, q, cache, list(lens)))
            out.append(model.compute_logits(h))
            lens = [a + b for a, b in zip(lens, q)]
    return out


def mapped_and_copied_program(place: RankPlace, comm: Collectives, ckpt: str) -> dict:
    """One rank, bfloat16: its shard loaded with the file mapped (dense experts as strided views in
    file order, packed ones each where the file holds it) and copied; whether every step's logits are
    equal, the mapped model's expert slots and whether its packed experts are held apart."""
    from tidal.model.moe import Experts, PackedExperts
    from tidal.parallel.loader import load_rank_model

    mapped = load_rank_model(ckpt, place, comm, torch.bfloat16).eval().process_weights_after_loading()
    copied = load_rank_model(ckpt, place, comm, torch.bfloat16, use_mmap=False).eval().process_weights_after_loading()
    a, b = forward_steps(mapped, place), forward_steps(copied, place)
    return {"equal": [torch.equal(x, y) for x, y in zip(a, b)],
            "slots": [m.slots for m in mapped.modules() if isinstance(m, Experts)],
            "apart": [m.apart for m in mapped.modules() if isinstance(m, PackedExperts)]}


def layouts_program(place: RankPlace, comm: Collectives, ckpts: dict, engine: list, forward: list) -> dict:
    """Every (kind, tp, ep, dcp) layout in turn on one set of processes (one start-up for all):
    the ranks below tp run it, the others go on to the next layout's groups. ``engine`` layouts run
    :func:`rank_program`, ``forward`` ones :func:`forward_program`."""
    from tidal.parallel.groups import make_groups

    out: dict = {"engine": [], "forward": []}
    for key, program, layouts in (("engine", rank_program, engine), ("forward", forward_program, forward)):
        for kind, tp, ep, dcp in layouts:
            sub = make_groups(tp, ep, dcp)
            out[key].append(None if sub.place is None else program(sub.place, sub, ckpts[kind]))
    return out
