"""Thinking effort: one internal value, ``off | low | high | max``, from whichever request field set
it (OpenAI ``reasoning_effort``, Anthropic effort mapped by the caller, ``chat_template_kwargs``).
Unknown values are errors (the HTTP layer answers 400), never silently ignored."""

from __future__ import annotations

from typing import Any

EFFORTS = ("off", "low", "high", "max")
DEFAULT_EFFORT = "max"
_OFF = {"off", "none", "disabled"}


def normalize_effort(value: str | bool | None, default: str = DEFAULT_EFFORT) -> str:
    """``None``/``True`` -> ``default``; ``False``/"none"/"disabled" -> "off"; low/high/max as is."""
    if value is None or value is True:
        return default
    if value is False:
        return "off"
    if isinstance(value, str):
        v = value.strip().lower()
        if v in _OFF:
            return "off"
        if v in EFFORTS:
            return v
    raise ValueError(f"unknown thinking effort {value!r}; expected one of {', '.join(EFFORTS)}")


def thinking_effort(
    reasoning_effort: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    default: str = DEFAULT_EFFORT,
) -> str:
    """The effective effort of a request. An explicit switch-off (``thinking``/``enable_thinking``
    false in ``chat_template_kwargs``) wins; otherwise the first effort given among
    ``reasoning_effort``, kwargs ``thinking_effort``/``reasoning_effort``/``thinking`` (a string)."""
    kw = chat_template_kwargs or {}
    for key in ("thinking", "enable_thinking"):
        if kw.get(key) is False:
            return "off"
    candidates = [reasoning_effort, kw.get("thinking_effort"), kw.get("reasoning_effort")]
    if isinstance(kw.get("thinking"), str):
        candidates.append(kw["thinking"])
    for value in candidates:
        if value is not None:
            return normalize_effort(value, default)
    return normalize_effort(None, default)
