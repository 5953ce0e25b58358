"""What `gym-rpc status` shows of replicas, against a real `gym-rpc head`: a server of several instances is a line
saying how many are up, then a line per instance under it; `-o json` lists every instance with its status, the
calls in flight its process reported, its labels and whether it drains. A server of one instance shows as before.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from gym_rpc.client.control._clients import SyncControlClient
from tests.support.cli import TABLE_HEADER, run_cli, running_head, threaded_http_server, wait_for_instances
from tests.support.documents import document, server_entry, write_config
from tests.support.loopback import LOOPBACK, closed_port


def test_status_shows_the_replicas_under_their_name(tmp_path: Path) -> None:
    with threaded_http_server() as first, threaded_http_server() as second, threaded_http_server() as judge:
        dead = closed_port()
        replicas = [f"{LOOPBACK}:{second.port}", {"host": LOOPBACK, "port": dead}]
        doc = document(
            {
                "policy_model": server_entry(first.port, replicas=replicas),
                "judge": server_entry(judge.port, "resources_servers"),
            }
        )
        with running_head(write_config(tmp_path / "gym.yaml", doc)) as head:
            wait_for_instances(head.address, 3)
            registered = closed_port()
            SyncControlClient(head.address).register_server_instance(
                "policy_model", listen_port=registered, listen_host=LOOPBACK, pid=4242, draining=True
            )
            wait_for_instances(head.address, 4)
            result = run_cli(["status", "--head", head.address])
    assert result.returncode == 0, result.stderr  # every server is up: policy_model through its replicas
    lines = result.stdout.rstrip("\n").splitlines()
    assert re.split(r"\s{2,}", lines[0]) == TABLE_HEADER
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines[1:-1]]
    assert (
        cells[0]
        == ["policy_model", "responses_api_models", f"http://{LOOPBACK}:{first.port}", "2/4 up"] + ["-"] * 5
    )
    instances = [(row[0], row[1], row[3]) for row in cells[1:5]]
    assert instances == [
        (f"{LOOPBACK}:{first.port}", "config", "success"),
        (f"{LOOPBACK}:{second.port}", "static_replica", "success"),
        (f"{LOOPBACK}:{dead}", "static_replica", "connection_error"),
        (f"{LOOPBACK}:{registered}", "registered", "connection_error (draining)"),
    ]
    assert all(line.startswith("  ") for line in lines[2:6])  # under their name
    assert cells[4][7] == "4242"  # the registered process's pid
    assert cells[5][:4] == ["judge", "resources_servers", f"http://{LOOPBACK}:{judge.port}", "success"]
    assert len(cells) == 6
    assert lines[-1] == "2/2 up"


def test_status_json_lists_each_instance_with_its_calls_in_flight_labels_and_draining(tmp_path: Path) -> None:
    with threaded_http_server() as server:
        doc = document({"policy_model": server_entry(server.port)})
        with running_head(write_config(tmp_path / "gym.yaml", doc)) as head:
            wait_for_instances(head.address, 1)
            replica = closed_port()
            SyncControlClient(head.address).register_server_instance(
                "policy_model",
                listen_port=replica,
                listen_host=LOOPBACK,
                pid=77,
                labels={"weights_version": "42"},
                draining=True,
                in_flight=3,
            )
            result = run_cli(["status", "--head", head.address, "-o", "json"])
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert (row["name"], row["status"], row["instances_up"]) == ("policy_model", "success", 1)
    config, registered = row["instances"]
    assert (config["instance_id"], config["origin"], config["status"], config["draining"]) == (
        f"{LOOPBACK}:{server.port}",
        "config",
        "success",
        False,
    )
    assert (config["in_flight"], config["labels"], config["pid"]) == (0, {}, None)
    assert {key: registered[key] for key in ("instance_id", "origin", "registration", "draining", "pid")} == {
        "instance_id": f"{LOOPBACK}:{replica}",
        "origin": "registered",
        "registration": "registered",
        "draining": True,
        "pid": 77,
    }
    assert (registered["in_flight"], registered["labels"]) == (3, {"weights_version": "42"})
