"""Checkpoint load speed against reading the same files with ``cat``, in one command.

    python benchmarks/bench_load.py --size-gb 1                  # one process and 2 ranks
    python benchmarks/bench_load.py --size-gb 1 --tp-size 1 2 4 --ep-size 2
    python benchmarks/bench_load.py --size-gb 0.5 --experts mxfp4   # packed MXFP4 experts

Writes a random Kimi Linear-layout checkpoint of about --size-gb (bf16, sharded), then times
``cat shards > /dev/null`` and each load on the same files, each after dropping the page cache when
the machine allows it (else all warm: the state is printed, with ``fincore``'s count of the
checkpoint's cached bytes before each timing), and prints GB/s and the ratio to cat. --tp-size 1 is
``load_model`` in a fresh process (as a server loads: its memory is new to it; imports excluded);
N > 1 is N rank processes each reading only its slices (``tidal.parallel.loader``), timed from a
barrier before to a barrier after (process start-up excluded); GB/s counts the bytes all ranks read.
The cat runs before every load, so each ratio compares two reads under the same cache state. Every
round is printed (the machine's speed drifts between rounds).

The other bound of a load is memory, not the disk: ``cat`` reuses one small buffer, a loader that
copies writes every byte into memory its process has never touched. "fresh memory" is the rate at
which a fresh process writes that many bytes into new memory (torch.empty + fill_, 2 threads). The
default load maps the files instead (``--safetensors-load-strategy lazy``): a weight whose bytes on
disk are its bytes in memory, stacked experts included, is a view of the page cache; ``--strategy
eager`` times the copying load (``--strategy lazy eager``: both, each round). Every line also gives
``process_weights_after_loading`` (what a server runs next before its first forward pass; for bf16
weights on the CPU it copies nothing, ``tidal.model.layers.keeps_apart``) and the ratio of load plus
that to cat. A mapped load has read its pages and mapped them (MADV_POPULATE_READ) before it
returns, so the first forward pass reads no file. Each line ends with the load average.

``cat`` on this machine's virtual disk is bimodal (rounds at ~0.6 GB/s and rounds at ~2 GB/s, the
same files, whatever precedes it), so each round also times the disk itself: ``sendfile`` of the
same files to /dev/null (the kernel's sequential read-ahead into the page cache, nothing copied to
the process), the physical limit of a load, and prints load/disk beside load/cat.

``--tree NAME=PATH`` (repeat) loads with other tidal checkouts too, each round in turn (reversed
every other round) on the same checkpoint, each load after its own cat: A/B figures from one
command. ``--checkpoint DIR`` loads an existing checkpoint instead of writing one.

``--experts mxfp4`` writes the routed experts as MXFP4 (compressed-tensors ``weight_packed`` /
``weight_scale``, the expert count grown to the same --size-gb) and loads them packed
(``quantization="mxfp4"``): mapped, each expert's codes and scales stay in the file's mapping
(``PackedExperts.use_matrices``); eager, they are read into the stacked buffers.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's tidal, not an installed one

import torch

from tidal.config import ModelConfig
from tidal.model.checkpoint import MXFP4, save_model
from tidal.model.kimi import KimiForCausalLM
from tidal.presets import tiny_kimi_linear_dict


def big_config(size_gb: float, packed: bool = False) -> ModelConfig:
    d = tiny_kimi_linear_dict(hidden_size=1024, num_layers=8, vocab_size=32000, num_experts=16, top_k=2)
    d.update(intermediate_size=4096, moe_intermediate_size=512, num_attention_heads=8, num_key_value_heads=8,
             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, torch_dtype="bfloat16")
    d["linear_attn_config"].update(num_heads=8, head_dim=128)
    # grow the expert count until the checkpoint's size reaches the target (MXFP4: 4.25 bits a weight)
    per_expert_layer = 3 * 1024 * 512 * (17 / 32 if packed else 2) * (d["num_hidden_layers"] - 1)
    base = sum(p.numel() for p in KimiForCausalLM(ModelConfig.from_dict({**d, "num_experts": 2})).parameters()) * 2
    d["num_experts"] = max(2, int((size_gb * 1e9 - base) / per_expert_layer) + 2)
    return ModelConfig.from_dict(d)


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def cached_bytes(files: list[Path]) -> int | None:
    """Bytes of ``files`` in the page cache (util-linux fincore), None if it cannot tell."""
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                             capture_output=True, text=True, check=True).stdout
        return sum(int(x) for x in out.split())
    except (OSError, subprocess.CalledProcessError, ValueError):
        return None


LOAD = """
import sys, time, torch
sys.path.insert(0, {root!r})
from tidal.model.checkpoint import load_model
t = time.perf_counter(); m = load_model({ckpt!r}, torch.bfloat16, use_mmap={mmap}, quantization={quant!r}); t1 = time.perf_counter()
m.process_weights_after_loading(); print(time.perf_counter() - t1, t1 - t)
"""

FRESH_MEMORY = """
import time, torch
torch.set_num_threads(2)
t = time.perf_counter(); torch.empty({n}, dtype=torch.uint8).fill_(1); print(time.perf_counter() - t)
"""


def disk_seconds(files: list[Path]) -> float:
    """Seconds to read ``files`` front to back into the page cache by sendfile to /dev/null."""
    sink = os.open(os.devnull, os.O_WRONLY)
    t = time.perf_counter()
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                while os.sendfile(sink, fd, None, 64 << 20) > 0:
                    pass
            finally:
                os.close(fd)
    finally:
        os.close(sink)
    return time.perf_counter() - t


def in_fresh_process(code: str) -> float:
    """Seconds a timed snippet prints, run in a new Python process."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    return float(out.stdout.split()[-1])


def _rank_load(place, comm, path: str, mmap: bool, quantization: str | None) -> tuple[int, float, float]:
    """One rank: its shard's bytes, the load's seconds and process_weights_after_loading's, each
    between two barriers."""
    import torch.distributed as dist

    from tidal.parallel.loader import load_rank_model

    dist.barrier()
    t0 = time.perf_counter()
    model = load_rank_model(path, place, comm, torch.bfloat16, use_mmap=mmap, quantization=quantization)
    dist.barrier()
    t1 = time.perf_counter()
    model.process_weights_after_loading()
    dist.barrier()
    return model.loaded_bytes, t1 - t0, time.perf_counter() - t1


def load_on_ranks(path: Path, tp: int, ep: int, mmap: bool, quantization: str | None) -> tuple[int, float, float]:
    """(bytes all ranks read, seconds of the load, seconds of process_weights_after_loading) for a
    sharded load on tp processes (each timed from one barrier to the next: the slowest rank's)."""
    from tidal.parallel.launch import run_ranks

    results = run_ranks(_rank_load, tp_size=tp, ep_size=ep, args=(str(path), mmap, quantization), timeout_s=3600)
    return sum(b for b, _, _ in results), max(r[1] for r in results), max(r[2] for r in results)


RANKS = """
import sys
sys.path[:0] = [{root!r}, {root!r} + "/benchmarks"]
from pathlib import Path
from bench_load import load_on_ranks
print(*load_on_ranks(Path({ckpt!r}), {tp}, {ep}, {mmap}, {quant!r}))
"""


def in_fresh_process_pair(code: str) -> tuple[float, float]:
    """The two numbers a timed snippet prints, run in a new Python process."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    a, b = out.stdout.split()[-2:]
    return float(a), float(b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    ap.add_argument("--tp-size", type=int, nargs="*", default=[1, 2],
                    help="1: load_model in a fresh process; N > 1: N rank processes (sharded)")
    ap.add_argument("--ep-size", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--strategy", nargs="+", default=["lazy"], choices=["lazy", "eager"],
                    help="--safetensors-load-strategy of the loads, each after its own cat (lazy: mapped; eager: copied)")
    ap.add_argument("--experts", default="bf16", choices=["bf16", "mxfp4"],
                    help="routed experts on disk and in memory: bf16, or MXFP4 loaded packed")
    ap.add_argument("--tree", action="append", default=None,
                    help="NAME=PATH of a tidal checkout to load with (repeat; default: this one)")
    ap.add_argument("--checkpoint", default=None, help="an existing checkpoint directory (default: write one)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    packed = args.experts == "mxfp4"
    trees = dict(t.split("=", 1) for t in args.tree) if args.tree else {"this": str(ROOT)}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        out = Path(args.checkpoint) if args.checkpoint else Path(tmp) / "ckpt"
        if not args.checkpoint:
            config = big_config(args.size_gb, packed)
            with torch.device("meta"):
                meta = KimiForCausalLM(config)
            model = meta.to_empty(device="cpu")
            for p in model.parameters():
                p.data.normal_(0, 0.02)
            save_model(model.to_dtype(torch.bfloat16), out, max_shard_bytes=256 << 20,
                       expert_format=MXFP4 if packed else None)
            del model, meta
        files = sorted(out.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        print(f"checkpoint: {len(files)} shards, {size / 1e9:.2f} GB ({args.experts} experts)")
        t_mem = in_fresh_process(FRESH_MEMORY.format(n=size))
        print(f"fresh memory: {size / t_mem / 1e9:.2f} GB/s ({t_mem:.2f} s for the checkpoint's bytes)")
        for tp in args.tp_size:
            for r in range(args.rounds):
                order = list(trees.items())
                for name, tree in order if r % 2 == 0 else order[::-1]:
                    for strategy in args.strategy:  # the cat runs before each load
                        _round(files, size, out, tp, args.ep_size, strategy, "mxfp4" if packed else None,
                               tree, name if len(trees) > 1 else "")


def _round(files: list[Path], size: int, out: Path, tp: int, ep: int, strategy: str, quantization: str | None,
           tree: str = str(ROOT), tree_name: str = "") -> None:
    """cat, then one load, each after dropping the page cache; prints one line."""
    mmap = strategy == "lazy"
    cold = drop_caches()
    before_cat = cached_bytes(files)
    t0 = time.perf_counter()
    subprocess.run(["sh", "-c", "cat \"$@\" > /dev/null", "cat", *map(str, files)], check=True)
    t_cat = time.perf_counter() - t0
    drop_caches()
    t_disk = disk_seconds(files)
    drop_caches()
    before_load = cached_bytes(files)
    if tp == 1:
        t_prep, t_load = in_fresh_process_pair(LOAD.format(root=tree, ckpt=str(out), mmap=mmap, quant=quantization))
        read = size
    elif tree == str(ROOT):
        read, t_load, t_prep = load_on_ranks(out, tp, ep, mmap, quantization)
    else:  # the ranks import the other checkout's tidal
        code = RANKS.format(root=tree, ckpt=str(out), tp=tp, ep=ep, mmap=mmap, quant=quantization)
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
        b, t_load, t_prep = got.stdout.split()[-3:]
        read, t_load, t_prep = int(b), float(t_load), float(t_prep)
    prep = (f"   then process_weights_after_loading {t_prep:.2f} s "
            f"(load + that: {read / (t_load + t_prep) / (size / t_cat):.2f} of cat)")
    state = "cold page cache" if cold else "warm page cache (could not drop caches)"
    cached = ("" if before_cat is None else
              f", cached before cat {before_cat / size:.0%}, before load {before_load / size:.0%}")
    what = f"load_model ({strategy})" if tp == 1 else f"{tp} ranks (ep {ep}, {strategy}), {read / 1e9:.2f} GB read"
    what = f"{tree_name} {what}" if tree_name else what
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"[{state}{cached}] cat: {size / t_cat / 1e9:.2f} GB/s ({t_cat:.2f} s)   disk (sendfile): "
          f"{size / t_disk / 1e9:.2f} GB/s   {what}: {read / t_load / 1e9:.2f} GB/s ({t_load:.2f} s)   "
          f"ratio (GB/s) load/cat = {read / t_load / (size / t_cat):.2f}, load/disk = "
          f"{read / t_load / (size / t_disk):.2f}{prep}   load average {load}", flush=True)

if __name__ == "__main__":
    main()
