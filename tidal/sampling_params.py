"""Per-request sampling parameters, named as vLLM names them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


_KINDS = ("json", "regex", "choice", "grammar", "llguidance")


@dataclass(frozen=True)
class ChoicePoint:
    """A place in a grammar where the reply names one of several given strings (a chat reply's
    tool name): right after the special token ``after``, the text ``lead + option`` for one of
    ``options``. The engine picks the option by the model's log-probability of that whole text
    in its canonical tokenisation (:mod:`tidal.engine.whole_choice`), not token by token, then
    writes it and lets the grammar go on. Token-by-token masking decides at the first token
    where the options differ, which favours an option whose first token is likely on its own."""

    after: str
    lead: str
    options: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.options) < 2 or len(set(self.options)) != len(self.options):
            raise ValueError(f"ChoicePoint needs two or more distinct options, got {list(self.options)!r}")


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate, as vLLM's ``structured_outputs``: exactly one
    of a JSON schema (a dict or its JSON text), any JSON object, a regular expression, one of a
    list of strings, or a grammar (Lark, or GBNF/EBNF as llama.cpp writes it). Compiled by
    :mod:`tidal.engine.grammar` and enforced as a token mask on every step."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # A grammar already in llguidance's JSON form (the server's chat-reply grammars).
    llguidance: str | None = None
    # JSON: no whitespace outside strings (compact, the default) or any JSON whitespace.
    whitespace_flexible: bool = False
    # Where the grammar's alternatives are chosen whole by the model's score (the server's chat
    # reply grammars set them for tool names; clients cannot).
    choice_points: tuple[ChoicePoint, ...] = ()

    def __post_init__(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        for name in _KINDS:
            if getattr(self, name) is not None:
                return name
        return "json_object"


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature=0`` is greedy. ``top_k`` of -1 or 0 and ``top_p=1`` / ``min_p=0`` turn the
    filters off. ``logprobs`` / ``prompt_logprobs``: how many top alternatives to return per
    position (0 = only the chosen token, -1 = the whole vocabulary). ``max_tokens=None`` runs up
    to the model's context limit.

    Penalties, as vLLM: ``repetition_penalty`` (> 0, 1 = off) divides the positive logits and
    multiplies the negative ones of every token in the prompt or the output;
    ``frequency_penalty`` subtracts ``count * value`` and ``presence_penalty`` subtracts ``value``
    from each token already generated. ``logit_bias`` adds to a token's logit (-100..100).
    ``n`` samples per prompt; sample ``i`` of a seeded request uses seed ``seed + i``.

    ``token_healing`` (transformers' name): when the prompt's last token is the start of a longer
    token, prefill without it and make the output start with its bytes; the output's text and
    the request's prompt (ids, count, prompt logprobs) stay as sent. Off when
    ``structured_outputs`` is set (the grammar starts at the prompt's end).
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    token_healing: bool = False
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not is_num(self.temperature) or self.temperature < 0.0:
            raise bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (off) or a positive integer")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "must be a finite number > 0")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not is_int(tok) or tok < 0:
                    raise ValueError(f"SamplingParams.logit_bias: token id {tok!r} is not an integer >= 0")
                if not is_num(bias) or not -100.0 <= bias <= 100.0:
                    raise ValueError(f"SamplingParams.logit_bias: the bias of token {tok} must be in [-100, 100], "
                                     f"got {bias!r}")
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

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` of an ``n > 1`` request: one sample, its own seed."""
        seed = self.seed + index if self.seed is not None else None
        return dataclasses.replace(self, n=1, seed=seed)
