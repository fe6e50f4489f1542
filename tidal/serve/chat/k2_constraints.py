"""The grammar that enforces a chat request's ``tool_choice``, ``tools`` and response format on a
Kimi K2 / Kimi Linear reply, in llguidance's Lark (the K3 counterpart is constraints.py).

A K2 reply (after ``<|im_assistant|>assistant<|im_middle|>``) is: ``<think>…</think>`` when
thinking is on and the tokenizer has those special tokens, the content, then an optional tool
section, ended by the stop token ``<|im_end|>``::

    <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|> ...
    <|tool_calls_section_end|>

- ``tool_choice`` none: no section; auto: optional; required: mandatory; a named function:
  exactly one call, of that function. Calls name declared tools only (``functions.NAME:``
  is a literal per tool; IDX runs over the conversation, so any index is allowed).
- A call's arguments are one JSON object following the tool's schema, separators as
  ``json.dumps`` writes them (the renderer writes a mapping's arguments that way).
- With required or a named function the reply holds no content (as OpenAI answers a forced
  call: ``content`` null; a few blanks may come first), unless a content constraint asks for one.
- The content is free text, or follows the content constraint (JSON schema / object, regex,
  choice, grammar).
"""

from __future__ import annotations

from typing import Any

from tidal.sampling_params import StructuredOutputsParams
from tidal.serve.chat.constraints import (
    READABLE,
    GrammarRules,
    callable_tools,
    constrains_nothing,
    inline_json,
    lit,
    strict_schema,
    tool_mode,
)
from tidal.serve.chat.k2 import (
    ARG_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    THINK_CLOSE,
    THINK_OPEN,
)


def k2_reply_grammar(*, thinking: bool, tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
                     content: StructuredOutputsParams | None = None, parallel_tool_calls: bool | None = None,
                     strict: bool = False) -> str | None:
    """The llguidance grammar (JSON text) of a K2 reply under these constraints; None when the
    request constrains nothing. ``thinking``: the reply may open with ``<think>…</think>``
    (special tokens). ValueError naming the problem as for K3."""
    tools = tools or []
    if constrains_nothing(tools, tool_choice, content):
        return None
    mode, wanted = tool_mode(tools, tool_choice)
    r = GrammarRules()
    seq = []
    if thinking:
        seq.append(r.add("think", f"{THINK_OPEN} TEXT? {THINK_CLOSE}") + "?")
    forced = mode in ("required", "named")
    if content is not None or not forced:
        seq.append(r.content(content))
    else:
        r.lines.append("BLANK: /[ \\t\\r\\n]{1,4}/")
        seq.append("BLANK?")
    if mode != "none":
        calls = []
        for i, fn in callable_tools(tools, mode, wanted):
            schema = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {"type": "object"}
            if strict or fn.get("strict"):
                schema = strict_schema(schema)
            args = r.add(f"args{i}", inline_json(schema, READABLE))
            header = lit("functions." + (fn.get("name") or "") + ":")
            calls.append(r.add(f"call{i}", f"{CALL_BEGIN} {header} INDEX {ARG_BEGIN} {args} {CALL_END}"))
        r.lines.append("INDEX: /[0-9]{1,4}/")
        seq.append(r.tool_block("section", SECTION_BEGIN, SECTION_END, calls, mode, parallel_tool_calls))
    return r.grammar(seq)
