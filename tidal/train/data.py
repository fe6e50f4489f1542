"""Training data every machine has offline: the running interpreter's standard library (whole
modules, and each function as a standalone snippet, often without its docstring), plus synthetic
K3-format conversations with a mask of the assistant's tokens, tokenised into flat streams that
training windows are cut from.

A FIXED list of stdlib modules is held out for evaluation (loss, function-header completion). A
training sequence is a pure function of (seed, step, row), so a resumed run sees exactly the
batches an uninterrupted one would.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from tidal.serve.chat import RenderedPrompt
from tidal.train.code_tasks import code_snippets
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


# ---- function bodies ----------------------------------------------------------------------------------

DOCSTRING_STRIP = 0.7  # share of snippets whose docstring is removed (the body follows the signature)
SPLIT_SPELLING = 0.3  # share tokenised in two pieces at the end of the signature (see FunctionSnippet)
MAX_SNIPPET_LINES = 80


@dataclass(frozen=True)
class FunctionSnippet:
    """One function's source, dedented; ``header`` is its signature through the final ``:``.

    A prompt that ends right after the signature's newline (``def f(x):\n``, as an editor sends it)
    splits what is one token in running text (newline + indentation) into two; snippets encoded as
    ``encode(header + "\n") + encode(rest)`` put that boundary into training."""

    header: str
    body: str  # everything after the header's newline

    @property
    def text(self) -> str:
        return self.header + "\n" + self.body


def function_snippets(sources: dict[str, str], rng: random.Random) -> list[FunctionSnippet]:
    """Every function and method of ``sources`` as a standalone snippet (decorators dropped,
    docstrings dropped from DOCSTRING_STRIP of them), then the coding tasks' functions; a fixed
    shuffle per ``rng``."""
    out: list[FunctionSnippet] = []
    for _, text in sorted(sources.items()):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                snippet = _snippet(node, lines, rng)
                if snippet is not None:
                    out.append(snippet)
    for src in code_snippets(rng):
        header, body = src.split("\n", 1)
        out.append(FunctionSnippet(header, body))
    rng.shuffle(out)
    return out


def _snippet(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str], rng: random.Random) -> FunctionSnippet | None:
    first = node.body[0]
    if first.lineno <= node.lineno or node.end_lineno is None:
        return None  # one-line def
    header = textwrap.dedent("\n".join(lines[node.lineno - 1 : first.lineno - 1])).rstrip()
    if not header.endswith(":") or "#" in header:
        return None
    body_nodes = node.body
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    if is_doc and len(body_nodes) > 1 and rng.random() < DOCSTRING_STRIP:
        body_nodes = body_nodes[1:]
    start = body_nodes[0].lineno
    if getattr(body_nodes[0], "decorator_list", None):
        start = body_nodes[0].decorator_list[0].lineno
    end = min(node.end_lineno, start + MAX_SNIPPET_LINES)
    indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
    body = "\n".join(line[indent:] if line[:indent].isspace() or not line[:indent] else line.lstrip()
                     for line in lines[start - 1 : end])
    return FunctionSnippet(header, body + "\n")


def encode_snippet(tokenizer, snippet: FunctionSnippet, split: bool) -> list[int]:
    if split:
        return tokenizer.encode(snippet.header + "\n") + tokenizer.encode(snippet.body)
    return tokenizer.encode(snippet.text)


# ---- token streams ---------------------------------------------------------------------------------


def assistant_mask(ids: list[int], header: list[int], end: int) -> list[int]:
    """1 for every token the assistant writes (from just after an assistant message's opening
    ``header`` through its closing ``end`` token), 0 elsewhere: system prompt, tool declarations,
    user turns and tool results carry no loss."""
    mask = [0] * len(ids)
    n, i, inside = len(header), 0, False
    while i < len(ids):
        if not inside and ids[i : i + n] == header:
            inside = True
            i += n
            continue
        if inside:
            mask[i] = 1
            if ids[i] == end:
                inside = False
        i += 1
    return mask


def assistant_header(tokenizer) -> list[int]:
    """Token ids of ``<|open|>message role="assistant"<|sep|>`` (what the generation prompt opens)."""
    from tidal.serve.chat.xtml import OPEN, SEP

    sp = tokenizer.special_tokens
    return [sp[OPEN], *tokenizer.encode('message role="assistant"'), sp[SEP]]


@dataclass
class Corpus:
    """Token streams (int32): stdlib code, conversations (with each one's start and a 0/1 mask of
    the assistant's tokens), standalone function snippets (with starts), held-out code.
    Documents are separated by the [EOS] token."""

    code: torch.Tensor
    chat: torch.Tensor
    chat_starts: torch.Tensor
    heldout: torch.Tensor
    chat_mask: Optional[torch.Tensor] = None  # int8, like ``chat``; None: every token is a target
    body: Optional[torch.Tensor] = None
    body_starts: Optional[torch.Tensor] = None

    FIELDS = ("code", "chat", "chat_starts", "heldout", "chat_mask", "body", "body_starts")

    def save(self, path: Path) -> None:
        torch.save({k: getattr(self, k) for k in self.FIELDS if getattr(self, k) is not None}, path)

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


def build_corpus(tokenizer, sources: Sources, chats: list[RenderedPrompt], sep: int,
                 snippets: list[FunctionSnippet] | None = None, seed: int = 0) -> Corpus:
    """Tokenise everything once (``tokenizer`` is a tidal Tokenizer; chat markers become special
    ids, chat text never does). SPLIT_SPELLING of the snippets are encoded in two pieces."""
    code, _ = _stream([tokenizer.encode(t) for _, t in sorted(sources.train.items())], sep)
    held, _ = _stream([tokenizer.encode(t) for _, t in sorted(sources.heldout.items())], sep)
    chat_docs = [c.token_ids(tokenizer) for c in chats]
    chat, starts = _stream(chat_docs, sep)
    header, end = assistant_header(tokenizer), tokenizer.special_tokens["<|end_of_msg|>"]
    mask = [m for ids in chat_docs for m in (*assistant_mask(ids, header, end), 0)]
    corpus = Corpus(code, chat, starts, held, torch.tensor(mask, dtype=torch.int8))
    if snippets:
        rng = random.Random(f"{seed}/split")
        corpus.body, corpus.body_starts = _stream(
            [encode_snippet(tokenizer, s, rng.random() < SPLIT_SPELLING) for s in snippets], sep)
    return corpus


def _doc_window(stream: torch.Tensor, starts: torch.Tensor, n: int, rng: random.Random) -> int:
    """A random document start from which a full window of n tokens fits."""
    last = int(torch.searchsorted(starts, len(stream) - n, right=True))
    return int(starts[rng.randrange(max(1, last))])


COPY_SPAN = (8, 64)  # lengths of the stdlib spans a copy row repeats


def copy_row(code: torch.Tensor, n: int, rng: random.Random, first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A window of n tokens made of stdlib code spans each written twice in a row (``A A B B ...``),
    with targets only on the second writing (its first token excepted: nothing announces it); with
    ``first``, the same window (same ``rng`` state) marked on the first writing instead, for evaluation.

    The model this trains on has no in-context copying: a name written one line above costs it as
    much as a fresh one. Choosing a declared tool and filling its arguments is copying, and so is
    most of code; these rows put a copy target on about half the tokens."""
    ids: list[int] = []
    mask: list[int] = []
    while len(ids) < n:
        k = rng.randint(*COPY_SPAN)
        i = rng.randrange(len(code) - k)
        span = code[i : i + k].tolist()
        ids += span + span
        once, twice = [0] * k, [0] + [1] * (k - 1)
        mask += twice + once if first else once + twice
    return torch.tensor(ids[:n]), torch.tensor(mask[:n])


def sample_batch(
    corpus: Corpus, seed: int, step: int, batch_size: int, seq_len: int, chat_fraction: float,
    body_fraction: float = 0.0, copy_fraction: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([batch_size, seq_len + 1] token windows, their 0/1 target mask) for one step, a pure
    function of (seed, step).

    Each row is a chat window (starting at a conversation's first token, so the tool declaration
    is always in view; targets only the assistant's tokens) with probability ``chat_fraction``, a
    window starting at a function snippet with probability ``body_fraction``, a copy row
    (:func:`copy_row`) with probability ``copy_fraction``, else a random window of stdlib code."""
    rng = random.Random(f"{seed}/{step}")
    rows, masks = [], []
    n = seq_len + 1
    for _ in range(batch_size):
        r = rng.random()
        if r < chat_fraction and len(corpus.chat) > n:
            i = _doc_window(corpus.chat, corpus.chat_starts, n, rng)
            rows.append(corpus.chat[i : i + n])
            masks.append(corpus.chat_mask[i : i + n] if corpus.chat_mask is not None else torch.ones(n))
        elif r < chat_fraction + body_fraction and corpus.body is not None and len(corpus.body) > n:
            i = _doc_window(corpus.body, corpus.body_starts, n, rng)
            rows.append(corpus.body[i : i + n])
            masks.append(torch.ones(n))
        elif r < chat_fraction + body_fraction + copy_fraction:
            row, mask = copy_row(corpus.code, n, rng)
            rows.append(row)
            masks.append(mask)
        else:
            i = rng.randrange(len(corpus.code) - n)
            rows.append(corpus.code[i : i + n])
            masks.append(torch.ones(n))
    return torch.stack(rows).long(), torch.stack(masks).bool()
