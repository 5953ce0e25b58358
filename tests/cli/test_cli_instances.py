"""`gym-rpc status -o wide` and `gym-rpc wait --instances N --label KEY=VALUE`, against a real `gym-rpc head` with
registered instances (issue 42, point 5): the wide table shows every instance's labels and the calls in flight its
process reported; `wait` waits for enough healthy instances of a name, or for instances carrying a label.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from gym_rpc.client.control._clients import SyncControlClient
from tests.support.cli import run_cli, running_cli, running_head, threaded_http_server, wait_for_instances
from tests.support.documents import document, server_entry, write_config
from tests.support.loopback import LOOPBACK

pytestmark = pytest.mark.process

WIDE_HEADER = [
    "NAME",
    "TYPE",
    "URL",
    "STATUS",
    "HTTP",
    "LATENCY",
    "LAST CHECKED",
    "PID",
    "UPTIME",
    "LABELS",
    "IN FLIGHT",
]


def test_status_wide_shows_each_instance_with_its_labels_and_calls_in_flight(tmp_path: Path) -> None:
    with threaded_http_server() as first, threaded_http_server() as second, threaded_http_server() as judge:
        doc = document(
            {"policy_model": server_entry(first.port), "judge": server_entry(judge.port, "resources_servers")}
        )
        with running_head(write_config(tmp_path / "gym.yaml", doc)) as head:
            SyncControlClient(head.address).register_server_instance(
                "policy_model",
                listen_port=second.port,
                listen_host=LOOPBACK,
                pid=77,
                labels={"weights_version": "42", "zone": "a"},
                in_flight=5,
            )
            wait_for_instances(head.address, 2)
            result = run_cli(["status", "--head", head.address, "-o", "wide"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.rstrip("\n").splitlines()
    assert re.split(r"\s{2,}", lines[0]) == WIDE_HEADER
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines[1:-1]]
    assert cells[0][:4] == ["policy_model", "responses_api_models", f"http://{LOOPBACK}:{first.port}", "2/2 up"]
    assert cells[0][-1] == "5"  # the server's calls in flight: its instances' sum
    own, registered = cells[1], cells[2]
    assert (own[0], own[-2], own[-1]) == (f"{LOOPBACK}:{first.port}", "-", "-")  # no process reported
    assert (registered[0], registered[7]) == (f"{LOOPBACK}:{second.port}", "77")
    assert registered[-2:] == ["weights_version=42,zone=a", "5"]
    assert cells[3][:4] == ["judge", "resources_servers", f"http://{LOOPBACK}:{judge.port}", "success"]
    assert cells[3][-2:] == ["-", "-"]  # one instance, never registered: no labels, nothing reported
    assert lines[-1] == "2/2 up"


def test_wait_for_n_instances_with_a_label(tmp_path: Path) -> None:
    """`wait --instances 2 --label weights_version=42` waits while one instance carries the label, and returns
    once a second one registers with it; the old weights' instance never counts."""
    with threaded_http_server() as first, threaded_http_server() as second, threaded_http_server() as third:
        doc = document({"policy_model": server_entry(first.port)})
        with running_head(write_config(tmp_path / "gym.yaml", doc)) as head:
            control = SyncControlClient(head.address)
            for port, pid, version in ((first.port, 10, "41"), (second.port, 20, "42")):
                control.register_server_instance(
                    "policy_model",
                    listen_port=port,
                    listen_host=LOOPBACK,
                    pid=pid,
                    labels={"weights_version": version},
                )
            wait_for_instances(head.address, 2)
            args = ["wait", "policy_model", "--head", head.address, "--timeout", "30"]
            with running_cli([*args, "--instances", "2", "--label", "weights_version=42"]) as waiting:
                # 1 of 2 so far: it says so and waits (a sleep of 1 s here let a loaded machine's CLI start only
                # after the second registration, so the "1/2" line never came)
                waiting.wait_for_stderr("policy_model (1/2 instances up with weights_version=42)", 60)
                assert waiting.process.poll() is None, waiting.stderr_text
                registered_at = time.monotonic()
                control.register_server_instance(
                    "policy_model",
                    listen_port=third.port,
                    listen_host=LOOPBACK,
                    pid=30,
                    labels={"weights_version": "42"},
                )
                assert waiting.wait(timeout=20) == 0, waiting.stderr_text
                print(
                    f"wait returned {time.monotonic() - registered_at:.2f} s after the second instance registered"
                )
            assert "policy_model (1/2 instances up with weights_version=42)" in waiting.stderr_text
            short = run_cli([*args[:-1], "1", "--instances", "4"])
            assert short.returncode == 1
            assert "policy_model (3/4 instances up)" in short.stderr
            labelled = run_cli([*args, "--label", "weights_version=41"])
            assert labelled.returncode == 0, labelled.stderr
            bad = run_cli([*args, "--label", "weights_version"])
            assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr
