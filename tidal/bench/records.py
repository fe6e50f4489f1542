"""What the client records for one request: every streamed chunk with its arrival time, the
server's ``usage`` and the error class. Metrics are computed from these records alone, so a
recorded stream with known timestamps is enough to test every number the bench reports."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Chunk:
    """One SSE message that carried ``choices``.

    t: seconds since the request was sent; content: answer text; reasoning: ``reasoning_content``
    or ``reasoning`` text; tool: streamed tool-call names and arguments; n_tokens: exact token count
    when the server says it (logprobs entries or ``token_ids``), else None."""

    t: float
    content: str = ""
    reasoning: str = ""
    tool: str = ""
    n_tokens: int | None = None

    @property
    def text(self) -> str:
        return self.reasoning + self.content + self.tool

    @property
    def has_token(self) -> bool:
        """A chunk carries output tokens when it has text of any kind or a token count."""
        return bool(self.reasoning or self.content or self.tool or self.n_tokens)

    @property
    def has_answer(self) -> bool:
        """Answer (non-reasoning) output: content text or tool-call text."""
        return bool(self.content or self.tool)


@dataclass
class RequestRecord:
    """One request as the client saw it; ``error_class`` is empty on success."""

    send_time: float = 0.0                  # time.perf_counter() when the request was sent
    chunks: list[Chunk] = field(default_factory=list)
    end: float = 0.0                        # seconds from send to the last line received
    input_len: int = 0                      # prompt tokens as the client built them
    output_len: int = 0                     # max tokens asked for
    prompt_tokens: int | None = None        # usage.prompt_tokens
    completion_tokens: int | None = None    # usage.completion_tokens
    cached_tokens: int | None = None        # usage.prompt_tokens_details.cached_tokens
    tool_calls: list[dict] = field(default_factory=list)  # assembled streamed tool calls
    error_class: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error_class

    @property
    def content(self) -> str:
        return "".join(c.content for c in self.chunks)

    @property
    def reasoning(self) -> str:
        return "".join(c.reasoning for c in self.chunks)
