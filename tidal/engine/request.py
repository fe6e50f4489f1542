"""A request's state inside the engine, and the vLLM-shaped outputs it produces."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.detokenizer import Detokenizer
from tidal.engine.metrics import RequestMetrics
from tidal.sampling_params import SamplingParams


class RequestTooLongError(ValueError):
    """A request that can never fit (context limit or the whole pool); rejected before acceptance."""


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_queued_requests`` already: try again later (HTTP 503)."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    """As vLLM: the log-probability of a token, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)


@dataclass(frozen=True)
class ImageItem:
    """One image of a prompt: its placeholder tokens start at ``offset``; ``image`` is the
    preprocessed input (``tidal.multimodal.ImageInput``: patches, grid, num_tokens, hash)."""

    offset: int
    image: Any

    @property
    def length(self) -> int:
        return self.image.num_tokens

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def key(self) -> int:
        """The prefix cache's stand-in for this image's placeholder ids: negative, so it never
        equals a token id, and different for different pixels."""
        return -1 - int(self.image.hash[:15], 16)


@dataclass
class Request:
    """One request: its tokens, how far the cache has computed them, and what it has produced.

    ``token_ids`` is prompt + generated. After a preemption ``num_computed_tokens`` drops to 0 and
    the whole of ``token_ids`` is prefilled again (recompute, from a prefix cache hit when there is
    one), so the output continues unchanged. ``num_cached_tokens``: prompt tokens the prefix cache
    served at first admission.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_tokens: int  # completion tokens: params.max_tokens, or what the context limit leaves
    prompt: str | None = None
    generator: torch.Generator | None = None
    detokenizer: Detokenizer | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""
    # What the next tokens may be (tidal.engine.grammar.TokenConstraint), None when free.
    constraint: Any = None
    # Set on the first sample of an n > 1 request: its prefill also ends (and the prefix cache
    # snapshots the state) here, one token short of the prompt, so its siblings start from it.
    fork_depth: int | None = None
    images: list[ImageItem] = field(default_factory=list)
    # Token healing: the prompt's last token as sent, left out of ``prompt_token_ids`` (which the
    # engine runs) and regenerated under a PrefixConstraint; outputs report the prompt as sent.
    # The first generated tokens that lie wholly inside its bytes only re-spell the prompt: they
    # are not completion tokens (outputs, usage, max_tokens and min_tokens leave them out).
    healed_token_id: int | None = None
    num_healing_tokens: int = 0
    _prompt_key: list[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def sent_prompt_token_ids(self) -> list[int]:
        """The prompt as the client sent it (before token healing backed it off)."""
        healed = [] if self.healed_token_id is None else [self.healed_token_id]
        return [*self.prompt_token_ids, *healed]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        """Output tokens past the prompt as sent (not those re-spelling a healed prompt's end)."""
        return self.num_output_tokens - self.num_healing_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def cache_key(self, k: int | None = None) -> list[int]:
        """The first ``k`` (default all) tokens as the prefix cache keys them: the token ids, with
        each image's placeholders replaced by that image's key (the same placeholder ids with
        different pixels must never share cached KV)."""
        if not self.images:
            return self.token_ids if k is None else self.token_ids[:k]
        if self._prompt_key is None:
            key = list(self.prompt_token_ids)
            for item in self.images:
                key[item.offset : item.end] = [item.key] * item.length
            self._prompt_key = key
        full = self._prompt_key + self.token_ids[len(self._prompt_key):]
        return full if k is None else full[:k]

    def banned_tokens(self) -> tuple[int, ...]:
        """Tokens that may not be sampled now: the stop tokens until ``min_tokens`` are out."""
        if self.num_completion_tokens >= self.params.min_tokens:
            return ()
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return tuple(eos) + tuple(self.params.stop_token_ids or ())

    def prompt_logprob_positions(self, start: int, count: int) -> list[int]:
        """Positions t in [start, start+count) whose logits score prompt token t+1 and are still
        missing from ``prompt_logprobs`` (a recompute after preemption skips the ones it has)."""
        if self.prompt_logprobs is None:
            return []
        lo = max(start, len(self.prompt_logprobs) - 1)
        hi = min(start + count, self.num_prompt_tokens - 1)
        return list(range(lo, hi))

    def append_token(self, token_id: int) -> None:
        """Record a sampled token and decide whether the request is finished."""
        self.token_ids.append(token_id)
        p = self.params
        is_eos = not p.ignore_eos and token_id in self.eos_token_ids
        is_stop = token_id in (p.stop_token_ids or ())
        if is_eos or is_stop:  # never inside min_tokens: the sampler bans them there
            # The stop token's text is not part of the output (as vLLM).
            self._finish("stop", token_id if is_stop else None)
            return
        if self.detokenizer is not None:
            before = len(self.text)
            self.detokenizer.add(token_id)
            self.text = self.detokenizer.text
            if p.stop_strings and self.num_completion_tokens > p.min_tokens and self._check_stop_strings(before):
                return
        if self.num_completion_tokens >= self.max_tokens:
            self._finish("length", None)

    def _check_stop_strings(self, before: int) -> bool:
        best: tuple[int, str] | None = None
        for s in self.params.stop_strings:
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
        self._finish("stop", s)
        return True

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        if self.detokenizer is not None and not isinstance(stop_reason, str):
            self.detokenizer.flush()  # bytes of an unfinished character come out as U+FFFD
            self.text = self.detokenizer.text
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def abort(self) -> None:
        self._finish("abort", None)

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.text,
            token_ids=self.output_token_ids[self.num_healing_tokens:],
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs[self.num_healing_tokens:] if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.sent_prompt_token_ids,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            outputs=[completion],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
        )

