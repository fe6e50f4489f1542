"""OpenMP parallel regions per decode step, by module, on the trees given (one child process each).

    PYTHONPATH=. python benchmarks/count_omp_regions.py                       # this tree, batch 1 and 8
    PYTHONPATH=. python benchmarks/count_omp_regions.py --tree base=/tmp/base --tree new=. --batches 1

Under tidal's passive OpenMP waits every region that runs on more than one thread wakes a sleeping
pool thread (and its end puts one back to sleep): on this machine that costs more than a small op's
second thread saves. libgomp has no counter for it, so each child runs with a small shim in
LD_PRELOAD that counts GOMP_parallel* calls, sections included (the MoE layer step's routed and
shared branches; torch's pool and tidal's C kernels share one libgomp), split by whether the region
got one thread (an ``if`` clause that was false: no wake-up) or more.
The model is vs_llamacpp.py's (223M, bf16 trunk); counts are per step, over --steps steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
static int64_t multi, single;
int64_t omp_regions_multi(void) { return multi; }
int64_t omp_regions_single(void) { return single; }
static void count(unsigned n) { if (n == 1) single++; else multi++; }
typedef void (*par_fn)(void (*)(void *), void *, unsigned, unsigned);
void GOMP_parallel(void (*fn)(void *), void *data, unsigned n, unsigned flags) {
    static par_fn real;
    if (!real) real = (par_fn)dlsym(RTLD_NEXT, "GOMP_parallel");
    count(n);
    real(fn, data, n, flags);
}
typedef void (*loop_fn)(void (*)(void *), void *, unsigned, long, long, long, long, unsigned);
#define LOOP(name) void name(void (*fn)(void *), void *data, unsigned n, long a, long b, long c, long d, \
                             unsigned f) { \
    static loop_fn real; if (!real) real = (loop_fn)dlsym(RTLD_NEXT, #name); \
    count(n); real(fn, data, n, a, b, c, d, f); }
LOOP(GOMP_parallel_loop_dynamic)
LOOP(GOMP_parallel_loop_static)
LOOP(GOMP_parallel_loop_guided)
LOOP(GOMP_parallel_loop_runtime)
typedef void (*sections_fn)(void (*)(void *), void *, unsigned, unsigned, unsigned);
void GOMP_parallel_sections(void (*fn)(void *), void *data, unsigned n, unsigned count_, unsigned flags) {
    static sections_fn real;
    if (!real) real = (sections_fn)dlsym(RTLD_NEXT, "GOMP_parallel_sections");
    count(n);
    real(fn, data, n, count_, flags);
}
"""

CHILD = """
import ctypes, collections, json, sys
sys.path.insert(0, {bench!r})
sys.path.insert(0, {tree!r})
import tidal, torch
assert tidal.__file__.startswith({tree!r}), tidal.__file__
from count_decode_ops import MODEL_MODULES, decode_engine
from vs_llamacpp import CONFIG, checkpoint
from tidal import LLM
shim = ctypes.CDLL({shim!r})
multi, single = shim.omp_regions_multi, shim.omp_regions_single
multi.restype = single.restype = ctypes.c_int64
torch.set_num_threads({threads})
llm = LLM(str(checkpoint(CONFIG)), dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 28)
engine = decode_engine(llm, 32000, {batch})
for _ in range(2):
    engine.step()
counts = collections.Counter()
stack = []
def labelled(owner, name, label):
    fn = getattr(owner, name)
    def wrapper(*args, **kwargs):  # regions go to the innermost labelled module
        stack.append([multi(), 0])
        try:
            return fn(*args, **kwargs)
        finally:
            start, inner = stack.pop()
            mine = multi() - start
            counts[label] += mine - inner
            if stack:
                stack[-1][1] += mine
    setattr(owner, name, wrapper)
for owner, name, label in MODEL_MODULES:
    labelled(owner, name, label)
m0, s0 = multi(), single()
for _ in range({steps}):
    engine.step()
total = multi() - m0
counts["other"] = total - sum(counts.values())
print(json.dumps({{"multi": total / {steps}, "single": (single() - s0) / {steps},
                  "by_module": {{k: v / {steps} for k, v in counts.items()}}}}))
"""


def build_shim(directory: Path) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("count_omp_regions needs a C compiler for its LD_PRELOAD shim")
    src, lib = directory / "omp_regions.c", directory / "omp_regions.so"
    src.write_text(SHIM)
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", str(src), "-o", str(lib), "-ldl"], check=True)
    return lib


def count(tree: Path, shim: Path, batch: int, threads: int, steps: int) -> dict:
    code = CHILD.format(bench=str(Path(__file__).resolve().parent), tree=str(tree.resolve()), shim=str(shim),
                        threads=threads, batch=batch, steps=steps)
    env = dict(os.environ, LD_PRELOAD=str(shim))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the counting process exited with {out.returncode}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", help="NAME=PATH of a tidal checkout (repeat; default: this one)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.tree) if args.tree else {"this": str(Path(__file__).parent.parent)}
    with tempfile.TemporaryDirectory() as tmp:
        shim = build_shim(Path(tmp))
        print(f"## OpenMP regions per decode step, {args.threads} threads (multi: woke the pool; single: an if "
              f"clause kept it on the calling thread)")
        for b in args.batches:
            for name, path in trees.items():
                r = count(Path(path), shim, b, args.threads, args.steps)
                modules = ", ".join(f"{k} {v:g}" for k, v in sorted(r["by_module"].items()) if v)
                print(f"batch {b}, {name}: {r['multi']:g} multi-thread, {r['single']:g} single-thread ({modules})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
