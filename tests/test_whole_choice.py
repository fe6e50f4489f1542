"""Whole-name tool choice (tidal.engine.whole_choice) on the embedded model: the scores against a
float64 full-sequence reference (from the tokens alone, and as the engine computes them from the
request's pool state, forwarding only the options' tokens), the engine writing the best-scored
name where the token mask would have written another, the pick independent of the batch, the
chunking and the prefix cache (the scores bit for bit in deterministic mode), and the choice points
the chat reply grammar declares."""

from __future__ import annotations

import random
import re

import pytest
import torch

from tidal.embedded import embedded_model_dir
from tidal.engine.whole_choice import WholeChoiceMatcher, pick, resolve_points, score_continuations
from tidal.engine.grammar import GrammarCompiler, allowed_tokens
from tidal.model.checkpoint import load_model
from tidal.model.context import SimpleCache, simple_batch
from tidal.sampling_params import ChoicePoint, SamplingParams, StructuredOutputsParams
from tidal.serve.chat import K3Format
from tidal.serve.chat.constraints import reply_grammar, tool_choice_points
from tidal.tokenizer import load_tokenizer
from tidal.train.conversations import heldout_pool_prompts

FMT = K3Format()
CALL = re.compile(r'call tool="([^"]*)"')


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name}.",
                                             "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(embedded_model_dir())


@pytest.fixture(scope="module")
def llm():
    from tidal import LLM

    return LLM(str(embedded_model_dir()))


@pytest.fixture(scope="module")
def convs():
    return heldout_pool_prompts(random.Random(2121), 16)


def requests(convs, tok, whole: bool) -> tuple[list[dict], list[SamplingParams]]:
    prompts, params = [], []
    for c in convs:
        r = c.render(add_generation_prompt=True)
        grammar = FMT.reply_grammar(r, tools=c.tools, tool_choice="required")
        points = FMT.reply_choice_points(tools=c.tools, tool_choice="required") if whole else ()
        prompts.append({"prompt_token_ids": r.token_ids(tok)})
        params.append(SamplingParams(temperature=0, max_tokens=120, skip_special_tokens=False,
                                     structured_outputs=StructuredOutputsParams(llguidance=grammar,
                                                                                choice_points=points)))
    return prompts, params


# ---- the choice points of the reply grammar --------------------------------------------------------

def test_choice_points_name_every_callable_tool_with_its_closing_quote():
    tools = [tool("get"), tool("get_x"), tool('say"hi')]
    (p,) = tool_choice_points(tools, "auto")
    assert (p.after, p.lead) == ("<|open|>", 'call tool="')
    assert p.options == ('get"', 'get_x"', 'say&quot;hi"')  # spelled as the grammar's header spells them
    assert tool_choice_points(tools, "required") == (p,)
    assert tool_choice_points(tools, "none") == ()
    assert tool_choice_points(tools, {"type": "function", "function": {"name": "get"}}) == ()  # nothing to choose
    assert tool_choice_points(tools[:1], "auto") == ()
    assert tool_choice_points(None, None) == ()
    with pytest.raises(ValueError, match="two or more distinct options"):
        ChoicePoint("<|open|>", "x", ("a", "a"))


def test_matcher_holds_the_options_then_forces_the_chosen_one(tok):
    """After the marker that opens a call, both ``get"`` and ``get_x"`` (one a prefix of the other)
    are open; choosing one allows only its tokens, and the grammar then goes on after it."""
    tools = [tool("get"), tool("get_x")]
    compiler = GrammarCompiler(tok, (2, 1))
    grammar = reply_grammar(thinking=False, tools=tools, tool_choice="required")
    m = WholeChoiceMatcher(compiler.compile(grammar).matcher((2, 1)),
                           resolve_points(tool_choice_points(tools, "required"), tok))
    sp = tok.special_tokens
    reply = [sp["<|close|>"], *tok.encode("response"), sp["<|sep|>"], sp["<|open|>"], *tok.encode("tools"),
             sp["<|sep|>"], sp["<|open|>"]]
    for t in reply:
        assert m.pending is None
        m.accept(t)
    assert m.pending is not None and [i for i, _ in m.pending] == [0, 1]
    m.choose(1)
    forced = tok.encode('call tool="get_x"')
    for t in forced:
        row = allowed_tokens([m], tok.vocab_size)[0]
        assert row.nonzero().flatten().tolist() == [t]
        m.accept(t)
    assert not m.forcing and m.chosen == [1] and m.failed is None
    rest = tok.encode(' index="1"')
    for t in rest:  # back to the grammar: the call's index comes next
        assert allowed_tokens([m], tok.vocab_size)[0][t]
        m.accept(t)
    assert m.failed is None


def test_pick_is_greedy_with_ties_to_the_earliest_and_draws_with_the_request_generator():
    greedy = SamplingParams(temperature=0)
    assert pick([-3.0, -1.0, -1.0], greedy, None) == 1
    hot = SamplingParams(temperature=1.0)
    draws = [pick([-1.0, -1.5, -9.0], hot, torch.Generator().manual_seed(s)) for s in range(40)]
    assert draws == [pick([-1.0, -1.5, -9.0], hot, torch.Generator().manual_seed(s)) for s in range(40)]
    assert set(draws) == {0, 1}  # e^-7.5 of the mass on the last: never drawn in 40


# ---- scores ----------------------------------------------------------------------------------------

def test_scores_match_a_float64_full_sequence_forward(tok, convs):
    """score_continuations (float32, the prefix's cache forked per option) equals the float64
    log-probability of each option from one plain forward over prefix + option."""
    model = load_model(embedded_model_dir(), torch.float32)
    ref = load_model(embedded_model_dir(), torch.float64)
    c = convs[0]
    prefix = c.render(add_generation_prompt=True).token_ids(tok) + [tok.special_tokens["<|open|>"]]
    (_, options), = resolve_points(FMT.reply_choice_points(tools=c.tools, tool_choice="auto"), tok)
    got = score_continuations(model, prefix, options)
    assert got == pytest.approx(full_forward_scores(ref, prefix, options), abs=2e-3)
    assert len(set(got)) == len(got)
    with pytest.raises(ValueError, match="non-empty"):
        score_continuations(model, prefix, [[]])


def full_forward_scores(ref, prefix: list[int], options: list[list[int]]) -> list[float]:
    """Each option's float64 log-probability after ``prefix`` from one plain forward over prefix + option."""
    out = []
    for ids in options:
        seq = torch.tensor(prefix + ids)
        cache = SimpleCache(ref.config, 1, torch.float64)
        with torch.no_grad():
            logits = ref.compute_logits(ref(seq, simple_batch(ref.config, [len(seq)], cache, [0])))
        logp = torch.log_softmax(logits, dim=-1)
        out.append(float(logp[len(prefix) - 1 : -1].gather(1, torch.tensor(ids)[:, None]).sum()))
    return out


def record_choices(llm) -> tuple[list[dict], object]:
    """Wrap the engine's whole-name choice: per choice point the request's tokens, the options, the
    scores the worker returned and how many tokens the model forwarded to get them. Returns the
    records and an undo."""
    core, worker = llm.engine, llm.engine.worker
    model, calls = worker.model, []
    real_choose, real_score, real_forward = core._choose_whole, worker.score, model.forward

    def forward(ids, *args, **kwargs):
        calls[-1]["forwarded"] += ids.numel()
        return real_forward(ids, *args, **kwargs)

    def score(*args):
        model.forward = forward
        try:
            calls[-1]["scores"] = real_score(*args)
        finally:
            del model.forward
        return calls[-1]["scores"]

    def choose(req, matcher, last_logits):
        calls.append({"tokens": list(req.token_ids), "options": [list(ids) for _, ids in matcher.pending],
                      "forwarded": 0})
        return real_choose(req, matcher, last_logits)

    core._choose_whole, worker.score = choose, score

    def undo() -> None:
        del core._choose_whole, worker.score

    return calls, undo


# ---- through the engine ------------------------------------------------------------------------------

def test_engine_scores_from_the_pool_state_match_a_float64_full_forward(llm, tok, convs):
    """The engine scores the options from what the pool already holds for the request (no second
    prefill: the model forwards only each option's tokens but its last), and the scores are the
    float64 full forward's within float32 rounding."""
    calls, undo = record_choices(llm)
    try:
        llm.generate(*requests(convs[:3], tok, whole=True))
    finally:
        undo()
    assert len(calls) == 3
    ref = load_model(embedded_model_dir(), torch.float64)
    for call in calls:
        assert call["forwarded"] == sum(len(o) - 1 for o in call["options"])
        want = full_forward_scores(ref, call["tokens"], call["options"])
        assert call["scores"] == pytest.approx(want, abs=2e-3)



def test_engine_writes_the_best_whole_name_where_the_token_mask_writes_another(llm, tok, convs):
    """With choice points the name called is the one with the best whole score after the
    request's own reply up to the call (recomputed here from the masked reply, which is the same
    text up to that point); on some prompts the token mask alone calls another tool."""
    masked = llm.generate(*requests(convs, tok, whole=False))
    whole = llm.generate(*requests(convs, tok, whole=True))
    model = llm.engine.worker.model
    open_id = tok.special_tokens["<|open|>"]
    differ = 0
    for c, m, w in zip(convs, masked, whole):
        ids = list(m.outputs[0].token_ids)
        at = next(j for j in range(len(ids)) if ids[j] == open_id and tok.decode(ids[j + 1 : j + 3]).startswith("call"))
        assert list(w.outputs[0].token_ids)[: at + 1] == ids[: at + 1]
        point = FMT.reply_choice_points(tools=c.tools, tool_choice="required")
        (_, options), = resolve_points(point, tok)
        scores = score_continuations(model, list(m.prompt_token_ids) + ids[: at + 1], options)
        best = point[0].options[scores.index(max(scores))][:-1]
        assert CALL.findall(w.outputs[0].text)[0] == best
        differ += CALL.findall(m.outputs[0].text)[0] != best
    assert differ >= 1


def test_whole_choice_is_independent_of_batch_chunking_and_prefix_cache(llm, tok, convs):
    from tidal import LLM

    prompts, params = requests(convs[:6], tok, whole=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts[:3], params[:3])]
    assert alone == together[:3]
    other = LLM(str(embedded_model_dir()), max_num_batched_tokens=64, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in other.generate(prompts[::-1], params[::-1])] == together[::-1]


def test_whole_choice_scores_are_bit_identical_across_batch_and_chunking_in_deterministic_mode(tok, convs):
    """Under deterministic inference the pool state a request's options are scored from has the
    same bits in any batch or chunking, and so have the scores."""
    from tidal import LLM

    prompts, params = requests(convs[:3], tok, whole=True)
    runs = []
    for kwargs, order in (({}, [0, 1, 2]), ({}, [2]), ({"max_num_batched_tokens": 48}, [2, 1, 0])):
        det = LLM(str(embedded_model_dir()), enable_deterministic_inference=True, **kwargs)
        calls, _ = record_choices(det)
        det.generate([prompts[i] for i in order], [params[i] for i in order])
        runs.append({tuple(c["tokens"]): c["scores"] for c in calls})
    assert len(runs[0]) == 3 and len(runs[1]) == 1
    for key, scores in runs[1].items():
        assert runs[0][key] == scores
    assert runs[2] == runs[0]


@pytest.mark.parametrize("choice", ["mask", "whole"])
def test_server_sets_choice_points_only_under_tool_name_choice_whole(choice):
    from types import SimpleNamespace

    from tidal.serve.app import ServerConfig, ServerState

    state = SimpleNamespace(config=ServerConfig(["m"], "m", tool_name_choice=choice), need_chat=lambda: FMT)
    tools = [tool("get"), tool("put")]
    prompt = FMT.render([{"role": "user", "content": "hi"}], tools=tools)
    spec = ServerState.reply_constraint(state, prompt, tools=tools, tool_choice="auto", content=None)
    assert spec.llguidance is not None
    assert spec.choice_points == (tool_choice_points(tools, "auto") if choice == "whole" else ())
