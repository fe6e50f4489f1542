"""Peak memory and time of one prefill chunk as the cached context grows, tiny K3 with wide MLA.

    python benchmarks/bench_mla_memory.py [--contexts 8192,16384,32768,65536] [--chunk 2048]
    python benchmarks/bench_mla_memory.py --one 12288        # one run, JSON on stdout
    python benchmarks/bench_mla_memory.py --prefills 12288,24576 [--chunk 2048]   # whole prompts

Each context runs in a fresh process (peak RSS is a process-wide high-water mark; tracemalloc
does not see torch tensors). The engine's pool is built, a request's context of that many tokens
is written into its pages (random latents: attention cost and memory do not depend on the values),
and then one chunk of --chunk new tokens runs through the model over the pool, as the engine's
runner does at the end of a long prefill. Reported: the growth of peak RSS over the baseline
taken after the context was written, and the chunk's time. With ``--kernel naive`` the model
runs the reference kernel that expands k/v over the whole context, for comparison. With
``--prefills`` each prompt is instead prefilled whole by the engine, chunk by chunk (the peak then
also holds the KV the prompt wrote).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

WIDE_MLA = dict(num_attention_heads=8, num_key_value_heads=8, qk_nope_head_dim=64, v_head_dim=64,
                qk_rope_head_dim=16, kv_lora_rank=64)


def wide_mla_config(max_len: int = 1 << 17):
    """tiny K3 (4 layers: KDA, KDA, KDA, MLA) with 8 heads of nope 64 / v 64."""
    from tidal.config import ModelConfig
    from tidal.presets import tiny_k3_dict

    d = tiny_k3_dict(num_layers=4, mxfp4=False)
    d["text_config"].update(WIDE_MLA, max_position_embeddings=max_len)
    return ModelConfig.from_dict(d)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_one(context: int, chunk: int, kernel: str) -> dict:
    from tidal.cache.storage import PoolCacheView
    from tidal.engine.core import EngineConfig, EngineCore
    from tidal.model.context import ForwardBatch
    from tidal.model.init import init_weights
    from tidal.model.kimi import KimiForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = wide_mla_config()
    model = init_weights(KimiForCausalLM(config), seed=0).to_dtype(torch.float32).eval()
    if kernel == "naive":
        _use_naive_prefill()
    engine = EngineCore(model, EngineConfig(max_num_batched_tokens=chunk, kv_cache_memory_bytes=1 << 30,
                                            enable_prefix_caching=False))
    pool, total = engine.pool, context + chunk
    assert pool.alloc_state("r") and pool.reserve("r", total)
    engine.worker.storage.apply(pool.take_copies())

    def cache_view(query_len: int, cached_len: int) -> PoolCacheView:
        return PoolCacheView(engine.worker.storage, [pool.state_block("r")], [pool.page_table("r")], [query_len],
                             [cached_len])

    past = cache_view(context, 0)
    for layer in range(config.num_mla_layers):
        past.mla_write(layer, torch.randn(context, config.mla_cache_width) * 0.1)
    ids = torch.randint(0, config.vocab_size, (chunk,), generator=torch.Generator().manual_seed(1))

    def run_chunk() -> float:
        view = cache_view(chunk, context)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(ids, ForwardBatch(query_lens=[chunk], cached_lens=[context], cache=view))
        return time.perf_counter() - t0

    base = peak_rss_bytes()
    seconds = run_chunk()
    growth = peak_rss_bytes() - base
    return dict(context=context, chunk=chunk, kernel=kernel, peak_rss_growth=growth, chunk_s=seconds,
                chunk_kv_bytes=chunk * engine.plan.mla_kv_bytes_per_token,
                context_kv_bytes=context * engine.plan.mla_kv_bytes_per_token)


def run_prefill(prompt: int, chunk: int) -> dict:
    """A whole prompt of ``prompt`` tokens prefilled by the engine in chunks of ``chunk`` (to its
    first token): the growth of peak RSS over the baseline taken once the engine is built, and the
    time. Growth = the KV and state the prompt writes + the largest chunk's working set."""
    from tidal.engine.core import EngineConfig, EngineCore
    from tidal.model.init import init_weights
    from tidal.model.kimi import KimiForCausalLM
    from tidal.sampling_params import SamplingParams

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = wide_mla_config()
    model = init_weights(KimiForCausalLM(config), seed=0).to_dtype(torch.float32).eval()
    engine = EngineCore(model, EngineConfig(max_num_batched_tokens=chunk, kv_cache_memory_bytes=1 << 30,
                                            enable_prefix_caching=False))
    ids = torch.randint(0, config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    base = peak_rss_bytes()
    t0 = time.perf_counter()
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=1))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return dict(prompt=prompt, chunk=chunk, steps=steps, peak_rss_growth=peak_rss_bytes() - base,
                prefill_s=time.perf_counter() - t0, kv_bytes=prompt * engine.plan.mla_kv_bytes_per_token)


def measure_prefill(prompt: int, chunk: int) -> dict:
    """run_prefill in a fresh interpreter."""
    return _fresh(["--prefill", str(prompt), "--chunk", str(chunk)])


def _use_naive_prefill() -> None:
    """Make the model's paged prefill gather the whole context and run the expanded reference."""
    import tidal.model.mla as mla_model
    from tidal.ops.mla import mla_naive_attention

    def naive(q_nope, q_pe, pages, table, lengths, w, scale):
        rows = pages.index_select(0, table[0]).flatten(0, 1)[: lengths[0]]
        return mla_naive_attention(q_nope[0], q_pe[0], rows, w, scale)[None]

    mla_model.mla_tiled_attention = naive


def measure(context: int, chunk: int = 2048, kernel: str = "tiled") -> dict:
    """run_one in a fresh interpreter, importing tidal from this checkout."""
    return _fresh(["--one", str(context), "--chunk", str(chunk), "--kernel", kernel])


def _fresh(args: list[str]) -> dict:
    """This script with ``args`` in a fresh interpreter importing tidal from this checkout -> its JSON."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    # A fixed mmap threshold: glibc otherwise raises it as big blocks are freed, and later big
    # tensors come from a heap that fragments, so peak RSS would drift with the number of steps.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,16384,32768,65536")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--kernel", choices=("tiled", "naive"), default="tiled")
    ap.add_argument("--prefills", default=None,
                    help="instead: whole prompts of these lengths prefilled by the engine in --chunk chunks")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prefill", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.chunk, args.kernel)))
        return
    if args.prefill is not None:
        print(json.dumps(run_prefill(args.prefill, args.chunk)))
        return
    mib = 2 ** 20
    if args.prefills:
        print(f"tiny K3, wide MLA {WIDE_MLA}, float32, whole prompts in chunks of {args.chunk}, 1 thread")
        print(f"{'prompt':>8} {'prompt KV':>10} {'peak RSS +':>11} {'prefill time':>13}")
        for n in (int(x) for x in args.prefills.split(",")):
            r = measure_prefill(n, args.chunk)
            print(f"{n:>8} {r['kv_bytes'] / mib:>6.1f} MiB {r['peak_rss_growth'] / mib:>7.1f} MiB {r['prefill_s']:>11.2f} s")
        return
    print(f"tiny K3, wide MLA {WIDE_MLA}, float32, chunks of {args.chunk}, kernel {args.kernel}, 1 thread")
    print(f"{'context':>8} {'context KV':>11} {'peak RSS + (chunk)':>19} {'chunk time':>11}")
    for ctx in (int(x) for x in args.contexts.split(",")):
        r = measure(ctx, args.chunk, args.kernel)
        print(f"{ctx:>8} {r['context_kv_bytes'] / mib:>7.1f} MiB {r['peak_rss_growth'] / mib:>15.1f} MiB "
              f"{r['chunk_s']:>9.2f} s")


if __name__ == "__main__":
    main()
