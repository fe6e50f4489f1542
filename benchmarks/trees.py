"""Run a benchmark script from several source trees in one command, alternating, so that two
versions are compared under the same (shared, swinging) machine load: each tree's script runs
once per round, the trees in their order, reversed in every other round (each tree is as often
early as late).

A tree is ``name=PATH`` (a checkout) or ``name=git:REV`` (the revision's tracked files, written
with ``git archive`` into a temporary folder that is removed afterwards; REV is read in this
script's repository). The C kernels need no rebuild per tree beyond their own source:
compiled ones are cached by a hash of the source (:mod:`tidal.ops.cpu_kernels`).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option`` and the values that follow it (up to the next ``--`` option)."""
    if option not in argv:
        return list(argv)
    i = argv.index(option)
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return argv[:i] + argv[j:]


def checkout(spec: str, stack: ExitStack) -> tuple[str, Path]:
    """(name, root) of a tree given as ``name=PATH`` or ``name=git:REV``."""
    name, sep, where = spec.partition("=")
    if not sep or not name or not where:
        raise SystemExit(f"--trees wants name=PATH or name=git:REV, got {spec!r}")
    if not where.startswith("git:"):
        root = Path(where).resolve()
        if not root.is_dir():
            raise SystemExit(f"--trees {spec}: {root} is not a folder")
        return name, root
    rev = where[4:]
    try:
        blob = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"--trees {spec}: git archive {rev} failed: {e.stderr.decode().strip()}") from None
    root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"tree-{name}-")))
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(root, filter="data")
    return name, root


def run_trees(script: str, argv: list[str], trees: list[str], rounds: int) -> dict[str, list[str]]:
    """Run ``benchmarks/<script>`` with ``argv`` (its --trees and --rounds removed) from each tree,
    ``rounds`` times alternating; echo each run's output and return its lines per tree name."""
    argv = without_option(without_option(argv, "--trees"), "--rounds")
    out: dict[str, list[str]] = {}
    with ExitStack() as stack:
        roots = [checkout(t, stack) for t in trees]
        for r in range(rounds):
            for name, root in roots if r % 2 == 0 else roots[::-1]:
                print(f"== {name} ({root}), round {r + 1}, load average {os.getloadavg()[0]:.1f}", flush=True)
                got = subprocess.run([sys.executable, str(root / "benchmarks" / script), *argv], cwd=root,
                                     env={**os.environ, "PYTHONPATH": str(root)}, check=True,
                                     stdout=subprocess.PIPE, text=True).stdout
                print(got, end="", flush=True)
                out.setdefault(name, []).extend(got.splitlines())
    return out
