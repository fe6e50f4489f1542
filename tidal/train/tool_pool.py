"""A large, combinatorial pool of tools for tool-use dialogues: verbs x objects.

Each tool is ``<verb>_<object>`` (``delete_invoice``, ``search_tickets``, ...) with a description
and a JSON-schema argument list that follow from its verb. A request names the verb and the
object in words and spells every argument value, so the right tool is decided by the request's
words (declared distractors share the verb or the object) and the arguments are copied from it.

Objects and value pools are split: held-out prompts use objects (hence tool names) and values that
no training dialogue contains. Everything is a pure function of a ``random.Random``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable

# (object, plural, id prefix)
TRAIN_OBJECTS = [
    ("invoice", "invoices", "INV"), ("ticket", "tickets", "TCK"), ("order", "orders", "ORD"),
    ("user", "users", "USR"), ("project", "projects", "PRJ"), ("document", "documents", "DOC"),
    ("meeting", "meetings", "MTG"), ("contact", "contacts", "CON"), ("payment", "payments", "PAY"),
    ("shipment", "shipments", "SHP"), ("task", "tasks", "TSK"), ("report", "reports", "RPT"),
    ("customer", "customers", "CUS"), ("product", "products", "PRD"), ("playlist", "playlists", "PLY"),
    ("note", "notes", "NTE"), ("booking", "bookings", "BKG"), ("account", "accounts", "ACC"),
    ("device", "devices", "DEV"), ("campaign", "campaigns", "CMP"), ("recipe", "recipes", "RCP"),
    ("course", "courses", "CRS"), ("vehicle", "vehicles", "VEH"), ("repository", "repositories", "REP"),
    ("album", "albums", "ALB"), ("event", "events", "EVT"), ("survey", "surveys", "SRV"),
    ("coupon", "coupons", "CPN"), ("lead", "leads", "LED"), ("patient", "patients", "PAT"),
    ("flight", "flights", "FLT"), ("server", "servers", "SVR"), ("article", "articles", "ART"),
    ("warehouse", "warehouses", "WHS"), ("subscription", "subscriptions", "SUB"), ("photo", "photos", "PHO"),
    ("vendor", "vendors", "VND"), ("budget", "budgets", "BDG"), ("room", "rooms", "ROM"),
    ("employee", "employees", "EMP"),
]
# More training objects, so a tool's object must be read from the request and the declarations
# (copied), not recalled from a few dozen memorised names: (object, plural, id prefix) made by _obj.
EXTRA_NOUNS = (
    "agent asset badge banner batch bill bucket bundle cabinet calendar camera card cart channel chart "
    "cluster comment company crate credit deal delivery deposit desk diagram domain draft driver "
    "engine estimate expense feature feed file folder form fund gadget gallery gift goal grant group guest "
    "habit ingredient issue item job journal kit label ledger license link locker log machine manual map "
    "member menu message milestone mission module monitor offer office page panel parcel partner passport "
    "pipeline plan planet plugin policy poll portfolio post printer profile prompt quote quiz receipt record "
    "region release reservation resource review reward robot route rule schedule script season seat segment "
    "service session shelf shift signal sketch slot snapshot song source space sprint stage station store "
    "story studio supplier table tag team template tenant theme thread tier token tour track trade trip truck "
    "unit venue video visit volume wallet webhook widget window workflow workshop zone"
).split()


def _plural(word: str) -> str:
    if word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + ("es" if word.endswith(("s", "x", "ch", "sh")) else "s")


def _obj(word: str) -> tuple[str, str, str]:
    return (word, _plural(word), word.replace("_", "")[:3].upper())


TRAIN_OBJECTS += [_obj(w) for w in EXTRA_NOUNS if w not in {o[0] for o in TRAIN_OBJECTS}]
HELDOUT_OBJECTS = [
    ("contract", "contracts", "CTR"), ("package", "packages", "PKG"), ("lesson", "lessons", "LSN"),
    ("dataset", "datasets", "DST"), ("podcast", "podcasts", "POD"), ("listing", "listings", "LST"),
    ("claim", "claims", "CLM"), ("sensor", "sensors", "SNS"), ("voucher", "vouchers", "VCH"),
    ("garden", "gardens", "GRD"),
]

# Value pools: (train, held-out).
TITLES = (
    ["spring launch", "weekly sync", "blue harbor", "quarter close", "north star", "green field",
     "budget review", "summer sale", "data cleanup", "night shift", "river walk", "alpha test",
     "city tour", "red door", "team lunch", "silver line", "open house", "final draft", "early bird",
     "deep dive", "fresh start", "side quest", "big picture", "fast track"],
    ["autumn fair", "golden gate", "quiet hour", "paper trail", "second wind", "stone bridge"],
)
QUERIES = (
    ["late delivery", "refund", "password reset", "missing item", "blue shirt", "overdue", "duplicate charge",
     "login error", "new york", "priority", "broken link", "discount"],
    ["warranty", "cracked screen", "wrong size", "expired card"],
)
PEOPLE = (
    ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "oscar", "peggy",
     "rupert", "sybil", "trent", "victor", "walter", "zoe"],
    ["nadia", "quentin", "ursula", "xavier", "wendy", "kofi"],
)
STATUSES = (["open", "closed", "pending", "approved", "active", "paused", "done", "rejected"],
            ["blocked", "escalated", "on hold"])
FORMATS = (["csv", "json", "pdf", "xlsx"], ["xml", "parquet"])


def split_pool(pools: tuple[list[str], list[str]], heldout: bool) -> list[str]:
    return pools[1] if heldout else pools[0]


@dataclass(frozen=True)
class PoolTool:
    """A declared tool: name, description, params (name -> (JSON type, description)), required."""

    name: str
    description: str
    params: dict[str, tuple[str, str]]
    required: tuple[str, ...]

    def schema(self) -> dict[str, Any]:
        """OpenAI-style tool declaration."""
        props = {k: {"type": t, "description": d} for k, (t, d) in self.params.items()}
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": props, "required": list(self.required)},
        }}


@dataclass(frozen=True)
class PoolCall:
    """One use of a pool tool: request, short reasoning, arguments, the tool's result, the answer."""

    tool: PoolTool
    request: str
    think: str
    arguments: dict[str, Any]
    result: dict[str, Any]
    answer: str


Obj = tuple[str, str, str]


def _an(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _id(rng: random.Random, obj: Obj) -> str:
    return f"{obj[2]}-{rng.randint(100, 9999)}"


# A verb: (tool name, description, params, required) for an object, and a call maker.
Verb = tuple[Callable[[Obj], PoolTool], Callable[[random.Random, Obj, PoolTool, bool], PoolCall]]


def _get_tool(o: Obj) -> PoolTool:
    return PoolTool(f"get_{o[0]}", f"Fetch one {o[0]} by its id.", {f"{o[0]}_id": ("string", f"The {o[0]} id")},
                    (f"{o[0]}_id",))


def _get_call(rng: random.Random, o: Obj, t: PoolTool, heldout: bool) -> PoolCall:
    i = _id(rng, o)
    status = rng.choice(split_pool(STATUSES, heldout))
    req = rng.choice([f"Show me {o[0]} {i}.", f"Get the {o[0]} with id {i}.", f"Fetch {o[0]} {i} for me.",
                      f"Can you look up {o[0]} {i}?"])
    return PoolCall(t, req, f"Look up {o[0]} {i}: {t.name}.", {f"{o[0]}_id": i}, {"id": i, "status": status},
                    f"{o[0].capitalize()} {i} is {status}.")


def _delete_tool(o: Obj) -> PoolTool:
    return PoolTool(f"delete_{o[0]}", f"Delete {_an(o[0])} permanently.", {f"{o[0]}_id": ("string", f"The {o[0]} to delete")},
                    (f"{o[0]}_id",))


def _delete_call(rng: random.Random, o: Obj, t: PoolTool, heldout: bool) -> PoolCall:
    i = _id(rng, o)
    req = rng.choice([f"Delete {o[0]} {i}.", f"Please delete the {o[0]} {i}.", f"{o[0].capitalize()} {i} is obsolete, delete it."])
    return PoolCall(t, req, f"Delete {o[0]} {i}: {t.name}.", {f"{o[0]}_id": i}, {"deleted": i},
                    f"{o[0].capitalize()} {i} was deleted.")


def _create_tool(o: Obj) -> PoolTool:
    return PoolTool(f"create_{o[0]}", f"Create a new {o[0]}.", {"title": ("string", f"Title of the {o[0]}"),
                    "owner": ("string", "Who owns it")}, ("title",))


def _create_call(rng: random.Random, o: Obj, t: PoolTool, heldout: bool) -> PoolCall:
    title = rng.choice(split_pool(TITLES, heldout))
    args: dict[str, Any] = {"title": title}
    req = rng.choice([f'Create a new {o[0]} called "{title}".', f'Make {_an(o[0])} named "{title}".',
                      f'Please create {_an(o[0])} titled "{title}".'])
    if rng.random() < 0.5:
        who = rng.choice(split_pool(PEOPLE, heldout))
        args["owner"] = who
        req = req[:-1] + f" for {who}."
    i = _id(rng, o)
    return PoolCall(t, req, f'Create {_an(o[0])} "{title}": {t.name}.', args, {"id": i, "title": title},
                    f'Created {o[0]} {i} "{title}".')


def _search_tool(o: Obj) -> PoolTool:
    return PoolTool(f"search_{o[1]}", f"Search {o[1]} by keyword.", {"query": ("string", "Search words"),
                    "limit": ("integer", "Most results to return")}, ("query",))


def _search_call(rng: random.Random, o: Obj, t: PoolTool, heldout: bool) -> PoolCall:
    q = rng.choice(split_pool(QUERIES, heldout))
    args: dict[str, Any] = {"query": q}
    if rng.random() < 0.5:
        k = rng.randint(2, 20)
        args["limit"] = k
        req = rng.choice([f'Search the {o[1]} for "{q}", at most {k} results.', f'Find up to {k} {o[1]} matching "{q}".'])
    else:
        req = rng.choice([f'Search {o[1]} for "{q}".', f'Find {o[1]} that mention "{q}".'])
    n = rng.randint(0, 9)
    return PoolCall(t, req, f'Search {o[1]} for "{q}": {t.name}.', args, {"matches": n},
                    f'{n} {o[1]} match "{q}".')


def _list_tool(o: Obj) -> PoolTool:
    return PoolTool(f"list_{o[1]}", f"List the most recent {o[1]}.", {"limit": ("integer", f"How many {o[1]}")}, ("limit",))


def _list_call(rng: random.Random, o: Obj, t: PoolTool, heldout: bool) -> PoolCall:
    k = rng.randint(2, 50)
    req = rng.choice([f"List the last {k} {o[1]}.", f"Show me the {k} most recent {o[1]}.", f"Give me a list of {k} {o[1]}."])
    ids = [_id(rng, o) for _ in range(2)]
    return PoolCall(t, req, f"List {k} {o[1]}: {t.name}.", {"limit": k}, {"items": ids},
                    f"The latest {o[1]} include {ids[0]} and {ids[1]}.")


def _status_tool(o: Obj) -> PoolTool:
    return PoolTool(f"update_{o[0]}_status", f"Change the status of {_an(o[0])}.",
                    {f"{o[0]}_id": ("string", f"The {o[0]} id"), "status": ("string", "New status")},
                    (f"{o[0]}_id", "status"))


def _status_call(rng: random.Random, o: Obj, t: PoolTool, heldout: bool) -> PoolCall:
    i, s = _id(rng, o), rng.choice(split_pool(STATUSES, heldout))
    req = rng.choice([f'Mark {o[0]} {i} as {s}.', f'Set the status of {o[0]} {i} to {s}.', f'Change {o[0]} {i} to {s}.'])
    return PoolCall(t, req, f"Set {o[0]} {i} to {s}: {t.name}.", {f"{o[0]}_id": i, "status": s},
                    {"id": i, "status": s}, f"{o[0].capitalize()} {i} is now {s}.")


def _count_tool(o: Obj) -> PoolTool:
    return PoolTool(f"count_{o[1]}", f"Count {o[1]} with a given status.", {"status": ("string", "Status to count")}, ("status",))


def _count_call(rng: random.Random, o: Obj, t: PoolTool, heldout: bool) -> PoolCall:
    s, n = rng.choice(split_pool(STATUSES, heldout)), rng.randint(0, 400)
    req = rng.choice([f"How many {o[1]} are {s}?", f"Count the {s} {o[1]}.", f"What is the number of {s} {o[1]}?"])
    return PoolCall(t, req, f"Count {s} {o[1]}: {t.name}.", {"status": s}, {"count": n},
                    f"There are {n} {s} {o[1]}.")


def _archive_tool(o: Obj) -> PoolTool:
    return PoolTool(f"archive_{o[0]}", f"Archive {_an(o[0])} (it can be restored).",
                    {f"{o[0]}_id": ("string", f"The {o[0]} id"), "notify": ("boolean", "Tell its owner")}, (f"{o[0]}_id",))


def _archive_call(rng: random.Random, o: Obj, t: PoolTool, heldout: bool) -> PoolCall:
    i = _id(rng, o)
    notify = rng.random() < 0.5
    req = rng.choice([f"Archive {o[0]} {i}", f"Please archive the {o[0]} {i}"]) + (" and notify the owner." if notify else ".")
    args: dict[str, Any] = {f"{o[0]}_id": i, "notify": notify}
    return PoolCall(t, req, f"Archive {o[0]} {i}: {t.name}.", args, {"archived": i},
                    f"{o[0].capitalize()} {i} is archived.")


def _export_tool(o: Obj) -> PoolTool:
    return PoolTool(f"export_{o[1]}", f"Export all {o[1]} to a file.", {"format": ("string", "File format")}, ("format",))


def _export_call(rng: random.Random, o: Obj, t: PoolTool, heldout: bool) -> PoolCall:
    f = rng.choice(split_pool(FORMATS, heldout))
    req = rng.choice([f"Export all {o[1]} as {f}.", f"I need the {o[1]} exported to {f}.", f"Export the {o[1]} in {f} format."])
    return PoolCall(t, req, f"Export {o[1]} as {f}: {t.name}.", {"format": f}, {"file": f"{o[1]}.{f.replace(' ', '')}"},
                    f"The {o[1]} are in {o[1]}.{f.replace(' ', '')}.")


def _rename_tool(o: Obj) -> PoolTool:
    return PoolTool(f"rename_{o[0]}", f"Give {_an(o[0])} a new name.",
                    {f"{o[0]}_id": ("string", f"The {o[0]} id"), "new_name": ("string", "The new name")},
                    (f"{o[0]}_id", "new_name"))


def _rename_call(rng: random.Random, o: Obj, t: PoolTool, heldout: bool) -> PoolCall:
    i, name = _id(rng, o), rng.choice(split_pool(TITLES, heldout))
    req = rng.choice([f'Rename {o[0]} {i} to "{name}".', f'Change the name of {o[0]} {i} to "{name}".'])
    return PoolCall(t, req, f'Rename {o[0]} {i} to "{name}": {t.name}.', {f"{o[0]}_id": i, "new_name": name},
                    {"id": i, "name": name}, f'{o[0].capitalize()} {i} is now called "{name}".')


def _assign_tool(o: Obj) -> PoolTool:
    return PoolTool(f"assign_{o[0]}", f"Assign {_an(o[0])} to a person.",
                    {f"{o[0]}_id": ("string", f"The {o[0]} id"), "assignee": ("string", "User name")},
                    (f"{o[0]}_id", "assignee"))


def _assign_call(rng: random.Random, o: Obj, t: PoolTool, heldout: bool) -> PoolCall:
    i, who = _id(rng, o), rng.choice(split_pool(PEOPLE, heldout))
    req = rng.choice([f"Assign {o[0]} {i} to {who}.", f"Give {o[0]} {i} to {who}.", f"{who} should own {o[0]} {i}; assign it."])
    return PoolCall(t, req, f"Assign {o[0]} {i} to {who}: {t.name}.", {f"{o[0]}_id": i, "assignee": who},
                    {"id": i, "assignee": who}, f"{o[0].capitalize()} {i} is assigned to {who}.")


VERBS: list[Verb] = [
    (_get_tool, _get_call), (_delete_tool, _delete_call), (_create_tool, _create_call),
    (_search_tool, _search_call), (_list_tool, _list_call), (_status_tool, _status_call),
    (_count_tool, _count_call), (_archive_tool, _archive_call), (_export_tool, _export_call),
    (_rename_tool, _rename_call), (_assign_tool, _assign_call),
]


def pool_tools(heldout: bool = False) -> list[PoolTool]:
    """Every tool of the (training or held-out) pool."""
    return [make(o) for o in (HELDOUT_OBJECTS if heldout else TRAIN_OBJECTS) for make, _ in VERBS]


def pool_exchange(rng: random.Random, heldout: bool = False, distractors: tuple[int, int] = (1, 3)
                  ) -> tuple[PoolCall, list[PoolTool]]:
    """A call of a random pool tool and the declared tools: it plus ``distractors`` (a range) others that share its
    verb or its object (so both words of the request matter), in random order."""
    calls, declared = pool_exchanges(rng, heldout, distractors, 1)
    return calls[0], declared


def pool_exchanges(rng: random.Random, heldout: bool = False, distractors: tuple[int, int] = (1, 3), turns: int = 1
                   ) -> tuple[list[PoolCall], list[PoolTool]]:
    """``turns`` calls over one declared set (see :func:`pool_exchange`): the first call's tool and its
    distractors, each later call of a random declared tool (so the choice is read from each request)."""
    objects = HELDOUT_OBJECTS if heldout else TRAIN_OBJECTS
    vi, obj = rng.randrange(len(VERBS)), rng.choice(objects)
    tool = VERBS[vi][0](obj)
    others: list[tuple[PoolTool, int, Obj]] = []
    for _ in range(rng.randint(*distractors)):
        while True:
            kind = rng.random()
            o = obj if kind < 0.4 else rng.choice(objects)
            v = vi if 0.4 <= kind < 0.8 else rng.randrange(len(VERBS))
            cand = VERBS[v][0](o)
            if cand.name != tool.name and cand not in [t for t, _, _ in others]:
                others.append((cand, v, o))
                break
    pool = [(tool, vi, obj), *others]
    declared = [t for t, _, _ in pool]
    rng.shuffle(declared)
    calls = [VERBS[vi][1](rng, obj, tool, heldout)]
    for _ in range(turns - 1):
        t, v, o = rng.choice(pool)
        calls.append(VERBS[v][1](rng, o, t, heldout))
    return calls, declared


def pool_messages(c: PoolCall | list[PoolCall], think: bool) -> list[dict[str, Any]]:
    """The dialogue's messages: per call, the request, (thought and) call, the tool's result, the answer."""
    out: list[dict[str, Any]] = []
    for i, call in enumerate(c if isinstance(c, list) else [c]):
        cid = f"call_{i + 1}"
        out += [
            {"role": "user", "content": call.request},
            {"role": "assistant", "reasoning_content": call.think if think else "", "content": "",
             "tool_calls": [{"id": cid, "type": "function",
                             "function": {"name": call.tool.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": cid, "content": json.dumps(call.result, ensure_ascii=False)},
            {"role": "assistant", "reasoning_content": "Report the result." if think else "", "content": call.answer},
        ]
    return out
