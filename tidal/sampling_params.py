"""Per-request sampling parameters, named as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature=0`` is greedy. ``top_k`` of -1 or 0 and ``top_p=1`` / ``min_p=0`` turn the
    filters off. ``logprobs`` / ``prompt_logprobs``: how many top alternatives to return per
    position (0 = only the chosen token, -1 = the whole vocabulary). ``max_tokens=None`` runs up
    to the model's context limit.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if self.n != 1:
            raise bad("n", "must be 1 (one completion per request)")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < float("inf"):
            raise bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (off) or a positive integer")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < -1):
                raise bad(name, "must be None, -1 (whole vocabulary) or an integer >= 0")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise bad("stop", "must be a non-empty string or a list of them")
        self.stop_strings = stops
        ids = list(self.stop_token_ids or [])
        if any(not is_int(i) or i < 0 for i in ids):
            raise bad("stop_token_ids", "must be a list of token ids >= 0")
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_active(self) -> bool:
        return self.top_k > 0
