"""Tokenizers a checkpoint directory can carry: Hugging Face ``tokenizer.json`` (Kimi's tiktoken
format comes with the server work). User text never becomes special tokens."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    """encode/decode over a ``tokenizers`` model, plus the ids of its special tokens."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        # A second instance that treats special-token strings as plain text (for user text).
        self._plain = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._plain.encode_special_tokens = True
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.special_tokens: dict[str, int] = {
            t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

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

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``. With allow_special=False (user text) special-token strings are
        encoded as ordinary text, never as special ids."""
        tok = self._tok if allow_special else self._plain
        return tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it carries none."""
    if (Path(model_dir) / "tokenizer.json").exists():
        return Tokenizer(model_dir)
    return None
