"""ServerClient's metrics against real loopback servers, in fresh interpreters
(tests/support/scenarios/worker_metrics.py): requests, resends and give-ups counted when metrics are on; nothing
recorded when they are off."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

from tests.support import REPO_ROOT
from tests.support.scenarios import script

SCENARIO = script("worker_metrics")
REPO = REPO_ROOT
POST = {"http.request.method": "POST"}


def run_scenario(mode: str, **otel: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NEMO_GYM_OTEL_", "NEMO_LENS_"))}
    env.update(otel, PYTHONPATH=str(REPO))  # the scenario imports tests.support.servers
    completed = subprocess.run(
        [sys.executable, str(SCENARIO), mode], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert completed.returncode == 0, completed.stderr
    line = next(line for line in completed.stdout.splitlines() if line.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def points(result: dict[str, Any], name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
    """attributes (sorted items) -> value or count of one metric."""
    return {
        tuple(sorted(point["attributes"].items())): point.get("count", point.get("value"))
        for point in result["metrics"].get(name, [])
    }


def key(**attributes: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted({**POST, **attributes}.items()))


def test_requests_resends_and_unreachable_servers_are_counted() -> None:
    result = run_scenario("app")
    assert result["enabled"] is True and result["unreachable_raised"] is True
    assert points(result, "http.client.request.duration") == {
        key(**{"gym.server.name": "ok", "http.response.status_code": 200}): 5,
        key(**{"gym.server.name": "flaky", "http.response.status_code": 200}): 1,
        key(**{"gym.server.name": "gone", "error.type": "ServerUnreachableError"}): 1,
    }
    assert points(result, "gym.client.resends") == {  # by the kind of the failure each resend follows
        key(**{"gym.server.name": "flaky", "gym.failure.kind": "dropped_after_write"}): 1,  # resent once
        key(**{"gym.server.name": "gone", "gym.failure.kind": "refused"}): 2,  # 3 attempts (retry.attempts)
    }
    assert points(result, "gym.client.given_up") == {
        key(**{"gym.server.name": "gone", "gym.failure.kind": "refused", "gym.resend.limit": "attempts"}): 1,
    }
    assert points(result, "gym.client.unreachable") == {key(**{"gym.server.name": "gone"}): 1}
    assert set(points(result, "http.client.active_requests").values()) == {0}  # every call finished


def test_traced_calls_are_metered_as_untraced_ones_and_each_is_one_span() -> None:
    """With tracing on as well, every call is counted as without it and is one CLIENT span with its outcome: the
    span and the metrics both hear the call from inside `send`."""
    traced, untraced = run_scenario("app-traced"), run_scenario("app")
    for name in (
        "http.client.request.duration",
        "gym.client.resends",
        "gym.client.given_up",
        "gym.client.unreachable",
    ):
        assert points(traced, name) == points(untraced, name), name
    assert set(points(traced, "http.client.active_requests").values()) == {0}
    outcomes = sorted(
        (span["gym.server.name"], span.get("http.response.status_code", span.get("error.type")),
         span.get("http.request.resend_count", 0))
        for span in traced["spans"]
    )  # fmt: skip
    assert outcomes == [("flaky", 200, 1), ("gone", "ServerUnreachableError", 2)] + [("ok", 200, 0)] * 5


def test_off_records_nothing() -> None:
    result = run_scenario("off")
    assert result["enabled"] is False
    assert result["metrics"] == {}


def test_an_exporter_in_the_environment_turns_worker_metrics_on() -> None:
    result = run_scenario("env", OTEL_METRICS_EXPORTER="console")
    assert result["enabled"] is True
    assert result["provider"] == "opentelemetry.sdk.metrics._internal"


def test_exporter_none_keeps_them_off() -> None:
    result = run_scenario("env", OTEL_METRICS_EXPORTER="none")
    assert result["enabled"] is False


def test_nemo_gyms_switches_turn_worker_metrics_on_and_off() -> None:
    """NeMo Gym's `telemetry:` block (here with its console exporter) turns them on; its variables win over it."""
    assert run_scenario("gym-block")["enabled"] is True
    assert run_scenario("env", NEMO_GYM_OTEL_ENABLED="1", NEMO_GYM_OTEL_EXPORTER="console")["enabled"] is True
    assert run_scenario("gym-block", NEMO_GYM_OTEL_METRICS_ENABLED="false")["enabled"] is False
    assert run_scenario("gym-block", NEMO_GYM_OTEL_ENABLED="0")["enabled"] is False


DASHBOARD = REPO_ROOT / "examples" / "grafana-dashboard.json"
WORKER_METRIC = re.compile(r"\b((?:http_client|gym_client)_[a-z_]+)\{")


def test_prometheus_names_are_the_documented_ones_and_the_dashboards() -> None:
    exposed = set(run_scenario("prometheus")["exposed"])
    assert {
        "http_client_request_duration_seconds_bucket",
        "http_client_request_duration_seconds_count",
        "http_client_active_requests",
        "gym_client_resends_total",
        "gym_client_unreachable_total",
        "gym_client_instance_picks_total",
        "gym_client_instance_ejections_total",
    } <= exposed
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in WORKER_METRIC.findall(target["expr"])
    }
    assert queried, "the dashboard shows no worker metric"
    assert queried <= exposed, queried - exposed


def test_an_exporter_without_the_sdk_warns_and_the_worker_runs() -> None:
    """A base install has no opentelemetry-sdk: an exporter in the environment gets one warning naming the extra,
    and the worker's metrics stay off (the check for an application's provider needs no SDK)."""
    code = (
        "import sys; sys.modules['opentelemetry.sdk'] = None\n"  # what a base install sees: no SDK to import
        "from gym_rpc.metrics import METRICS, setup_client_metrics\n"
        "print(setup_client_metrics(), METRICS.enabled)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NEMO_GYM_OTEL_", "NEMO_LENS_"))}
    completed = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "OTEL_METRICS_EXPORTER": "console"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["False", "False"]
    assert "pip install 'gym-rpc[otlp]'" in completed.stderr
