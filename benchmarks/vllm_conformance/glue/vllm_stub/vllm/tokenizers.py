"""`get_tokenizer(name)`: the served model's tokenizer, whatever checkpoint name a test asks for.

Every test model name is served by the same tidal checkpoint (TIDAL_HARNESS_MODEL_DIR), so the
tokenizer a test compares the server against is that checkpoint's, loaded through transformers.
"""

from __future__ import annotations

import functools
import os


@functools.cache
def _load(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def get_tokenizer(tokenizer_name: str = "", *args, **kwargs):
    return _load(os.environ["TIDAL_HARNESS_MODEL_DIR"])
