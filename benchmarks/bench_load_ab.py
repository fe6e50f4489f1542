"""``load_model`` of two source trees on the same checkpoint, against ``cat``, in one command.

    python benchmarks/bench_load_ab.py --tree old=/path/to/old/checkout --tree new=. [--size-gb 0.5] [--rounds 2]

Answers "did this loader change make loading faster or slower" where the machine's speed drifts
between commands: each round times ``cat`` and then each tree's ``load_model`` (bf16, in a fresh
process that imports tidal from that tree), each after dropping the page cache (root only; else
every read is warm and the script says so). The checkpoint is bench_load.py's random Kimi
Linear-layout model of about --size-gb, written once to --dir.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_load import big_config, drop_caches

LOAD = """
import sys, time, torch
sys.path.insert(0, {tree!r})
import tidal
assert tidal.__file__.startswith({tree!r}), tidal.__file__
from tidal.model.checkpoint import load_model
t = time.perf_counter(); load_model({ckpt!r}, torch.bfloat16); print(time.perf_counter() - t)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a tidal checkout (repeat)")
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "tidal-load-ab"))
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    ckpt = Path(args.dir)
    if not (ckpt / "config.json").exists():
        import torch

        from tidal.model.checkpoint import save_model
        from tidal.model.kimi import KimiForCausalLM

        save_model(KimiForCausalLM(big_config(args.size_gb)).to(torch.bfloat16), ckpt)
    files = sorted(ckpt.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    print(f"{size / 1e9:.2f} GB in {len(files)} file(s)")
    for r in range(args.rounds):
        cold = drop_caches()
        t = time.perf_counter()
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
        cat = time.perf_counter() - t
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        print(f"round {r} ({'cold' if cold else 'warm: cannot drop the page cache'}): cat {size / cat / 1e9:.2f} GB/s"
              f" (load average {load})", flush=True)
        for name, tree in trees.items():
            drop_caches()
            code = LOAD.format(tree=str(Path(tree).resolve()), ckpt=str(ckpt))
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
            s = float(out.stdout.split()[-1])
            print(f"  {name}: {size / s / 1e9:.2f} GB/s = {cat / s:.2f} of cat")


if __name__ == "__main__":
    main()
