"""Tracing that fits NeMo Gym's OpenTelemetry set-ups, with the SDK's in-memory exporter in fresh interpreters
(tests/support/scenarios/tracing_fit.py): no double CLIENT spans under aiohttp's instrumentation, no traces from
probes, one trace per rollout with `rollout_context(id, span=True)`, and the first config fetch traced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support import REPO_ROOT
from tests.support.cli import running_head
from tests.support.loopback import LOOPBACK
from tests.support.scenarios import script

SCENARIO = script("tracing_fit")
REPO = REPO_ROOT


def run_scenario(mode: str, **env: str) -> dict[str, Any]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NEMO_GYM_", "GYM_RPC_"))}
    environment.update(env, PYTHONPATH=str(REPO))
    completed = subprocess.run(
        [sys.executable, str(SCENARIO), mode], env=environment, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    line = next(line for line in completed.stdout.splitlines() if line.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def test_aiohttp_instrumentation_makes_the_only_client_spans_and_gets_our_attributes() -> None:
    spans = run_scenario("aiohttp-instrumented")["spans"]
    assert [s["kind"] for s in spans] == ["CLIENT", "CLIENT", "CLIENT"]  # one per request attempt, no second one
    model, first_attempt, resent = spans
    assert model["attributes"]["gym.server.name"] == "policy_model"
    assert model["attributes"]["gym.rollout_id"] == "r-1"
    assert "http.method" in model["attributes"] or "http.request.method" in model["attributes"]  # theirs
    assert first_attempt["attributes"]["gym.server.name"] == "judge"
    assert "http.request.resend_count" not in first_attempt["attributes"]
    assert resent["attributes"]["gym.server.name"] == "judge"
    assert resent["attributes"]["http.request.resend_count"] == 1


def test_a_rollout_span_puts_each_rollouts_calls_in_one_trace() -> None:
    spans = run_scenario("rollout-span")["spans"]
    rollouts = {s["attributes"]["gym.rollout_id"]: s for s in spans if s["name"] == "gym.rollout"}
    assert set(rollouts) == {"r-a", "r-b"}
    assert rollouts["r-a"]["trace_id"] != rollouts["r-b"]["trace_id"]
    for rollout_id, rollout in rollouts.items():
        assert rollout["parent_id"] is None and rollout["kind"] == "INTERNAL"
        calls = [s for s in spans if s["kind"] == "CLIENT" and s["attributes"]["gym.rollout_id"] == rollout_id]
        assert sorted(s["attributes"]["gym.server.name"] for s in calls) == ["judge", "policy_model"]
        for call in calls:
            assert (call["trace_id"], call["parent_id"]) == (rollout["trace_id"], rollout["span_id"])
    assert len(spans) == 6


def test_probes_start_no_trace_on_either_side() -> None:
    result = run_scenario("probes")
    assert result["tracing"] is True and result["status"] == "success"
    assert result["spans"] == []  # neither the instrumented probe client nor the probed server recorded a span


def test_the_first_config_fetch_is_traced(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    document = {"head_server": {"host": LOOPBACK, "port": 0}, "observability_enabled": True}
    config.write_text(yaml.safe_dump(document), encoding="utf-8")
    with running_head(config) as head:
        result = run_scenario("first-fetch", GYM_RPC_HEAD=head.address)
    assert result["tracing"] is True and result["observability"] is True
    fetches = [s for s in result["spans"] if s["name"] == "/gym_rpc.v1.ControlPlaneService/GetGlobalConfig"]
    assert len(fetches) == 1
    fetch = fetches[0]
    assert fetch["kind"] == "CLIENT"
    assert fetch["attributes"]["rpc.method"] == "GetGlobalConfig"
    assert fetch["attributes"]["server.port"] == int(head.address.rsplit(":", 1)[1])


def test_an_unsampled_rollouts_calls_make_no_span_and_carry_its_context() -> None:
    """Sampling is decided once per rollout: under a parent-based sampler the calls of a dropped rollout make no
    span and send the rollout's own context, unsampled; a kept rollout's calls are spans as always."""
    result = run_scenario("sampled-rollouts")
    keep, drop = result["rollouts"]["keep"], result["rollouts"]["drop"]
    calls = [s for s in result["spans"] if s["kind"] == "CLIENT"]
    assert [(s["trace_id"], s["parent_id"]) for s in calls] == [(keep["trace_id"], keep["span_id"])] * 2
    assert [s["name"] for s in result["spans"] if s["kind"] == "INTERNAL"] == ["gym.rollout"]  # "keep" only
    received = [header.split("-") for header in result["received"]]  # version, trace id, parent id, flags
    sent = [(trace_id, parent_id, int(flags, 16) & 1) for _, trace_id, parent_id, flags in received]
    kept = [(keep["trace_id"], s["span_id"], 1) for s in calls]
    dropped = (drop["trace_id"], drop["span_id"], 0)
    assert sent == [*kept, dropped, dropped]
