"""Synthetic K3-format conversations for training and evaluating the embedded model.

Two kinds, both as OpenAI-style message dicts rendered by the server's K3 chat renderer
(tidal.serve.chat), so training prompts are exactly what the server sends:

- questions answered after a think channel: what a standard-library function does (from its
  docstring), arithmetic, small coding tasks;
- tool-use dialogues: 2-4 declared tools, a user request, an assistant turn that thinks and calls
  one tool with typed arguments, the tool's result, and a final answer built from it; over nine
  named tools, and over the combinatorial pool of tidal.train.tool_pool (hundreds of tools, the
  right one decided by the request's words, short thoughts).

Entity pools (cities, people, ticker symbols, ...) are split: held-out tool prompts only use values
the training dialogues never contain, so the tool-call metric measures the format, not recall.
Everything is a pure function of a ``random.Random``: the same seed gives the same conversations.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from tidal.serve.chat import K3Format, RenderedPrompt
from tidal.train.code_tasks import CODE_TASKS
from tidal.train.tool_pool import PEOPLE as POOL_PEOPLE, TITLES, TRAIN_OBJECTS, VERBS, PoolTool, split_pool, pool_exchanges, pool_messages

# Thinking efforts the conversations are rendered with, "low" (the embedded model's default) twice.
EFFORTS = ("max", "high", "low", "low", "off")

# ---- value pools: (train, held-out) --------------------------------------------------------------

CITIES = (
    ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Lima", "Cairo", "Delhi", "Seoul",
     "Sydney", "Toronto", "Chicago", "Boston", "Dublin", "Vienna", "Prague", "Lisbon", "Athens", "Nairobi",
     "Bangkok", "Hanoi", "Manila", "Jakarta", "Santiago", "Bogota", "Quito", "Havana", "Warsaw", "Zurich",
     "Munich", "Hamburg", "Osaka", "Kyoto", "Denver", "Austin", "Seattle", "Miami", "Phoenix"],
    ["Helsinki", "Montreal", "Casablanca", "Reykjavik", "Auckland", "Marseille", "Porto", "Krakow"],
)
PEOPLE = (
    ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory", "oscar",
     "peggy", "rupert", "sybil", "trent", "victor", "walter", "yusuf", "zoe"],
    ["nadia", "quentin", "ursula", "xavier", "wendy", "kofi"],
)
TIMEZONES = (
    ["Europe/Paris", "Europe/London", "Asia/Tokyo", "America/New_York", "America/Chicago", "Asia/Kolkata",
     "Australia/Sydney", "Europe/Berlin", "America/Los_Angeles", "Africa/Cairo", "Asia/Seoul", "UTC"],
    ["America/Sao_Paulo", "Asia/Singapore", "Europe/Madrid", "Pacific/Auckland"],
)
SYMBOLS = (
    ["ACME", "GLOBX", "INITEC", "UMBR", "HOOLI", "WAYNE", "STARK", "CYBD", "PIEDP", "VANDL", "OSCP", "TYRL"],
    ["MASSV", "SOYLN", "BLUTH", "ZORG"],
)
LANGUAGES = (
    ["French", "German", "Spanish", "Italian", "Japanese", "Portuguese", "Dutch", "Swedish"],
    ["Finnish", "Polish", "Korean"],
)
PHRASES = (
    ["good morning", "thank you very much", "where is the station", "the meeting is at noon",
     "see you tomorrow", "the file is ready", "happy birthday", "how much does it cost"],
    ["the train is late", "please close the door", "welcome to the team"],
)
TOPICS = (
    ["the quarterly report", "lunch on Friday", "the release plan", "the server outage", "a code review",
     "the budget", "the team offsite", "the new laptop"],
    ["the hiring plan", "the demo video", "the roadmap"],
)
REMINDERS = (
    ["call the bank", "water the plants", "stretch", "check the oven", "join the standup", "send the invoice",
     "take a break", "back up the laptop"],
    ["feed the cat", "renew the passport", "buy coffee"],
)
DIRS = (
    ["src", "docs", "tests", "data", "build", "scripts", "notes", "assets", "config", "logs"],
    ["vendor", "examples", "tmp"],
)
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "SEK", "INR", "CNY"]


# ---- tools -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    """One tool use: the request, the call's arguments, the tool's result and the final answer."""

    request: str
    think: str
    arguments: dict[str, Any]
    result: dict[str, Any]
    answer: str


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    params: dict[str, tuple[str, str]]  # name -> (JSON-schema type, description)
    required: tuple[str, ...]
    make: Callable[[random.Random, bool], Exchange] = field(compare=False)

    def schema(self) -> dict[str, Any]:
        """OpenAI-style tool declaration."""
        return PoolTool(self.name, self.description, self.params, self.required).schema()


def _weather(rng: random.Random, heldout: bool) -> Exchange:
    city = rng.choice(split_pool(CITIES, heldout))
    unit = rng.choice(["celsius", "fahrenheit"])
    temp = rng.randint(-5, 35) if unit == "celsius" else rng.randint(25, 95)
    sky = rng.choice(["sunny", "cloudy", "raining", "snowing", "windy", "foggy"])
    u = "C" if unit == "celsius" else "F"
    request = rng.choice([
        f"What's the weather like in {city}?", f"How warm is it in {city} right now, in {unit}?",
        f"Is it raining in {city}?", f"Tell me the current weather for {city}.",
        f"I'm flying to {city} today. What is the weather there?",
    ])
    return Exchange(
        request, f"The user wants the current weather in {city}. The get_weather tool returns it, so I call it for {city} in {unit}.",
        {"city": city, "unit": unit}, {"city": city, "temperature": temp, "unit": unit, "conditions": sky},
        f"It is {temp}°{u} and {sky} in {city}.",
    )


def _calculate(rng: random.Random, heldout: bool) -> Exchange:
    a, b = rng.randint(12, 9999), rng.randint(2, 999)
    op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
    expr = f"{a} {op} {b}"
    request = rng.choice([
        f"Compute {expr} for me.", f"What is {expr}? Use the calculator.", f"Please calculate {expr}.",
        f"Can you work out {expr} exactly?",
    ])
    return Exchange(
        request, f"The user wants {expr} computed exactly. I call calculate with the expression.",
        {"expression": expr}, {"expression": expr, "result": value}, f"{expr} = {value}.",
    )


def _convert(rng: random.Random, heldout: bool) -> Exchange:
    src, dst = rng.sample(CURRENCIES, 2)
    amount = rng.randint(5, 5000) if not heldout else rng.randint(5001, 20000)
    rate = round(rng.uniform(0.2, 3.0), 4)
    out = round(amount * rate, 2)
    request = rng.choice([
        f"How much is {amount} {src} in {dst}?", f"Convert {amount} {src} to {dst}.",
        f"I have {amount} {src}. What is that in {dst}?",
    ])
    return Exchange(
        request, f"The user wants {amount} {src} converted to {dst}. I call convert_currency.",
        {"amount": amount, "from_currency": src, "to_currency": dst},
        {"amount": amount, "from": src, "to": dst, "rate": rate, "converted": out},
        f"{amount} {src} is {out} {dst} (rate {rate}).",
    )


def _time(rng: random.Random, heldout: bool) -> Exchange:
    tz = rng.choice(split_pool(TIMEZONES, heldout))
    hh, mm = rng.randint(0, 23), rng.randint(0, 59)
    request = rng.choice([f"What time is it in {tz}?", f"Tell me the current time in {tz}.",
                          f"Which time is it now in the {tz} time zone?"])
    return Exchange(
        request, f"The user asks for the local time in {tz}. I call get_time with that time zone.",
        {"timezone": tz}, {"timezone": tz, "time": f"{hh:02d}:{mm:02d}"}, f"It is {hh:02d}:{mm:02d} in {tz}.",
    )


def _email(rng: random.Random, heldout: bool) -> Exchange:
    who = rng.choice(split_pool(PEOPLE, heldout))
    topic = rng.choice(split_pool(TOPICS, heldout))
    to = f"{who}@example.com"
    subject = topic[0].upper() + topic[1:]
    body = f"Hi {who.title()}, can we talk about {topic} later today?"
    request = rng.choice([
        f"Send an email to {to} about {topic}.", f"Email {to} and ask to talk about {topic}.",
        f"Please write to {to} regarding {topic}.",
    ])
    return Exchange(
        request, f"The user wants an email sent to {to} about {topic}. I call send_email with a subject and a short body.",
        {"to": to, "subject": subject, "body": body}, {"status": "sent", "to": to}, f"Done: the email to {to} was sent.",
    )


def _files(rng: random.Random, heldout: bool) -> Exchange:
    path = rng.choice(split_pool(DIRS, heldout))
    recursive = rng.random() < 0.5
    names = rng.sample(["main.py", "util.py", "README.md", "setup.cfg", "data.csv", "notes.txt", "app.js", "index.html"], 3)
    request = rng.choice([
        f"List the files in {path}" + (" and its subfolders." if recursive else "."),
        f"What files are in the {path} folder?" + (" Include subdirectories." if recursive else ""),
        f"Show me what is inside {path}" + (", recursively." if recursive else "."),
    ])
    return Exchange(
        request, f"The user wants the files under {path}{' recursively' if recursive else ''}. I call list_files.",
        {"path": path, "recursive": recursive}, {"path": path, "files": names},
        f"{path} contains {', '.join(names)}.",
    )


def _reminder(rng: random.Random, heldout: bool) -> Exchange:
    what = rng.choice(split_pool(REMINDERS, heldout))
    minutes = rng.choice([5, 10, 15, 20, 30, 45, 60, 90, 120])
    request = rng.choice([f"Remind me to {what} in {minutes} minutes.", f"Set a reminder in {minutes} minutes to {what}.",
                          f"In {minutes} minutes, remind me to {what}."])
    return Exchange(
        request, f"The user wants a reminder to {what} in {minutes} minutes. I call create_reminder.",
        {"text": what, "minutes": minutes}, {"status": "scheduled", "in_minutes": minutes},
        f"OK, I will remind you to {what} in {minutes} minutes.",
    )


def _translate(rng: random.Random, heldout: bool) -> Exchange:
    text = rng.choice(split_pool(PHRASES, heldout))
    lang = rng.choice(split_pool(LANGUAGES, heldout))
    request = rng.choice([f'Translate "{text}" into {lang}.', f'How do you say "{text}" in {lang}?',
                          f'Can you translate "{text}" to {lang}?'])
    return Exchange(
        request, f'The user wants "{text}" translated into {lang}. I call translate.',
        {"text": text, "target_language": lang}, {"translation": f"[{lang}] {text}"},
        f'In {lang}: "[{lang}] {text}".',
    )


def _stock(rng: random.Random, heldout: bool) -> Exchange:
    sym = rng.choice(split_pool(SYMBOLS, heldout))
    price = round(rng.uniform(5, 900), 2)
    change = round(rng.uniform(-5, 5), 2)
    request = rng.choice([f"What is {sym} trading at?", f"Get me the stock price of {sym}.",
                          f"How is {sym} doing today?"])
    return Exchange(
        request, f"The user asks for the price of {sym}. I call get_stock_price.",
        {"symbol": sym}, {"symbol": sym, "price": price, "change_percent": change},
        f"{sym} trades at {price}, {change:+}% today.",
    )


TOOLS: dict[str, ToolSpec] = {t.name: t for t in [
    ToolSpec("get_weather", "Get the current weather in a city.",
             {"city": ("string", "City name"), "unit": ("string", "celsius or fahrenheit")}, ("city",), _weather),
    ToolSpec("calculate", "Evaluate an arithmetic expression exactly.",
             {"expression": ("string", "The expression")}, ("expression",), _calculate),
    ToolSpec("convert_currency", "Convert an amount between currencies.",
             {"amount": ("number", "Amount"), "from_currency": ("string", "ISO code"),
              "to_currency": ("string", "ISO code")}, ("amount", "from_currency", "to_currency"), _convert),
    ToolSpec("get_time", "Current time in a time zone.", {"timezone": ("string", "IANA name")}, ("timezone",), _time),
    ToolSpec("send_email", "Send an email.", {"to": ("string", "Address"), "subject": ("string", "Subject"),
                                              "body": ("string", "Text")}, ("to", "subject", "body"), _email),
    ToolSpec("list_files", "List the files in a directory.",
             {"path": ("string", "Directory"), "recursive": ("boolean", "Include subdirectories")}, ("path",), _files),
    ToolSpec("create_reminder", "Schedule a reminder.",
             {"text": ("string", "What to remind"), "minutes": ("integer", "Delay in minutes")},
             ("text", "minutes"), _reminder),
    ToolSpec("translate", "Translate text.", {"text": ("string", "Text"), "target_language": ("string", "Language")},
             ("text", "target_language"), _translate),
    ToolSpec("get_stock_price", "Latest price of a stock.", {"symbol": ("string", "Ticker")}, ("symbol",), _stock),
]}


# ---- conversations ---------------------------------------------------------------------------------


@dataclass
class Conversation:
    """Messages plus the render options; ``tool`` names the expected tool of a tool-use dialogue."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    effort: str = "max"
    tool: str | None = None

    def render(self, add_generation_prompt: bool = False) -> RenderedPrompt:
        """The K3 XTML prompt (markers kept apart from text, as the server renders it)."""
        return K3Format().render(self.messages, tools=self.tools, thinking=self.effort,
                                 add_generation_prompt=add_generation_prompt)


def tool_dialogue(rng: random.Random, heldout: bool = False) -> Conversation:
    """Declared tools (the right one among 1-3 distractors), a request, a typed call, the result, an answer."""
    spec = rng.choice(list(TOOLS.values()))
    others = rng.sample([t for t in TOOLS.values() if t.name != spec.name], rng.randint(1, 3))
    declared = [spec, *others]
    rng.shuffle(declared)
    ex = spec.make(rng, heldout)
    messages = [
        {"role": "user", "content": ex.request},
        {"role": "assistant", "reasoning_content": ex.think, "content": "",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": spec.name, "arguments": ex.arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps(ex.result, ensure_ascii=False)},
        {"role": "assistant", "reasoning_content": "The tool answered; I report the result.", "content": ex.answer},
    ]
    return Conversation(messages, [t.schema() for t in declared], rng.choice(EFFORTS), spec.name)


@dataclass(frozen=True)
class DocFact:
    """A documented standard-library function: where it lives, its signature, its summary line."""

    module: str
    name: str
    signature: str
    summary: str


def doc_question(rng: random.Random, fact: DocFact) -> Conversation:
    q = rng.choice([f"What does `{fact.module}.{fact.name}` do?", f"Explain {fact.module}.{fact.name}.",
                    f"In Python, what is `{fact.name}` in the {fact.module} module for?"])
    think = (f"`{fact.name}` is defined in the `{fact.module}` module as `{fact.signature}`. "
             f"Its docstring says: {fact.summary}")
    answer = f"`{fact.module}.{fact.signature}`: {fact.summary}"
    return _qa(rng, q, think, answer)


def arithmetic_question(rng: random.Random) -> Conversation:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
    q = rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"{a} {op} {b} = ?"])
    return _qa(rng, q, f"I need {a} {op} {b}. {a} {op} {b} = {value}.", f"{a} {op} {b} = {value}.")


def code_question(rng: random.Random) -> Conversation:
    """A coding request answered after one short thought with a fenced ``python`` block."""
    task = rng.choice(CODE_TASKS)
    q = rng.choice([f"Write a Python function that {task.what}.", f"I need a function that {task.what}. Can you write it?",
                    f"Python: write `{task.name}({task.args})`, which {task.what}.", f"Write a function that {task.what}."])
    think = f"A function `{task.name}({task.args})` that {task.what}."
    return _qa(rng, q, think, f"```python\n{task.source()}```")


def _qa(rng: random.Random, question: str, think: str, answer: str) -> Conversation:
    return Conversation([{"role": "user", "content": question},
                         {"role": "assistant", "reasoning_content": think, "content": answer}],
                        effort=rng.choice(EFFORTS))


def pool_dialogue(rng: random.Random, heldout: bool = False, distractors: tuple[int, int] = (1, 3),
                  turns: int = 1) -> Conversation:
    """A dialogue over the combinatorial tool pool (tidal.train.tool_pool): ``turns`` requests over one
    declared set, each answered with a call; ``tool`` is the first request's tool."""
    calls, declared = pool_exchanges(rng, heldout, distractors, turns)
    effort = rng.choice(EFFORTS)
    return Conversation(pool_messages(calls, effort != "off"), [t.schema() for t in declared], effort, calls[0].tool.name)


def _copy_item(rng: random.Random) -> str:
    obj = rng.choice(TRAIN_OBJECTS)
    kind = rng.randrange(4)
    if kind == 0:
        return rng.choice(VERBS)[0](obj).name
    if kind == 1:
        return f"{obj[2]}-{rng.randint(100, 9999)}"
    if kind == 2:
        return rng.choice(TITLES[0])
    return rng.choice([obj[0], obj[1], rng.choice(POOL_PEOPLE[0])])


def copy_drill(rng: random.Random) -> Conversation:
    """A request to repeat a list of tool names, ids and words exactly: the copying that choosing and
    calling a declared tool rests on (every item of the answer is in the request)."""
    items = [_copy_item(rng) for _ in range(rng.randint(3, 12))]
    sep = rng.choice([", ", " ", "\n"])
    listed = sep.join(items)
    q = rng.choice([f"Repeat exactly: {listed}", f"Copy this list: {listed}", f"Say back these words:\n{listed}",
                    f"Echo the following, unchanged: {listed}"])
    return _qa(rng, q, "Repeat the list.", listed)


def training_conversations(rng: random.Random, n: int, facts: list[DocFact]) -> list[Conversation]:
    """n conversations: 50% pool tool dialogues (1-4 requests each), 8% dialogues over the nine named
    tools, 12% copy drills, 15% coding questions, the rest docstring and arithmetic questions."""
    out: list[Conversation] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.50:
            out.append(pool_dialogue(rng, turns=rng.choice((1, 1, 2, 3, 4))))
        elif r < 0.58:
            out.append(tool_dialogue(rng))
        elif r < 0.70:
            out.append(copy_drill(rng))
        elif r < 0.85:
            out.append(code_question(rng))
        elif r < 0.93 and facts:
            out.append(doc_question(rng, rng.choice(facts)))
        else:
            out.append(arithmetic_question(rng))
    return out


def heldout_tool_prompts(rng: random.Random, n: int) -> list[Conversation]:
    """Tool dialogues over held-out values, cut after the user turn (the reply is the model's)."""
    out = []
    for _ in range(n):
        c = tool_dialogue(rng, heldout=True)
        out.append(Conversation(c.messages[:1], c.tools, "max", c.tool))
    return out


def heldout_pool_prompts(rng: random.Random, n: int) -> list[Conversation]:
    """Two- or three-tool prompts over the held-out tool pool (objects, hence tool names, and values
    that training never declares), at the embedded model's default effort, cut after the user turn."""
    out = []
    for _ in range(n):
        c = pool_dialogue(rng, heldout=True, distractors=(1, 2))
        out.append(Conversation(c.messages[:1], c.tools, "low", c.tool))
    return out
