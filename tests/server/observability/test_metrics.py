"""Metrics as a scraper sees them: a real `gym-rpc head` subprocess, `GET /metrics` parsed with prometheus_client's
own text parser, real servers stopped and started again."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.samples import Sample

from gym_rpc.client.control._clients import SyncControlClient
from tests.support import REPO_ROOT
from tests.support.cli import running_head, threaded_http_server
from tests.support.documents import server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.metrics import (
    HTTP_HEAD_PATTERN,
    METRICS_PATTERN,
    announced,
    scrape_until,
    value,
    write_config,
)


def changes(samples: list[Sample], **labels: str) -> float:
    """gym_server_status_changes_total summed over the series whose labels include `labels`."""
    name = "gym_server_status_changes_total"
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_up_gauge_follows_a_server_killed_and_restarted(tmp_path: Path) -> None:
    """The up gauge, the change counter and the probe histogram follow a server that stops and comes back. On a
    loaded machine a probe may see the stopping server time out (0.5 s) before it refuses connections, so the way
    down is counted as one change into connection_error, from success or from that timeout."""
    port = closed_port()
    with threaded_http_server(200, port=port) as server:
        config = write_config(tmp_path / "config.yaml", {"policy_model": server_entry(port)}, http_port=0)
        with running_head(config) as head:
            url = announced(head, HTTP_HEAD_PATTERN) + "/metrics"
            labels = {"gym_server_name": "policy_model", "gym_server_type": "responses_api_models"}
            up = scrape_until(url, lambda s: value(s, "gym_server_up", **labels) == 1.0, "policy_model up")
            left_success = changes(up, gym_server_name="policy_model", gym_status_from="success")

            server.stop()
            refused = {"gym_server_name": "policy_model", "gym_status_to": "connection_error"}
            down = scrape_until(
                url,
                lambda s: value(s, "gym_server_up", **labels) == 0.0 and changes(s, **refused) > 0,
                "policy_model down, refusing connections",
            )
            assert changes(down, **refused) == 1.0  # nothing listens from now on: it stays connection_error
            assert changes(down, gym_server_name="policy_model", gym_status_from="success") >= left_success + 1
            failed_probes = value(
                down,
                "gym_probe_duration_seconds_count",
                gym_server_name="policy_model",
                gym_server_status="connection_error",
            )
            assert failed_probes is not None and failed_probes >= 1.0

            with threaded_http_server(200, port=port):
                scrape_until(url, lambda s: value(s, "gym_server_up", **labels) == 1.0, "policy_model up again")


def test_head_gauges_and_rpc_counts(tmp_path: Path) -> None:
    with threaded_http_server() as server:
        config = write_config(tmp_path / "config.yaml", {"live": server_entry(server.port)})
        # --instance-series: the per-instance series the dashboard shows are on (off by default)
        with running_head(config, "--metrics-port", "0", "--instance-series", "100") as head:
            url = announced(head, METRICS_PATTERN)
            client = SyncControlClient(head.address, timeout_seconds=5.0)
            for _ in range(3):
                client.list_server_statuses()
            client.register_server_instance("live", pid=77, listen_host=LOOPBACK, listen_port=server.port)
            events = client.watch_server_statuses(heartbeat_seconds=0.1)
            next(events)  # the snapshot: the watch is open
            samples = scrape_until(url, lambda s: value(s, "gym_head_watchers") == 1.0, "one watcher")
            assert value(samples, "gym_head_registrations") == 1.0
            revision = value(samples, "gym_head_revision")
            assert revision is not None and revision > 1_700_000_000_000  # starts at the wall clock in ms
            listed = value(
                samples,
                "rpc_server_call_duration_seconds_count",
                rpc_method="ListServerStatuses",
                rpc_service="gym_rpc.v1.ControlPlaneService",
                rpc_grpc_status_code="0",
            )
            assert listed == 3.0
            events.close()  # ends the watch
            scrape_until(url, lambda s: value(s, "gym_head_watchers") == 0.0, "no watcher")
            unknown = SyncControlClient(head.address, timeout_seconds=5.0)
            with pytest.raises(Exception, match="nosuch"):
                unknown.get_server_status("nosuch")
            not_found = scrape_until(
                url,
                lambda s: (
                    value(s, "rpc_server_call_duration_seconds_count", rpc_method="GetServerStatus") is not None
                ),
                "a GetServerStatus call",
            )
            assert value(not_found, "rpc_server_call_duration_seconds_count", rpc_method="GetServerStatus") == 1.0
            assert (
                value(
                    not_found,
                    "rpc_server_call_duration_seconds_count",
                    rpc_method="GetServerStatus",
                    rpc_grpc_status_code="5",  # NOT_FOUND
                )
                == 1.0
            )
    assert_dashboard_uses_only(sample.name for sample in not_found)


DASHBOARD = REPO_ROOT / "examples" / "grafana-dashboard.json"
# A selector, not a label; the head's metrics (workers' are checked in test_worker_metrics).
METRIC_NAME = re.compile(r"\b((?:gym_(?!client_)|rpc_server_)[a-z_]+)\{")


def assert_dashboard_uses_only(exposed: Iterable[str]) -> None:
    """Every metric the Grafana dashboard queries is one the head exposes: a renamed metric fails here."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in METRIC_NAME.findall(target["expr"])
    }
    assert queried, "the dashboard queries no gym_rpc metric"
    assert queried <= set(exposed), queried - set(exposed)


@pytest.mark.parametrize(
    ("environ", "block"),
    [
        ({"OTEL_METRICS_EXPORTER": "none"}, None),
        ({"NEMO_GYM_OTEL_ENABLED": "0"}, None),  # NeMo Gym's switch, off by its variable
        ({}, {"enabled": True, "metrics_enabled": False, "exporter": "console"}),  # or by its config block
    ],
)
def test_metrics_off_answers_404(tmp_path: Path, environ: dict[str, str], block: dict[str, Any] | None) -> None:
    servers: dict[str, Any] = {"gone": server_entry(closed_port())}
    if block is not None:
        servers["telemetry"] = block
    config = write_config(tmp_path / "config.yaml", servers)
    with running_head(config, "--metrics-port", "0", env=environ) as head:
        url = announced(head, METRICS_PATTERN)
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(url, timeout=5)
        assert raised.value.code == 404


def test_per_instance_series_follow_each_instance_up_to_the_cap(tmp_path: Path) -> None:
    """gym_instance_up, _in_flight and _downs per instance (issue 42): an instance that stops answering turns 0 and
    counts a down, the calls in flight its process reported are exported, and instances past `--instance-series`
    are counted in gym_head_instance_series_dropped instead of named."""
    with threaded_http_server() as first, threaded_http_server() as second:
        dead = closed_port()
        replicated = server_entry(first.port, replicas=[f"{LOOPBACK}:{second.port}"])
        config = write_config(tmp_path / "gym.yaml", {"policy_model": replicated}, http_port=0)
        # Probes of 5 s: the live replica must never count a down, and at a load of 12 its threaded server once
        # answered a probe after running_head's 0.5 s. The dead ones are refused at once, whatever the timeout.
        with running_head(config, "--instance-series", "3", "--probe-timeout", "5") as head:
            url = announced(head, HTTP_HEAD_PATTERN) + "/metrics"
            SyncControlClient(head.address).register_server_instance(
                "policy_model", listen_port=dead, listen_host=LOOPBACK, pid=77, in_flight=6
            )
            SyncControlClient(head.address).register_server_instance(
                "policy_model", listen_port=closed_port(), listen_host=LOOPBACK, pid=78
            )
            ids = [f"{LOOPBACK}:{port}" for port in (first.port, second.port, dead)]

            def up(samples: list[Sample], instance: str) -> float | None:
                return value(
                    samples, "gym_instance_up", gym_server_name="policy_model", gym_server_instance_id=instance
                )

            samples = scrape_until(
                url, lambda s: up(s, ids[1]) == 1 and up(s, ids[2]) == 0, "the instances probed"
            )
            assert up(samples, ids[0]) == 1
            assert (
                len([s for s in samples if s.name == "gym_instance_up"]) == 3
            )  # the cap: the fourth is not named
            assert value(samples, "gym_head_instance_series_dropped") == 1
            in_flight = value(samples, "gym_instance_in_flight", gym_server_instance_id=ids[2])
            assert in_flight == 6
            assert value(samples, "gym_instance_in_flight", gym_server_instance_id=ids[0]) is None  # none reported
            second.stop()
            samples = scrape_until(url, lambda s: up(s, ids[1]) == 0, "the stopped replica down")
            assert value(samples, "gym_instance_downs_total", gym_server_instance_id=ids[1]) == 1
            assert value(samples, "gym_instance_downs_total", gym_server_instance_id=ids[0]) == 0
