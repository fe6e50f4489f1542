"""Where one load's time goes, in a fresh process after dropping the page cache (root), next to
``cat`` of the same files in the same command.

    python benchmarks/profile_load.py CHECKPOINT_DIR [--strategy lazy eager] [--rounds 2] [--tree NAME=PATH ...]
        [--quantization mxfp4]

Per load: wall seconds; thread-seconds and bytes in ``MappedFiles.populate_ranges`` (mapped weights:
MADV_POPULATE_READ reads the file into the page cache and maps it) and in ``read_block`` (preadv
into memory of the process's own, the first touch of each new page included); the main thread's
remaining time (model build on the meta device, header checks, conversions, waiting on the
readers); minor and major page faults; user and system CPU seconds. The reader threads overlap
each other and the main thread, so the parts do not add up to the wall time. ``--tree``: profile
other tidal checkouts too (default: this one), each after its own cat. ``--quantization mxfp4``: an
MXFP4 checkpoint's experts loaded packed (``load_model``'s ``quantization``; default: dequantised).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from bench_load import drop_caches

ROOT = Path(__file__).resolve().parents[1]

PROFILE = """
import collections, resource, sys, threading, time
sys.path.insert(0, {root!r})
import torch
import tidal.model.checkpoint as ck
import tidal.model.mapped as mp
spent, done = collections.defaultdict(float), collections.defaultdict(int)
lock = threading.Lock()

def timed(owner, name, key, nbytes):
    f = getattr(owner, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); dt = time.perf_counter() - t
        with lock:
            spent[key] += dt; done[key] += nbytes(a, r)
        return r
    setattr(owner, name, g)

timed(mp.MappedFiles, "populate_ranges", "populate (mapped)", lambda a, r: sum(hi - lo for lo, hi in a[-1]))
timed(ck, "read_block", "preadv (own memory)", lambda a, r: r.numel() * r.element_size())
r0 = resource.getrusage(resource.RUSAGE_SELF)
t = time.perf_counter()
ck.load_model({ckpt!r}, torch.bfloat16, use_mmap={mmap}, quantization={quant!r})
wall = time.perf_counter() - t
r1 = resource.getrusage(resource.RUSAGE_SELF)
parts = "; ".join(f"{{k}} {{spent[k]:.2f}} thread-s for {{done[k] / 1e9:.3f}} GB" for k in spent)
print(f"{{wall:.2f}} s: {{parts}}; faults {{r1.ru_minflt - r0.ru_minflt}} minor, {{r1.ru_majflt - r0.ru_majflt}} major; "
      f"CPU {{r1.ru_utime - r0.ru_utime:.2f}} s user, {{r1.ru_stime - r0.ru_stime:.2f}} s system")
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--strategy", nargs="+", default=["lazy", "eager"], choices=["lazy", "eager"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tree", action="append", default=None, help="NAME=PATH of a tidal checkout (repeat)")
    ap.add_argument("--quantization", default=None, choices=["mxfp4"], help="load an MXFP4 checkpoint's experts packed")
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree) if args.tree else {"this": str(ROOT)}
    files = sorted(Path(args.checkpoint).glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    print(f"{size / 1e9:.2f} GB in {len(files)} file(s)")
    for r in range(args.rounds):
        for (name, tree), strategy in ((t, s) for t in trees.items() for s in args.strategy):
            cold = drop_caches()
            t = time.perf_counter()
            subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
            cat = time.perf_counter() - t
            drop_caches()
            code = PROFILE.format(root=str(Path(tree).resolve()), ckpt=str(Path(args.checkpoint).resolve()),
                                  mmap=strategy == "lazy", quant=args.quantization)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
            line = out.stdout.strip().splitlines()[-1]
            wall = float(line.split()[0])
            load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
            print(f"round {r} ({'cold' if cold else 'warm'}) cat {size / cat / 1e9:.2f} GB/s | {name} {strategy}: "
                  f"{cat / wall:.2f} of cat, {line} | load average {load}", flush=True)


if __name__ == "__main__":
    main()
