"""Grammars that enforce a chat request's ``tool_choice``, ``tools`` and response format on a
Kimi-K3 (XTML) reply, written in llguidance's Lark.

The reply continues the generation prompt (k3-chat-format.md, "Parsing a reply"): reasoning up to
``close(think)`` when thinking is on, the ``response`` element, an optional ``tools`` element,
``close(message)`` -- after which only a stop token may come. The grammar fixes that skeleton,
so no other markers can appear anywhere:

- ``tool_choice`` none: no ``tools`` element; auto: optional; required: mandatory; a named
  function: exactly one call, of that function. Calls name declared tools only.
- A call's arguments follow the tool's JSON schema: as typed ``argument`` elements (the form the
  renderer writes and the model is trained on) when the schema is an object whose properties
  each have one plain type -- declared properties only, in declared order, the required ones
  present; otherwise as one ``json`` element holding the whole object, checked against the schema.
- The response body is free text, or follows the content constraint (JSON schema / object,
  regex, choice, grammar).

:func:`tool_choice_points` names where the grammar lets the reply write a tool name: the engine
chooses that name by its whole log-probability (tidal.engine.whole_choice), not token by token.
"""

from __future__ import annotations

import json
from typing import Any

from tidal.sampling_params import ChoicePoint, StructuredOutputsParams
from tidal.serve.chat.xtml import CLOSE, OPEN, SEP, escape_attr

# Compact JSON, as the renderer writes tool arguments.
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
READABLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_PLAIN_STRING_KEYS = {"type", "description", "title", "default", "examples"}
_TYPED = {"number": "number", "integer": "number", "boolean": "boolean", "null": "null", "object": "object",
          "array": "array"}


def lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def open_tag(tag: str, attrs: list[tuple[str, str]] = ()) -> str:
    header = tag + "".join(f' {k}="{escape_attr(v)}"' for k, v in attrs)
    return f"{OPEN} {lit(header)} {SEP}"


def close_tag(tag: str) -> str:
    return f"{CLOSE} {lit(tag)} {SEP}"


def inline_json(schema: Any, options: dict[str, Any]) -> str:
    """``%json {...}`` with llguidance's whitespace options folded in."""
    if schema is True or schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
    return "%json " + json.dumps({**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}},
                                 ensure_ascii=False)


def strict_schema(schema: Any) -> Any:
    """``strict`` (OpenAI): objects admit no properties beyond the declared ones unless the
    schema says otherwise."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


class GrammarRules:
    def __init__(self) -> None:
        self.lines: list[str] = ["TEXT: /(?s:.+)/"]  # free text: never a special token
        self.grammars: list[dict[str, Any]] = []

    def add(self, name: str, body: str) -> str:
        self.lines.append(f"{name}: {body}")
        return name

    def tool_block(self, name: str, open_: str, close: str, calls: list[str], mode: str,
                   parallel_tool_calls: bool | None) -> str:
        """``open_``, one call of ``calls`` (several unless a named function or parallel calls
        are off), ``close``: mandatory under required / named, optional under auto."""
        call = self.add("call", " | ".join(calls))
        many = mode != "named" and parallel_tool_calls is not False
        rule = self.add(name, f"{open_} {call}{'+' if many else ''} {close}")
        return rule if mode in ("required", "named") else rule + "?"

    def grammar(self, start: list[str]) -> str:
        """The llguidance grammar (JSON text): ``start`` in sequence, then the rules added."""
        lark = "start: " + " ".join(start) + "\n" + "\n".join(self.lines) + "\n"
        return json.dumps({"grammars": [{"lark_grammar": lark}, *self.grammars]}, ensure_ascii=False)

    def content(self, c: StructuredOutputsParams | None) -> str:
        """The response body rule for a content constraint (free text without one)."""
        if c is None:
            return "TEXT?"
        kind = c.kind
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else c.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
            return self.add("content", inline_json(schema, {"whitespace_flexible": True} if c.whitespace_flexible
                                                   else READABLE))
        if kind == "regex":
            self.lines.append(f"CONTENT_RE: {_regex(c.regex)}")
            return self.add("content", "CONTENT_RE")
        if kind == "choice":
            return self.add("content", " | ".join(lit(x) for x in c.choice))
        if kind == "grammar":
            import llguidance

            try:
                sub = json.loads(llguidance.grammar_from("grammar", c.grammar))
            except ValueError as e:
                raise ValueError(f"the grammar is neither Lark nor GBNF: {e}") from e
            for g in sub["grammars"]:
                g = dict(g)
                g.setdefault("name", "user_grammar")
                self.grammars.append(g)
            return self.add("content", "@" + self.grammars[0]["name"])
        raise ValueError(f"content constraint {kind!r} is not supported in chat")

    def arguments(self, i: int, params: Any, strict: bool) -> str:
        """The arguments of tool ``i``: typed elements when its schema allows, else one json
        element."""
        schema = params if isinstance(params, dict) else {"type": "object"}
        if strict:
            schema = strict_schema(schema)
        props = schema.get("properties") if schema.get("type", "object") == "object" else None
        typed = isinstance(props, dict) and set(schema) <= {"type", "properties", "required", "additionalProperties",
                                                           "description", "title"}
        parts: list[str] = []
        if typed:
            required = set(schema.get("required") or [])
            for j, (key, sub) in enumerate(props.items()):
                value = self._typed_value(f"v{i}_{j}", sub)
                if value is None:
                    typed = False
                    break
                kind, rule = value
                elem = self.add(f"arg{i}_{j}", f"{open_tag('argument', [('key', key), ('type', kind)])} {rule} "
                                               f"{close_tag('argument')}")
                parts.append(elem if key in required else elem + "?")
        if typed:
            return " ".join(parts) if parts else ""
        body = self.add(f"json{i}", inline_json(schema, COMPACT))
        return f"{open_tag('json', [('type', 'object')])} {body} {close_tag('json')}"

    def _typed_value(self, name: str, sub: Any) -> tuple[str, str] | None:
        """(type attribute, value rule) of one property, None when it has no single plain type."""
        if not isinstance(sub, dict):
            return None
        kind = sub.get("type")
        if kind == "string" or (kind is None and "enum" in sub and all(isinstance(v, str) for v in sub["enum"])):
            extra = set(sub) - _PLAIN_STRING_KEYS
            if not extra:
                return "string", "TEXT?"
            if extra == {"enum"} and all(isinstance(v, str) for v in sub["enum"]) and sub["enum"]:
                return "string", self.add(name, " | ".join(lit(v) for v in sub["enum"]))
            return None
        if isinstance(kind, str) and kind in _TYPED:
            return _TYPED[kind], self.add(name, inline_json(sub, COMPACT))
        return None


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool)


def tool_mode(tools: list[dict[str, Any]], tool_choice: Any) -> tuple[str, str | None]:
    """(mode, the named function) of a request: mode none / auto / required / named. ValueError
    naming the problem for a tool_choice naming an undeclared tool or asking for a call with none."""
    names = [function_of(t).get("name") for t in tools]
    wanted = None
    if tool_choice in (None, "auto"):
        mode = "auto" if tools else "none"
    elif tool_choice in ("none", "required"):
        mode = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        mode = "named"
        wanted = (tool_choice.get("function") or {}).get("name")
        if wanted not in names:
            raise ValueError(f"tool_choice names the function {wanted!r}, which is not among the declared tools "
                             f"({', '.join(map(str, names)) or 'none'})")
    else:
        raise ValueError(f"unsupported tool_choice {tool_choice!r}")
    if mode == "required" and not tools:
        raise ValueError('tool_choice "required" needs at least one tool')
    return mode, wanted


def callable_tools(tools: list[dict[str, Any]], mode: str, wanted: str | None) -> list[tuple[int, dict[str, Any]]]:
    """(index, function) of the tools a reply may call in ``mode`` (all, or the named one)."""
    fns = [(i, function_of(t)) for i, t in enumerate(tools)]
    return [(i, fn) for i, fn in fns if mode != "named" or fn.get("name") == wanted]


def constrains_nothing(tools: list[dict[str, Any]] | None, tool_choice: Any,
                       content: StructuredOutputsParams | None) -> bool:
    return not tools and content is None and tool_choice in (None, "auto", "none")


CALL_LEAD = 'call tool="'


def tool_choice_points(tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
                       **_: Any) -> tuple[ChoicePoint, ...]:
    """Where a reply under :func:`reply_grammar` names the tool it calls: after the marker
    that opens a ``call`` element, ``call tool="NAME"`` for each callable tool (the closing
    quote included, so a name that is a prefix of another is scored as itself). None when fewer
    than two tools can be called (nothing to choose)."""
    tools = tools or []
    mode, wanted = tool_mode(tools, tool_choice)
    if mode == "none":
        return ()
    names = list(dict.fromkeys(escape_attr(fn.get("name") or "") for _, fn in callable_tools(tools, mode, wanted)))
    if len(names) < 2:
        return ()
    return (ChoicePoint(OPEN, CALL_LEAD, tuple(n + '"' for n in names)),)


def reply_grammar(*, thinking: bool, tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
                  content: StructuredOutputsParams | None = None, parallel_tool_calls: bool | None = None,
                  strict: bool = False, skeleton: bool = False) -> str | None:
    """The llguidance grammar (JSON text) of a K3 reply under these constraints; None when the
    request constrains nothing (no tools, no content constraint, no tool_choice) unless
    ``skeleton``: then the bare reply's grammar, which holds a reply with no tools declared to
    the format's skeleton (no ``tools`` element: a model cannot call a tool nobody declared).
    ValueError naming the problem for a tool_choice naming an undeclared tool or an unusable schema."""
    tools = tools or []
    if constrains_nothing(tools, tool_choice, content) and not skeleton:
        return None
    mode, wanted = tool_mode(tools, tool_choice)
    r = GrammarRules()
    body = r.content(content)
    seq = []
    if thinking:
        seq += ["TEXT?", close_tag("think"), open_tag("response")]
    seq += [body, close_tag("response")]
    if mode != "none":
        calls = []
        for i, fn in callable_tools(tools, mode, wanted):
            args = r.arguments(i, fn.get("parameters"), strict or bool(fn.get("strict")))
            header = f'{CALL_LEAD}{escape_attr(fn.get("name") or "")}" index="'
            calls.append(r.add(f"call{i}", f'{OPEN} {lit(header)} INDEX "\\"" {SEP} {args} {close_tag("call")}'))
        r.lines.append("INDEX: /[1-9][0-9]{0,2}/")
        seq.append(r.tool_block("tools", open_tag("tools"), close_tag("tools"), calls, mode, parallel_tool_calls))
    seq.append(close_tag("message"))
    return r.grammar(seq)
