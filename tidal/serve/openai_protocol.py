"""OpenAI request models (with the vLLM/SGLang extensions bench clients send) and their conversion
to :class:`SamplingParams`.

Requests are validated by pydantic (errors become 400s). Unknown fields are ignored, as
OpenAI-compatible servers do; known fields the engine cannot honour are rejected rather than ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tidal.sampling_params import SamplingParams, StructuredOutputsParams
from tidal.serve.chat.constraints import strict_schema
from tidal.serve.errors import bad_request


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Open(BaseModel):
    """Chat content is handed to the renderer as sent: unknown fields are kept."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionCall(_Open):
    name: str
    arguments: str = ""


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _SamplingFields(_Model):
    """Fields both OpenAI routes share."""

    model: str
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # the sampler's generator takes an int64
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    return_token_ids: bool | None = None  # vLLM: token ids of prompt and reply beside the text
    return_tokens_as_token_ids: bool | None = None  # vLLM: logprobs name tokens "token_id:N"
    prompt_logprobs: int | None = Field(None, ge=-1)  # vLLM: top alternatives per prompt token (-1: all)
    # Token healing (transformers' name) of prompts that end in text: /v1/completions text prompts
    # and a chat's continue_final_message. None: the server's --token-healing.
    token_healing: bool | None = None
    # Constrained output: OpenAI's response_format, vLLM's structured_outputs and older guided_*
    # fields, SGLang's regex / ebnf / json_schema. At most one of them.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None

    def check_supported(self) -> None:
        pass

    def heal(self, server_default: bool) -> bool:
        """Whether a prompt ending in text is token-healed: never under an output constraint (its
        grammar starts where the prompt ends)."""
        wanted = server_default if self.token_healing is None else self.token_healing
        return wanted and self.content_constraint() is None

    def explicit_constraint(self) -> StructuredOutputsParams | None:
        """The grammar asked for by vLLM's or SGLang's fields (not response_format)."""
        found: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs:
            known = {"json", "regex", "choice", "grammar", "json_object"}
            fields = {k: v for k, v in self.structured_outputs.items() if k in known and v not in (None, False)}
            found.append(("structured_outputs", fields))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar"), ("regex", "regex"), ("ebnf", "grammar"),
                          ("json_schema", "json")):
            if getattr(self, name) is not None:
                found.append((name, {key: getattr(self, name)}))
        if not found:
            return None
        if len(found) > 1:
            raise bad_request(f"give one output constraint, got {', '.join(n for n, _ in found)}", found[1][0])
        name, fields = found[0]
        for key in ("regex", "grammar"):
            if key in fields and not isinstance(fields[key], str):
                raise bad_request(f"{name}: {key} must be a string, got {type(fields[key]).__name__}", name)
        try:
            return StructuredOutputsParams(**fields)
        except (TypeError, ValueError) as e:
            raise bad_request(f"{name}: {e}", name) from e

    def content_constraint(self) -> StructuredOutputsParams | None:
        """What the output (a chat reply's response body) must match: ``response_format`` or one
        of the explicit fields."""
        explicit = self.explicit_constraint()
        fmt = response_format_constraint(self.response_format)
        if explicit is not None and fmt is not None:
            raise bad_request("give either response_format or a structured-output field, not both", "response_format")
        return explicit or fmt

    def logit_bias_ids(self) -> dict[int, float] | None:
        """``logit_bias`` with its keys (token ids as JSON strings) as ints."""
        if not self.logit_bias:
            return None
        out: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            try:
                out[int(key)] = bias
            except ValueError:
                raise bad_request(f"logit_bias keys are token ids, got {key!r}", "logit_bias") from None
        return out

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: only together with include_usage (as vLLM reads the pair)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any],
                        *, skip_special_tokens: bool | None = None, prompt_logprobs: int | None = None
                        ) -> SamplingParams:
        """The engine's parameters; ``defaults`` (the checkpoint's generation_config) fill the
        sampling fields the request left out."""

        def pick(name: str, fallback: Any) -> Any:
            v = getattr(self, name)
            return v if v is not None else defaults.get(name, fallback)

        try:
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens,
                temperature=float(pick("temperature", 1.0)),
                top_p=float(pick("top_p", 1.0)),
                top_k=int(pick("top_k", -1)),
                min_p=float(pick("min_p", 0.0)),
                seed=self.seed,
                presence_penalty=float(pick("presence_penalty", 0.0)),
                frequency_penalty=float(pick("frequency_penalty", 0.0)),
                repetition_penalty=float(pick("repetition_penalty", 1.0)),
                logit_bias=self.logit_bias_ids(),
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except ValueError as e:
            raise bad_request(str(e).removeprefix("SamplingParams.")) from e


def response_format_constraint(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format``: text (none), json_object, json_schema (``strict``: objects
    take no undeclared properties)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad_request("response_format.json_schema must be an object with a schema", "response_format")
        schema = spec.get("schema", {})
        return StructuredOutputsParams(json=strict_schema(schema) if spec.get("strict") else schema)
    raise bad_request(f"unsupported response_format type {kind!r}", "response_format")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    thinking: dict[str, Any] | None = None  # the Kimi API's {"type": "enabled" | "disabled"}
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        self.check_stream_options()
        self.check_tool_choice()
        check_continuation(self.continue_final_message, self.add_generation_prompt)

    def check_tool_choice(self) -> None:
        """``tool_choice`` must be satisfiable by ``tools`` (what it makes the model do is the
        sampler's business)."""
        choice, names = self.tool_choice, [t.function.name for t in self.tools or []]
        if choice == "required" and not names:
            raise bad_request('tool_choice "required" needs tools', "tool_choice")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if not name:
                raise bad_request('a tool_choice object must be {"type": "function", "function": {"name": ...}}',
                                  "tool_choice")
            if name not in names:
                raise bad_request(f"tool_choice names function {name!r}, which is not in tools "
                                  f"({', '.join(names) or 'none given'})", "tool_choice")

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as the chat renderers take them (OpenAI-shaped dicts, as sent)."""
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def max_output_tokens(self) -> int | None:
        """``max_completion_tokens`` (what bench clients send) wins over the older ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The output-limit field the request used (error messages name it)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def check_continuation(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """vLLM's rule: a continued final message has no generation prompt after it."""
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true (the continued "
                          "message takes the generation prompt's place): send add_generation_prompt: false",
                          "continue_final_message")


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        self.check_stream_options()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise bad_request("best_of > 1 is not supported", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of text or token-id prompts."""
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        if not out or any(len(x) == 0 for x in out):
            raise bad_request("the prompt is empty", "prompt")
        return out


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


