"""A bound on what `ServerClient.post` keeps alive on its way to aiohttp, counted exactly in a fresh interpreter
(tests/support/scenarios/hot_path_allocations.py says how): it fails when a change adds objects to the data-plane
hot path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.support import REPO_ROOT
from tests.support.scenarios import script

# What ServerClient.post holds at aiohttp's request start beyond the same request made on the session directly.
# Lower it when a change removes objects; a change that needs more must show in bench/ that they pay.
MAX_EXTRA_OBJECTS = 2  # the `_call` coroutine (`client.post` is it: _DirectCall) and its kwargs dict
MAX_EXTRA_OBJECTS_OBSERVED = 2  # observability on: the rollout prefix rule's URL path is transient
# Traced, in a rollout the sampler dropped: those two alone. No span, so the call is sent as an untraced one is,
# with no coroutine of `send`'s (4 before), and its traceparent headers are the rollout's, made once (3 before).
MAX_EXTRA_OBJECTS_UNSAMPLED = 2


def counted(*args: str) -> dict[str, Any]:
    scenario = script("hot_path_allocations")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NEMO_GYM_OTEL_", "NEMO_LENS_"))}
    env["PYTHONPATH"] = str(REPO_ROOT)
    completed = subprocess.run(
        [sys.executable, str(scenario), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert completed.returncode == 0, completed.stderr
    line = next(line for line in completed.stdout.splitlines() if line.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    return result


def test_post_holds_at_most_a_few_objects_beyond_aiohttps_own() -> None:
    result = counted()
    first, second = result["plain"]
    assert first == second  # exact: the same every time
    assert 0 < first <= MAX_EXTRA_OBJECTS, f"ServerClient.post holds {first} objects beyond aiohttp's own"
    observed = result["observed"]
    assert 0 < observed <= MAX_EXTRA_OBJECTS_OBSERVED, (
        f"with the rollout prefix, ServerClient.post holds {observed} objects beyond aiohttp's own"
    )


def test_an_unsampled_call_holds_no_more_than_its_traceparent_beyond_an_untraced_one() -> None:
    unsampled = counted("unsampled")["unsampled"]
    assert 0 < unsampled <= MAX_EXTRA_OBJECTS_UNSAMPLED, (
        f"traced in an unsampled rollout, ServerClient.post holds {unsampled} objects beyond aiohttp's own"
    )
