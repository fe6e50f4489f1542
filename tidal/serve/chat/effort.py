"""Thinking effort: one internal value, ``off | low | high | max`` (the levels K3's format renders),
from whichever request field set it. Every value the OpenAI, Anthropic and Kimi APIs use is mapped
by one table; anything else is an error (the HTTP layer answers 400), never silently ignored.

| request value                                   | K3 effort |
|-------------------------------------------------|-----------|
| ``none``, ``off``, ``disabled``, ``false``       | off       |
| ``minimal``, ``low``                            | low       |
| ``medium``, ``high``                            | high      |
| ``xhigh``, ``max``                              | max       |
| Anthropic ``budget_tokens`` < 4096              | low       |
| Anthropic ``budget_tokens`` 4096 .. 16383       | high      |
| Anthropic ``budget_tokens`` >= 16384            | max       |

The renderer itself (:func:`normalize_effort`) takes only the K3 levels, as Kimi-K3.jinja does:
``medium`` never reaches the prompt as such.
"""

from __future__ import annotations

from typing import Any

EFFORTS = ("off", "low", "high", "max")
DEFAULT_EFFORT = "max"  # K3's format: thinking on at max unless the request says otherwise
REQUEST_EFFORTS = {
    "none": "off", "off": "off", "disabled": "off", "false": "off",
    "minimal": "low", "low": "low",
    "medium": "high", "high": "high",
    "xhigh": "max", "max": "max",
}
BUDGET_LOW_BELOW = 4096
BUDGET_HIGH_BELOW = 16384


def normalize_effort(value: str | bool | None, default: str = DEFAULT_EFFORT) -> str:
    """The renderer's input: ``None``/``True`` -> ``default``; ``False``/"none"/"disabled" -> "off";
    low/high/max as is; anything else (``medium`` included) is a ValueError."""
    if value is None or value is True:
        return default
    if value is False:
        return "off"
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("off", "none", "disabled"):
            return "off"
        if v in EFFORTS:
            return v
    raise ValueError(f"unknown thinking effort {value!r}; expected one of {', '.join(EFFORTS)}")


def request_effort(value: str | bool | None, default: str = DEFAULT_EFFORT) -> str:
    """A request's effort value (any API's vocabulary, see the table) as a K3 level."""
    if value is None or value is True:
        return default
    if value is False:
        return "off"
    if isinstance(value, str) and value.strip().lower() in REQUEST_EFFORTS:
        return REQUEST_EFFORTS[value.strip().lower()]
    raise ValueError(f"unknown reasoning effort {value!r}; expected one of {', '.join(REQUEST_EFFORTS)}")


def budget_effort(budget_tokens: int) -> str:
    """Anthropic's ``thinking.budget_tokens`` as a K3 level."""
    if budget_tokens < BUDGET_LOW_BELOW:
        return "low"
    return "high" if budget_tokens < BUDGET_HIGH_BELOW else "max"


def thinking_effort(
    reasoning_effort: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    default: str = DEFAULT_EFFORT,
    thinking: dict[str, Any] | None = None,
) -> str:
    """The effective effort of a chat request. An explicit switch-off wins (``thinking`` /
    ``enable_thinking`` false in ``chat_template_kwargs``, or the Kimi API's
    ``thinking: {"type": "disabled"}``); otherwise the first effort given among
    ``reasoning_effort``, kwargs ``thinking_effort``/``reasoning_effort``/``thinking`` (a string);
    otherwise ``default``."""
    kw = chat_template_kwargs or {}
    for key in ("thinking", "enable_thinking"):
        if kw.get(key) is False:
            return "off"
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind == "disabled":
            return "off"
        if kind not in ("enabled", "adaptive", "auto"):
            raise ValueError(f"unknown thinking type {kind!r}; expected enabled or disabled")
    candidates = [reasoning_effort, kw.get("thinking_effort"), kw.get("reasoning_effort")]
    if isinstance(kw.get("thinking"), str):
        candidates.append(kw["thinking"])
    for value in candidates:
        if value is not None:
            return request_effort(value, default)
    return normalize_effort(None, default)
