"""Token healing on the embedded model: how often a sampled continuation of a code prompt that ends
inside a token writes an indented function body, with and without healing, against the prompt cut
at the tokenizer's own boundary (the baseline, in the same run).

A sample "writes a body" when the first line after the header is indented and not blank. Prompts
end in "\\n", which the tokenizer merges with the indentation that follows in training.

    python benchmarks/bench_token_healing.py [--samples 8] [--max-tokens 24] [--temperature 1.0]
"""

from __future__ import annotations

import argparse

from tidal import LLM, SamplingParams

HEADERS = ["def f(x):", "def clamp(x, lo, hi):", "def parse(line):", "class Point:"]


def writes_body(text_after_header: str) -> bool:
    lines = text_after_header.split("\n")
    return len(lines) > 1 and lines[1][:1] in (" ", "\t") and bool(lines[1].strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    llm = LLM(kv_cache_memory_bytes=64_000_000)

    def count(prompt: str, heal: bool, after: str) -> int:
        params = [SamplingParams(temperature=args.temperature, seed=s, max_tokens=args.max_tokens,
                                 token_healing=heal) for s in range(args.samples)]
        outs = llm.generate([prompt] * args.samples, params)
        return sum(writes_body(after + o.outputs[0].text) for o in outs)

    print(f"samples with an indented body, of {args.samples} (temperature {args.temperature:g}, "
          f"{args.max_tokens} tokens, seeds 0..{args.samples - 1})")
    print(f"{'header':<24} {'header (baseline)':>18} {'header+NL plain':>16} {'header+NL healed':>17}")
    totals = [0, 0, 0]
    for h in HEADERS:
        row = [count(h, False, ""), count(h + "\n", False, "\n"), count(h + "\n", True, "\n")]
        totals = [a + b for a, b in zip(totals, row)]
        print(f"{h:<24} {row[0]:>18} {row[1]:>16} {row[2]:>17}")
    n = args.samples * len(HEADERS)
    print(f"{'all':<24} {totals[0]:>14}/{n} {totals[1]:>12}/{n} {totals[2]:>13}/{n}")


if __name__ == "__main__":
    main()
