"""`ModelConfig(model=...)`, as far as the entrypoint tests use it: the served checkpoint's vocabulary size.

Every test model name is served by the harness's one checkpoint, so whatever `model` a test
names, the figures are that checkpoint's (TIDAL_HARNESS_MODEL_DIR/config.json).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class ModelConfig:
    def __init__(self, model: str = "", **kwargs: Any) -> None:
        self.model = model
        self.hf_config = json.loads((Path(os.environ["TIDAL_HARNESS_MODEL_DIR"]) / "config.json").read_text())

    def get_vocab_size(self) -> int:
        text = self.hf_config.get("text_config", self.hf_config)
        return int(text["vocab_size"])
