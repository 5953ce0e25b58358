"""bench/engines.py's simulated engine, as real processes on loopback: its prefix cache counts what routing changes
(a call whose prompt's full blocks an earlier call left in the cache prefills only the rest; another engine holds
nothing of it), `/metrics` speaks vLLM's names, and `/reset` empties the cache between pickers."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from bench.engines import (
    BLOCK_TOKENS,
    OUTPUT_TOKENS,
    SYSTEM_TOKENS,
    TASK_TOKENS,
    TOOL_TOKENS,
    timeline_summary,
    turn_body,
)
from tests.support import REPO_ROOT


@pytest.fixture
def engines() -> Iterator[list[int]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.engines", "serve", "2", "-1"],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        yield json.loads(process.stdout.readline())["ports"]
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=30)


def call(port: int, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    method = "GET" if body is None and path != "/reset" else "POST"
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data or b"", method=method)
    if body is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    return json.loads(text) if path != "/metrics" else text


def test_the_simulated_engine_prefills_only_what_its_cache_lacks(engines: list[int]) -> None:
    first, other = engines
    prompt = SYSTEM_TOKENS + TASK_TOKENS
    assert call(first, "/v1/responses", turn_body(3, 0, 0))["engine"] == first  # each answer names its engine
    assert call(first, "/stats") == {"prefill": prompt, "cached": 0, "calls": 1}
    call(first, "/v1/responses", turn_body(3, 1, 1))  # rollout 1's second turn: the prompt's full blocks are held
    held = prompt // BLOCK_TOKENS * BLOCK_TOKENS
    stats = call(first, "/stats")
    assert stats["cached"] == held and stats["calls"] == 2
    assert (
        stats["prefill"] == prompt + (prompt - held) + OUTPUT_TOKENS + TOOL_TOKENS
    )  # the rest, the answer, the tool's output
    call(other, "/v1/responses", turn_body(3, 1, 1))
    assert call(other, "/stats")["cached"] == 0  # another engine holds nothing of it
    metrics = call(first, "/metrics")
    for name in ("vllm:num_requests_waiting 0", "vllm:num_requests_running 0", "vllm:kv_cache_usage_perc"):
        assert name in metrics
    call(first, "/reset")
    assert call(first, "/stats") == {"prefill": 0, "cached": 0, "calls": 0}


def test_the_timeline_tells_idle_engines_and_groups_sharing_one() -> None:
    """Where a run's time went, from each call's engine and times: engine 1 holds two groups at once for 1 s of
    the run's 4 and is idle for none; engine 2 is idle for 3 s of it, its last answer 1 s before the end."""
    row = {
        "started": 100.0,
        "makespan": 4.0,
        "ports": [1, 2],
        "timeline": [  # worker, prompt, rollout, turn, engine, sent, answered
            [0, 0, 0, 0, 1, 100.0, 102.0],
            [0, 0, 1, 0, 1, 100.0, 102.0],
            [1, 1, 0, 0, 1, 101.0, 104.0],
            [1, 2, 0, 0, 2, 102.0, 103.0],
        ],
    }
    summary = timeline_summary(row)
    assert summary["idle"] == [0.0, 0.75]
    assert summary["shared"] == [0.25, 0.0]
    assert summary["tails"] == [0.0, 1.0]
    assert summary["groups_on"] == [2, 1]
    assert summary["group_max"] == 3.0 and summary["group_sum"] == 6.0
