"""Whole-name tool choice: what a choice point costs the engine, scored from the request's pool state
(what ``tidal serve --tool-name-choice whole`` runs) against scoring from its tokens alone (a second
prefill of the whole prompt, as it was done before), on the same requests in the same run.

Each request is a held-out two-/three-tool prompt (``tool_choice`` required) behind a system
message of stdlib source padded to about ``--lengths`` tokens; at its choice point both scorers run,
in alternating order, and the table gives the median milliseconds of each, their ratio and the
largest difference between their scores (float32 rounding; the picks must agree).

    python benchmarks/bench_whole_choice.py [--lengths 256 1024 4096] [--prompts 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import textwrap
import time

import torch

from tidal import LLM
from tidal.engine.whole_choice import score_continuations
from tidal.sampling_params import SamplingParams, StructuredOutputsParams
from tidal.serve.chat import K3Format
from tidal.train.conversations import heldout_pool_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--prompts", type=int, default=3, help="requests per length")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(max_num_batched_tokens=8192)
    core, tok, fmt = llm.engine, llm.tokenizer, K3Format()
    model = core.worker.model
    source = inspect.getsource(textwrap) * 8
    timings: list[tuple[float, float, float]] = []
    real_choose = core._choose_whole

    def both(req, matcher, last_logits):
        """Time the engine's own scoring and the token-only reference on the same point, the
        order alternating from one point to the next."""
        options = [ids for _, ids in matcher.pending]
        tokens = list(req.token_ids)
        seen = {}

        def engine_side() -> None:
            real_score = core.worker.score
            core.worker.score = lambda *a: seen.setdefault("engine", real_score(*a))
            try:
                t0 = time.perf_counter()
                real_choose(req, matcher, last_logits)
                seen["engine_s"] = time.perf_counter() - t0
            finally:
                del core.worker.score

        def reference_side() -> None:
            t0 = time.perf_counter()
            seen["reference"] = score_continuations(model, tokens, options)
            seen["reference_s"] = time.perf_counter() - t0

        order = (reference_side, engine_side) if len(timings) % 2 else (engine_side, reference_side)
        for f in order:
            f()
        diff = max(abs(a - b) for a, b in zip(seen["engine"], seen["reference"]))
        if seen["engine"].index(max(seen["engine"])) != seen["reference"].index(max(seen["reference"])):
            raise SystemExit(f"the two scorers pick different options: {seen['engine']} against {seen['reference']}")
        timings.append((seen["engine_s"], seen["reference_s"], diff))

    core._choose_whole = both
    print(f"threads {args.threads}; median ms per choice point over {args.prompts} requests per length")
    print(f"{'prompt tokens':>13} {'pool state':>11} {'re-prefill':>11} {'ratio':>7} {'max |score diff|':>17}")
    for n in args.lengths:
        convs = heldout_pool_prompts(random.Random(n), args.prompts)
        prompts, params, lens = [], [], []
        for c in convs:
            filler = source[: 4 * n]
            while True:
                msgs = [{"role": "system", "content": filler}, *c.messages]
                rendered = fmt.render(msgs, tools=c.tools, thinking=c.effort)
                ids = rendered.token_ids(tok)
                if len(ids) <= n or len(filler) < 16:
                    break
                filler = filler[: int(len(filler) * n / len(ids) * 0.98)]
            grammar = fmt.reply_grammar(rendered, tools=c.tools, tool_choice="required")
            points = fmt.reply_choice_points(tools=c.tools, tool_choice="required")
            prompts.append({"prompt_token_ids": ids})
            lens.append(len(ids))
            params.append(SamplingParams(temperature=0, max_tokens=48, skip_special_tokens=False,
                                         structured_outputs=StructuredOutputsParams(llguidance=grammar,
                                                                                    choice_points=points)))
        timings.clear()
        for p, sp in zip(prompts, params):  # one request at a time: each point timed on its own
            llm.generate([p], [sp])
        if not timings:
            raise SystemExit(f"no request reached a choice point at {n} tokens")
        new = statistics.median(t for t, _, _ in timings) * 1e3
        old = statistics.median(t for _, t, _ in timings) * 1e3
        print(f"{statistics.median(lens):>13.0f} {new:>11.1f} {old:>11.1f} {old / new:>6.1f}x "
              f"{max(d for _, _, d in timings):>17.2e}")


if __name__ == "__main__":
    main()
