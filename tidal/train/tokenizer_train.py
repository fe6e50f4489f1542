"""Byte-level BPE tokenizer trained with the ``tokenizers`` library, carrying K3's special tokens.

Saved as ``tokenizer.json`` + ``tokenizer_config.json``, the files :mod:`tidal.tokenizer` loads.
Byte-level means every string encodes (no unknown token is ever produced); the GPT-2 split
pattern keeps runs of spaces together, so Python indentation becomes single tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tidal.embedded import K3_SPECIAL_TOKENS  # ids 0..14, in this order

DEFAULT_VOCAB_SIZE = 8192


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """BPE over bytes, ``vocab_size`` tokens in all (specials included). Deterministic for a
    given text sequence."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=K3_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 8192) -> Path:
    """Write tokenizer.json and tokenizer_config.json (stop token <|end_of_msg|>, as K3)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "[BOS]", "eos_token": "<|end_of_msg|>", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "model_max_length": model_max_length,
    }, indent=2))
    return out
