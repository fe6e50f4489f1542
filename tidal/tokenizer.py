"""Tokenizers a checkpoint directory can carry: Kimi's tiktoken format (``tiktoken.model`` +
``tokenizer_config.json``) and Hugging Face ``tokenizer.json``, behind one interface.

User text never becomes special tokens: ``encode`` treats special-token strings as plain text
unless ``allow_special=True``; chat templates mark their structural markers explicitly.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
from functools import cached_property
from pathlib import Path

# Kimi's pre-tokenisation pattern (k3-model.md §6.1), in the fancy-regex syntax tiktoken accepts
# (`\p{Han}`, class intersection `&&`). Alternatives, in order: Han runs; words with an optional
# lower-case tail and contraction (two forms: caps optional / caps required); 1-3 digits;
# punctuation runs with trailing newlines; newline-ended whitespace; whitespace before
# whitespace; any whitespace.
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_RESERVED_SPECIAL_TOKENS = 256
# tiktoken's regex engine overflows on huge inputs: encode at most this many chars at a time,
# and cut runs of (non-)whitespace longer than the second limit (as tokenization_kimi.py does).
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000


class Tokenizer:
    """The common interface: ids <-> text, the special tokens by name, and each token's bytes
    (for incremental detokenisation). Subclasses implement ``_encode_ordinary`` and
    ``_build_token_bytes``."""

    special_tokens: dict[str, int]
    config: dict

    # --- subclass hooks -------------------------------------------------------------------
    def _encode_ordinary(self, text: str) -> list[int]:
        raise NotImplementedError

    def _build_token_bytes(self) -> list[bytes]:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def _ordinary_token_id(self, token: str) -> int | None:
        raise NotImplementedError

    # --- shared -------------------------------------------------------------------------------
    @cached_property
    def _token_bytes(self) -> list[bytes]:
        return self._build_token_bytes()

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.special_tokens.values())

    @cached_property
    def _special_re(self) -> re.Pattern | None:
        if not self.special_tokens:
            return None
        names = sorted(self.special_tokens, key=len, reverse=True)
        return re.compile("|".join(re.escape(n) for n in names))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a special token: its name); b"" for ids past the vocab
        (padded embedding rows)."""
        table = self._token_bytes
        return table[token_id] if 0 <= token_id < len(table) else b""

    def token_id(self, token: str) -> int | None:
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self._ordinary_token_id(token)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``. With allow_special=False (user text) special-token strings are
        encoded as ordinary text, never as special ids."""
        if not allow_special or self._special_re is None:
            return self._encode_ordinary(text)
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            ids += self._encode_ordinary(text[pos : m.start()])
            ids.append(self.special_tokens[m.group()])
            pos = m.end()
        return ids + self._encode_ordinary(text[pos:])

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        skip = self.special_ids if skip_special_tokens else ()
        data = b"".join(self.token_bytes(i) for i in ids if i not in skip)
        return data.decode("utf-8", errors="replace")

    def _special_id(self, key: str) -> int | None:
        name = self.config.get(key)
        if isinstance(name, dict):
            name = name.get("content")
        return self.token_id(name) if name else None

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


class TiktokenTokenizer(Tokenizer):
    """Kimi's tokenizer: BPE ranks from ``tiktoken.model`` (lines "base64-token rank"), the
    ``NUM_RESERVED_SPECIAL_TOKENS`` ids after them special, named by ``added_tokens_decoder``
    (unnamed slots become ``<|reserved_token_{id}|>``)."""

    def __init__(self, model_dir: str | Path) -> None:
        import tiktoken

        model_dir = Path(model_dir)
        self.ranks = load_tiktoken_ranks(model_dir / "tiktoken.model")
        self.config = _read_config(model_dir)
        names = {int(k): v["content"] for k, v in self.config.get("added_tokens_decoder", {}).items()}
        n_base = len(self.ranks)
        self.special_tokens = {
            names.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(n_base, n_base + NUM_RESERVED_SPECIAL_TOKENS)
        }
        self._enc = tiktoken.Encoding(
            name=model_dir.name or "kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=self.ranks,
            special_tokens=self.special_tokens,
        )

    @property
    def vocab_size(self) -> int:
        return len(self.ranks) + NUM_RESERVED_SPECIAL_TOKENS

    def _ordinary_token_id(self, token: str) -> int | None:
        return self.ranks.get(token.encode("utf-8"))

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for start in range(0, len(text), MAX_ENCODE_CHARS):
            for piece in split_long_runs(text[start : start + MAX_ENCODE_CHARS], MAX_RUN_CHARS):
                ids += self._enc.encode_ordinary(piece)
        return ids

    def _build_token_bytes(self) -> list[bytes]:
        table = [b""] * self.vocab_size
        for token, rank in self.ranks.items():
            table[rank] = token
        for name, i in self.special_tokens.items():
            table[i] = name.encode("utf-8")
        return table


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """``tiktoken.model``: one "base64(token bytes) rank" pair per line."""
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def save_tiktoken_ranks(path: str | Path, ranks: dict[bytes, int]) -> None:
    """Write ranks in the ``tiktoken.model`` format (lowest rank first)."""
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    Path(path).write_text("\n".join(lines) + "\n")


def split_long_runs(text: str, limit: int) -> list[str]:
    """Cut ``text`` inside runs of whitespace or non-whitespace longer than ``limit`` chars, every
    ``limit`` chars of the run; elsewhere the text stays whole."""
    cuts = [
        cut
        for m in re.finditer(rf"\s{{{limit + 1},}}|\S{{{limit + 1},}}", text)
        for cut in range(m.start() + limit, m.end(), limit)
    ]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level mapping, inverted: printable stand-in char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _decoder_types(spec: dict | None) -> set[str]:
    if not spec:
        return set()
    if spec.get("type") == "Sequence":
        return set().union(*(_decoder_types(d) for d in spec.get("decoders", [])))
    return {spec.get("type", "")}


class HFTokenizer(Tokenizer):
    """encode/decode over a Hugging Face ``tokenizers`` model (``tokenizer.json``)."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        model_dir = Path(model_dir)
        self._tok = RustTokenizer.from_file(str(model_dir / "tokenizer.json"))
        # A second instance that treats special-token strings as plain text (for user text).
        self._plain = RustTokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._plain.encode_special_tokens = True
        self.config = _read_config(model_dir)
        self.special_tokens = {
            t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _ordinary_token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        tok = self._tok if allow_special else self._plain
        return tok.encode(text, add_special_tokens=False).ids

    def _encode_ordinary(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _build_token_bytes(self) -> list[bytes]:
        """Bytes per id from the vocabulary and the decoder kind: byte-level tokens map through
        GPT-2's alphabet; SentencePiece-style tokens map ``▁`` to a space and ``<0xNN>`` to a
        byte; added tokens are their text."""
        kinds = _decoder_types(json.loads(self._tok.to_str()).get("decoder"))
        alphabet = _byte_level_alphabet() if "ByteLevel" in kinds else None
        added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        vocab = self._tok.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocab.values(), default=-1) + 1)
        for token, i in vocab.items():
            if i in added:
                table[i] = added[i].encode("utf-8")
            elif alphabet is not None:
                table[i] = bytes(alphabet[c] for c in token if c in alphabet)
            elif "ByteFallback" in kinds and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                table[i] = bytes([int(token[3:5], 16)])
            else:
                table[i] = token.replace("\u2581", " ").encode("utf-8")
        return table


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer (``tiktoken.model`` preferred, as Kimi ships it), or None when
    it carries none."""
    model_dir = Path(model_dir)
    if (model_dir / "tiktoken.model").exists():
        return TiktokenTokenizer(model_dir)
    if (model_dir / "tokenizer.json").exists():
        return HFTokenizer(model_dir)
    return None
