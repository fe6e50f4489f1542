"""The harness's result from pytest's JUnit report: passed / failed / skipped, each failure's
first line, and the skip reasons with their counts."""

from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET


def main(report: str) -> None:
    root = ET.parse(report).getroot()
    passed: list[str] = []
    failed: list[tuple[str, str]] = []
    skipped: collections.Counter[str] = collections.Counter()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').removeprefix('tests.entrypoints.')}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if problem is not None:
            message = (problem.get("message") or problem.text or "").strip().splitlines() or [""]
            failed.append((name, message[0][:160]))
        elif skip is not None:
            skipped[(skip.get("message") or "").removeprefix("Skipped: ")[:100]] += 1
        else:
            passed.append(name)
    applying = len(passed) + len(failed)
    print(f"vLLM entrypoint tests against tidal: {len(passed)} passed of {applying} that apply "
          f"({len(failed)} failed or errored), {sum(skipped.values())} skipped")
    for name, message in failed:
        print(f"  FAIL {name}: {message}")
    for reason, count in skipped.most_common():
        print(f"  skip x{count}: {reason}")


if __name__ == "__main__":
    main(sys.argv[1])
