"""Tokenizers the bench can count with. Token-exact prompts need the server's tokenizer: a local
copy (``tokenizer.json`` via ``tokenizers``, or Kimi's ``tiktoken.model``) or the server's own
``/tokenize`` + ``/detokenize``. Nothing here imports the engine: the bench must work against any
OpenAI-compatible server."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import httpx
import numpy as np

from tidal.bench.text import words

# Kimi's tiktoken split pattern (tokenization_kimi.py ``pat_str``); tiktoken.model files carry
# only the merge ranks, so the pattern has to come from somewhere.
KIMI_PATTERN = "|".join([  # noqa: FLY002 -- the official pattern's list form
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Token ids used for prompts when no tokenizer is known at all: byte tokens in the common
# byte-level vocabularies (printable ASCII in GPT-2/tiktoken/Qwen/tidal order, byte fallbacks in
# SentencePiece), skipping ids 0-2 that SentencePiece reserves for unk/bos/eos.
FALLBACK_ID_RANGE = (3, 94)


class BenchTokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def allowed_ids(self) -> np.ndarray:
        """Ids random prompts may draw from: no special tokens, each decodes to text that
        encodes back to itself."""
        ...


class HFTokenizer:
    """A ``tokenizer.json``; special-token strings in text are encoded as plain text."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        self.name = str(path)
        self._tok = Tokenizer.from_file(str(file))
        self._tok.encode_special_tokens = True
        self._added = set(self._tok.get_added_tokens_decoder())
        self._allowed: np.ndarray | None = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def allowed_ids(self) -> np.ndarray:
        if self._allowed is None:
            ids = [i for i in range(self._tok.get_vocab_size(with_added_tokens=True)) if i not in self._added]
            texts = [self._tok.decode([i]) for i in ids]
            encs = self._tok.encode_batch(texts, add_special_tokens=False)
            keep = [i for i, t, e in zip(ids, texts, encs) if t and "\ufffd" not in t and e.ids == [i]]
            self._allowed = np.asarray(keep, dtype=np.int64)
        return self._allowed

    def chunk_token_counts(self, texts: Sequence[str]) -> list[int]:
        """Tokens of ``"".join(texts)`` falling in each piece (a token belongs to the piece
        holding its last character)."""
        enc = self._tok.encode("".join(texts), add_special_tokens=False)
        return _counts_from_token_ends([end for _, end in enc.offsets], texts)


class TiktokenTokenizer:
    """A Kimi ``tiktoken.model`` (base64 token + rank per line), split with Kimi's pattern."""

    def __init__(self, path: str | Path) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        path = Path(path)
        file = path / "tiktoken.model" if path.is_dir() else path
        self.name = str(path)
        ranks = load_tiktoken_bpe(str(file))
        self._enc = tiktoken.Encoding(name=file.stem, pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                      special_tokens={})
        self._n = len(ranks)
        self._allowed: np.ndarray | None = None

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    def allowed_ids(self) -> np.ndarray:
        if self._allowed is None:
            keep = []
            for i in range(self._n):
                t = self._enc.decode([i])
                if t and "\ufffd" not in t and self._enc.encode_ordinary(t) == [i]:
                    keep.append(i)
            self._allowed = np.asarray(keep, dtype=np.int64)
        return self._allowed

    def chunk_token_counts(self, texts: Sequence[str]) -> list[int]:
        ids = self._enc.encode_ordinary("".join(texts))
        _, starts = self._enc.decode_with_offsets(ids)
        text_len = sum(len(t) for t in texts)
        ends = [s for s in starts[1:]] + [text_len]
        return _counts_from_token_ends(ends, texts)


class ServerTokenizer:
    """The server's ``/tokenize`` and ``/detokenize`` (vLLM and SGLang shapes)."""

    def __init__(self, root_url: str, model: str, headers: dict[str, str] | None = None,
                 timeout: float = 60.0) -> None:
        self.name = f"{root_url}/tokenize"
        self._model = model
        self._http = httpx.Client(base_url=root_url, headers=headers or {}, timeout=timeout)
        self._allowed: np.ndarray | None = None

    @classmethod
    def probe(cls, root_url: str, model: str, headers: dict[str, str] | None = None) -> ServerTokenizer | None:
        """The server's tokenizer if both routes answer and round-trip a short text, else None."""
        tok = cls(root_url, model, headers)
        try:
            ids = tok.encode("hello world")
            ok = bool(ids) and tok.decode(ids).strip() == "hello world"
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            tok.close()
            return None
        return tok

    def encode(self, text: str) -> list[int]:
        r = self._http.post("/tokenize", json={"model": self._model, "prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return [int(i) for i in r.json()["tokens"]]

    def decode(self, ids: Sequence[int]) -> str:
        r = self._http.post("/detokenize", json={"model": self._model, "tokens": [int(i) for i in ids]})
        r.raise_for_status()
        body = r.json()
        return body["prompt"] if "prompt" in body else body["text"]

    def allowed_ids(self) -> np.ndarray:
        """Ids seen when tokenizing a fixed synthetic text: the server tells no vocabulary, and
        these are ordinary-text tokens by construction."""
        if self._allowed is None:
            text = words(np.random.default_rng(0), 4000)
            self._allowed = np.unique(np.asarray(self.encode(text), dtype=np.int64))
        return self._allowed

    def close(self) -> None:
        self._http.close()


def _counts_from_token_ends(ends: Sequence[int], texts: Sequence[str]) -> list[int]:
    bounds, pos = [], 0
    for t in texts:
        pos += len(t)
        bounds.append(pos)
    counts = [0] * len(texts)
    for end in ends:
        i = min(bisect_left(bounds, end), len(texts) - 1)
        counts[i] += 1
    return counts


def load_local_tokenizer(path: str | Path) -> BenchTokenizer:
    """``path``: a model directory holding tokenizer.json or tiktoken.model, or either file."""
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").exists():
            return HFTokenizer(path)
        if (path / "tiktoken.model").exists():
            return TiktokenTokenizer(path)
        raise FileNotFoundError(f"{path} holds neither tokenizer.json nor tiktoken.model")
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path}")
    return TiktokenTokenizer(path) if path.suffix == ".model" else HFTokenizer(path)
