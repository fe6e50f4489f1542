"""Seeded synthetic text shaped like what a coding agent reads: prose, code, grep hits, test logs,
directory listings. Realistic shape matters for tokenization (code tokenizes denser than prose);
the words themselves are filler."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

WORDS = (
    "the", "a", "of", "to", "in", "and", "is", "that", "for", "it", "on", "with", "as", "this", "be", "by",
    "are", "from", "or", "an", "at", "not", "was", "can", "which", "function", "value", "return", "type",
    "file", "error", "test", "data", "model", "request", "server", "token", "cache", "state", "update", "check",
    "list", "index", "key", "config", "path", "module", "class", "method", "object", "string",
    "number", "buffer", "stream", "output", "input", "result", "handle", "parse", "build", "run", "load",
    "save", "open", "close", "read", "write", "start", "stop", "step", "batch", "layer", "shape", "memory",
    "device", "queue", "worker", "thread", "lock", "event", "signal", "should", "must", "will", "would",
    "could", "may", "might", "when", "then", "else", "while", "after", "before", "because", "since", "first",
    "last", "next", "previous", "new", "old", "current", "default", "empty", "full", "valid", "invalid",
    "missing", "extra", "user", "agent", "tool", "call", "message", "reply", "prompt", "context", "window",
    "length", "limit", "size", "count", "total",
)

IDENTS = (
    "get", "set", "make", "load", "save", "parse", "build", "check", "update", "compute", "apply", "merge",
    "split", "fetch", "send", "handle", "validate", "resolve", "render", "flush", "reset", "init", "close",
    "open", "read", "write", "run", "step", "user", "config", "cache", "token", "request", "response", "batch",
    "layer", "state", "buffer", "path", "item", "node", "index", "key", "value", "result", "error", "stream",
    "queue", "worker", "session", "context", "model", "engine",
)

DIRS = ("src", "lib", "core", "utils", "api", "server", "engine", "models", "tests", "cli", "io")
EXTS = (".py", ".py", ".py", ".ts", ".rs", ".go", ".md", ".json", ".yaml")
TYPES = ("int", "str", "float", "bool", "list[int]", "dict[str, Any]", "Path", "None", "bytes")


def _pick(rng: np.random.Generator, seq) -> str:
    return seq[int(rng.integers(len(seq)))]


def ident(rng: np.random.Generator) -> str:
    return f"{_pick(rng, IDENTS)}_{_pick(rng, IDENTS)}"


def path(rng: np.random.Generator) -> str:
    depth = int(rng.integers(1, 4))
    return "/".join(_pick(rng, DIRS) for _ in range(depth)) + f"/{ident(rng)}{_pick(rng, EXTS)}"


def words(rng: np.random.Generator, n: int) -> str:
    """n words of prose with sentence punctuation."""
    out = []
    for i in range(n):
        w = _pick(rng, WORDS)
        out.append(w.capitalize() if i == 0 or out[-1].endswith(".") else w)
        if rng.random() < 0.08:
            out[-1] += "."
        elif rng.random() < 0.05:
            out[-1] += ","
    return " ".join(out) + "."


def code_line(rng: np.random.Generator) -> str:
    indent = "    " * int(rng.integers(0, 3))
    kind = int(rng.integers(6))
    a, b = ident(rng), ident(rng)
    if kind == 0:
        return f"{indent}def {a}(self, {b}: {_pick(rng, TYPES)}) -> {_pick(rng, TYPES)}:"
    if kind == 1:
        return f"{indent}{a} = self.{b}({ident(rng)}, {int(rng.integers(1000))})"
    if kind == 2:
        return f"{indent}if {a} is None or len({b}) > {int(rng.integers(64))}:"
    if kind == 3:
        return f"{indent}return {a}[{int(rng.integers(16))}] + {b}"
    if kind == 4:
        return f"{indent}# {words(rng, int(rng.integers(4, 12)))}"
    return f"{indent}for {a} in {b}:"


def code(rng: np.random.Generator, n_lines: int) -> str:
    """A numbered source listing, as a file-reading tool returns it."""
    start = int(rng.integers(1, 400))
    return "\n".join(f"{start + i:>5}\t{code_line(rng)}" for i in range(n_lines))


def grep_hits(rng: np.random.Generator, n_lines: int) -> str:
    return "\n".join(f"{path(rng)}:{int(rng.integers(1, 2000))}:{code_line(rng).strip()}" for _ in range(n_lines))


def test_log(rng: np.random.Generator, n_lines: int) -> str:
    lines = []
    for _ in range(n_lines):
        r = rng.random()
        if r < 0.7:
            lines.append(f"{path(rng)}::test_{ident(rng)} {'PASSED' if rng.random() < 0.85 else 'FAILED'}")
        elif r < 0.85:
            lines.append(f'  File "{path(rng)}", line {int(rng.integers(1, 900))}, in {ident(rng)}')
        else:
            lines.append(f"E   AssertionError: {words(rng, int(rng.integers(3, 10)))}")
    return "\n".join(lines)


def listing(rng: np.random.Generator, n_lines: int) -> str:
    return "\n".join(path(rng) for _ in range(n_lines))


def sized(gen: Callable[[np.random.Generator, int], str], rng: np.random.Generator, n_chars: int) -> str:
    """Output of a line generator grown to about ``n_chars`` characters, cut at a line end."""
    parts: list[str] = []
    total = 0
    while total < n_chars:
        part = gen(rng, 8)
        parts.append(part)
        total += len(part) + 1
    text = "\n".join(parts)
    if len(text) > n_chars:
        cut = text.rfind("\n", 0, n_chars)
        text = text[: cut if cut > 0 else n_chars]
    return text
