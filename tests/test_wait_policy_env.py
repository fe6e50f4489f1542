"""Importing tidal makes its own OpenMP threads wait passively, and hands child processes that are not
tidal (llama.cpp in the benchmarks) the caller's setting instead of tidal's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, os, subprocess, sys
import tidal
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('OMP_WAIT_POLICY'))"],
                       env=tidal.foreign_process_env(), capture_output=True, text=True, check=True)
print(json.dumps({"own": os.environ.get("OMP_WAIT_POLICY"), "child": child.stdout.strip()}))
"""


def _probe(policy: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_unset_policy_is_passive_for_tidal_and_unset_for_foreign_children() -> None:
    assert _probe(None) == {"own": "PASSIVE", "child": "None"}


def test_a_callers_policy_is_kept_for_tidal_and_for_foreign_children() -> None:
    assert _probe("ACTIVE") == {"own": "ACTIVE", "child": "ACTIVE"}
