"""Training data every machine has offline: the running interpreter's standard library, plus
synthetic K3-format conversations, tokenised into flat streams that training windows are cut from.

A FIXED list of stdlib modules is held out for evaluation (loss, function-header completion). A
training sequence is a pure function of (seed, step, row), so a resumed run sees exactly the
batches an uninterrupted one would.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from tidal.serve.chat import RenderedPrompt
from tidal.train.conversations import DocFact, training_conversations

# Held out from training, used only by evaluation. Plain-Python modules present in every CPython >= 3.9.
HELDOUT_MODULES = (
    "bisect", "colorsys", "fnmatch", "fractions", "graphlib", "heapq", "netrc", "sched", "shlex",
    "statistics", "textwrap", "queue",
)
# Directories that are not the library itself (installed packages, test suites, codec tables, data).
EXCLUDED_DIRS = {
    "site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "ensurepip",
    "lib-dynload", "turtledemo", "pydoc_data",
}
MAX_FILE_BYTES = 400_000


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The stdlib's own .py files, sorted (tests, installed packages and generated tables excluded)."""
    root = root or stdlib_dir()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in EXCLUDED_DIRS or p.startswith("config-") for p in rel[:-1]):
            continue
        if rel[-1].startswith("_sysconfigdata") or path.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(path)
    return out


def is_heldout(module: str) -> bool:
    return module.split(".")[0] in HELDOUT_MODULES


def read_source(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


@dataclass
class Sources:
    """Stdlib source texts by module name, split into training and held-out modules."""

    train: dict[str, str]
    heldout: dict[str, str]


def load_sources(root: Path | None = None) -> Sources:
    root = root or stdlib_dir()
    train: dict[str, str] = {}
    heldout: dict[str, str] = {}
    for path in stdlib_files(root):
        text = read_source(path)
        if text is None:
            continue
        name = module_name(path, root)
        (heldout if is_heldout(name) else train)[name] = text
    return Sources(train, heldout)


def doc_facts(sources: dict[str, str]) -> list[DocFact]:
    """Public documented functions (module level and methods of public classes) of ``sources``,
    with their signature and the first line of their docstring."""
    facts = []
    for module, text in sorted(sources.items()):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node, owner in _functions(tree):
            doc = ast.get_docstring(node)
            if not doc or node.name.startswith("_"):
                continue
            summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
            if not 10 <= len(summary) <= 200:
                continue
            args = ast.unparse(node.args)
            name = f"{owner}.{node.name}" if owner else node.name
            facts.append(DocFact(module, name, f"{name}({args})", summary))
    return facts


def _functions(tree: ast.Module) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, ""
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield sub, node.name


def conversation_prompts(seed: int, n: int, sources: Sources) -> list[RenderedPrompt]:
    """The rendered training conversations (docstring questions come from the training modules)."""
    convs = training_conversations(random.Random(seed), n, doc_facts(sources.train))
    return [c.render() for c in convs]


# ---- token streams ---------------------------------------------------------------------------------


@dataclass
class Corpus:
    """Token streams (int32): stdlib code, conversations (with each one's start), held-out code.
    Documents are separated by the [EOS] token."""

    code: torch.Tensor
    chat: torch.Tensor
    chat_starts: torch.Tensor
    heldout: torch.Tensor

    def save(self, path: Path) -> None:
        torch.save({k: getattr(self, k) for k in ("code", "chat", "chat_starts", "heldout")}, path)

    @classmethod
    def load(cls, path: Path) -> "Corpus":
        return cls(**torch.load(path))

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """Training-token frequencies (the unigram baseline)."""
        both = torch.cat([self.code, self.chat]).long()
        return torch.bincount(both, minlength=vocab_size)


def _stream(docs: list[list[int]], sep: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts, flat = [], []
    for ids in docs:
        starts.append(len(flat))
        flat.extend(ids)
        flat.append(sep)
    return torch.tensor(flat, dtype=torch.int32), torch.tensor(starts, dtype=torch.int64)


def build_corpus(tokenizer, sources: Sources, chats: list[RenderedPrompt], sep: int) -> Corpus:
    """Tokenise everything once (``tokenizer`` is a tidal Tokenizer; chat markers become special
    ids, chat text never does)."""
    code, _ = _stream([tokenizer.encode(t) for _, t in sorted(sources.train.items())], sep)
    held, _ = _stream([tokenizer.encode(t) for _, t in sorted(sources.heldout.items())], sep)
    chat, starts = _stream([c.token_ids(tokenizer) for c in chats], sep)
    return Corpus(code, chat, starts, held)


def sample_batch(
    corpus: Corpus, seed: int, step: int, batch_size: int, seq_len: int, chat_fraction: float
) -> torch.Tensor:
    """[batch_size, seq_len + 1] token windows for one step, a pure function of (seed, step).

    Each row is a chat window (starting at a conversation's first token, so the tool declaration
    is always in view) with probability ``chat_fraction``, else a random window of stdlib code."""
    rng = random.Random(f"{seed}/{step}")
    rows = []
    n = seq_len + 1
    for _ in range(batch_size):
        if rng.random() < chat_fraction and len(corpus.chat) > n:
            starts = corpus.chat_starts
            last = int(torch.searchsorted(starts, len(corpus.chat) - n, right=True))
            i = int(starts[rng.randrange(max(1, last))])
            rows.append(corpus.chat[i : i + n])
        else:
            i = rng.randrange(len(corpus.code) - n)
            rows.append(corpus.code[i : i + n])
    return torch.stack(rows).long()
