"""gym_rpc inside an `ng_run` deployment: the head at `head_server` is NeMo Gym's real HTTP head.

NeMo Gym's own `HeadServer.run_webserver()` runs in the NeMo Gym venv (tests/nemo_gym_compat/nemo_gym_head.py,
the venv built by tools/nemo_gym_venv.py), serving a config with one server up (a real aiohttp server) and one
down (a held, closed port). gym_rpc's clients (ServerClient, the control clients, `gym-rpc status|wait|config`)
must find out that it speaks HTTP and use its endpoints: the config from /global_config_dict_yaml, the instances
from /server_instances, statuses probed directly. Its log must hold no ERROR or WARNING line (an HTTP/2 preface
costs a uvicorn warning there), and each `poll_for_status` must cost about what NeMo Gym's own does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_rpc.client import ControlClient, SyncControlClient, SyncStatusWatch
from gym_rpc.client.server_client import ServerClient, rollout_context
from gym_rpc.errors import ControlPlaneError
from tests.support import REPO_ROOT
from tests.support.cli import ThreadedHttpServer, cli_env, run_cli, threaded_http_server
from tests.support.documents import server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.nemo_gym import BUILD_TIMEOUT_SECONDS

HEAD_RUNNER = REPO_ROOT / "tests" / "nemo_gym_compat" / "nemo_gym_head.py"
POLL_RATIO = REPO_ROOT / "tests" / "nemo_gym_compat" / "poll_ratio.py"
START_SECONDS = 60.0
# gym_rpc's poll_for_status against NeMo Gym's own, medians of interleaved blocks in one process (measured about
# 0.5 on an idle 2-core machine: http.client is lighter than requests); generous for a loaded machine.
MAX_POLL_RATIO = 1.5


class NemoGymHead:
    """NeMo Gym's HTTP head in its own venv, on `port`; `log()` is everything it wrote to stderr."""

    def __init__(self, python: str, config: Path, stderr: Path, port: int, document: dict) -> None:
        self._stderr = stderr
        self.port = port
        self.address = f"{LOOPBACK}:{port}"
        self.document = document
        self.process = subprocess.Popen(
            [python, str(HEAD_RUNNER), str(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr.open("w"),
            text=True,
            cwd=config.parent,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # bounded: the runner gives up after 30 s itself
        assert line.strip() == "ready", f"NeMo Gym's head did not start: {line!r}\n{self.log()}"

    def log(self) -> str:
        return self._stderr.read_text(encoding="utf-8", errors="replace")

    def stop(self) -> str:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return self.log()


@pytest.fixture(scope="module")
def model_server() -> Iterator[ThreadedHttpServer]:
    with threaded_http_server() as server:
        yield server


@pytest.fixture(scope="module")
def ng_run_head(nemo_gym_python: str, model_server: ThreadedHttpServer, tmp_path_factory: Any) -> Iterator[Any]:
    directory = tmp_path_factory.mktemp("ng_run")
    port = closed_port()
    doc = {
        "head_server": {"host": LOOPBACK, "port": port},
        "policy_model": server_entry(model_server.port, api_key="sk-secret-of-the-model"),
        "tools": server_entry(closed_port(), "resources_servers"),
    }
    config = directory / "config.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    head = NemoGymHead(nemo_gym_python, config, directory / "head.stderr", port, doc)
    try:
        yield head
    finally:
        head.stop()


def _problem_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "ERROR" in line or "WARNING" in line or "Traceback" in line]


@pytest.mark.timeout(BUILD_TIMEOUT_SECONDS + 120)
def test_control_client_reads_nemo_gyms_endpoints(ng_run_head: Any) -> None:
    client = SyncControlClient(ng_run_head.address, timeout_seconds=5)
    config = client.get_global_config()
    assert sorted(config.servers) == ["policy_model", "tools"]
    assert "sk-secret" not in config.redacted_json and "sk-secret" not in json.dumps(config.document)
    assert client.get_global_config(include_secrets=True).document["policy_model"]["responses_api_models"]
    assert client.get_global_config_if_changed(config.version) is None
    statuses = {r.server_name: r.status for r in client.list_server_statuses().reports}
    assert statuses == {"policy_model": "success", "tools": "connection_error"}
    assert client.get_server_status("policy_model").http_status == 200
    assert client.head_status() == "success"
    instances = {i.name: i for i in client.list_server_instances()}
    assert sorted(instances) == ["policy_model", "tools"] and instances["tools"].pid > 0
    with pytest.raises(ControlPlaneError, match="bridge") as refused:
        client.reload_global_config()
    assert refused.value.code.name == "UNIMPLEMENTED"


@pytest.mark.timeout(BUILD_TIMEOUT_SECONDS + 120)
async def test_async_control_client_and_watch(ng_run_head: Any) -> None:
    client = ControlClient(ng_run_head.address, timeout_seconds=5)
    assert sorted((await client.get_global_config()).servers) == ["policy_model", "tools"]
    events = client.watch_server_statuses(heartbeat_seconds=0.2, timeout=5)
    first = await anext(events)
    second = await anext(events)
    await events.aclose()
    assert first.kind == "snapshot" and {r.server_name for r in first.reports} == {"policy_model", "tools"}
    assert second.kind == "heartbeat" and second.config_version == first.config_version
    watch = SyncStatusWatch(SyncControlClient(ng_run_head.address), heartbeat_seconds=0.2, max_wait_seconds=5)
    for event in watch:
        assert event.kind == "snapshot"
        break


@pytest.mark.timeout(BUILD_TIMEOUT_SECONDS + 120)
async def test_server_client_rolls_out_and_polls_with_one_probe_each(
    ng_run_head: Any, model_server: ThreadedHttpServer
) -> None:
    client = ServerClient.load_from_global_config({"host": LOOPBACK, "port": ng_run_head.port})
    # As NeMo Gym's own client gets it: the whole config, the model's API key included.
    assert (
        client.global_config_dict.policy_model.responses_api_models.responses_api_models_impl.api_key
        == "sk-secret-of-the-model"
    )
    with rollout_context("task-1"):
        response = await client.post("policy_model", "/v1/responses", json={"input": "hi"})
        assert response.status == 200
        response.release()
    await client.aclose()
    assert client.poll_for_status("policy_model") == "success"
    assert client.poll_for_status("tools", timeout_seconds=2) == "connection_error"
    assert client.poll_for_status("head_server") == "success"


@pytest.mark.timeout(BUILD_TIMEOUT_SECONDS + 120)
def test_a_process_ng_run_launched_polls_its_head(ng_run_head: Any, tmp_path: Path) -> None:
    """With the config injected as `ng_run` injects it (NEMO_GYM_CONFIG_DICT): no warning, one probe."""
    script = (
        "import logging, time; logging.basicConfig(level=logging.WARNING)\n"
        "from gym_rpc.client.server_client import ServerClient\n"
        "client = ServerClient.load_from_global_config()\n"
        "print(client.poll_for_status('policy_model'), client.poll_for_status('head_server'))\n"
    )
    env = cli_env({"NEMO_GYM_CONFIG_DICT": yaml.safe_dump(ng_run_head.document)})
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["success", "success"]
    assert run.stderr == ""  # no "head unreachable, probed directly" warning: it knew what the head speaks


@pytest.mark.timeout(BUILD_TIMEOUT_SECONDS + 120)
def test_cli_status_wait_and_config(ng_run_head: Any) -> None:
    head = ["--head", ng_run_head.address]
    status = run_cli(["status", *head, "-o", "json"])
    assert status.returncode == 1, status.stderr  # tools is down
    rows = {row["name"]: row for row in json.loads(status.stdout)}
    assert rows["policy_model"]["status"] == "success" and rows["tools"]["status"] == "connection_error"
    assert rows["tools"]["pid"] > 0  # from /server_instances
    assert run_cli(["status", *head, "--allow-down", "tools"]).returncode == 0
    waited = run_cli(["wait", "policy_model", *head, "--timeout", "20"], timeout=40)
    assert waited.returncode == 0, waited.stderr
    config = run_cli(["config", *head, "-o", "json"])
    assert config.returncode == 0, config.stderr
    assert sorted(json.loads(config.stdout)) == ["head_server", "policy_model", "tools"]
    assert "sk-secret" not in config.stdout


@pytest.mark.timeout(BUILD_TIMEOUT_SECONDS + 180)
def test_poll_for_status_costs_what_nemo_gyms_own_does(nemo_gym_python: str, ng_run_head: Any) -> None:
    run = subprocess.run(
        [nemo_gym_python, str(POLL_RATIO), LOOPBACK, str(ng_run_head.port), "policy_model"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"poll_for_status: {result}")
    assert result["statuses"] == {"nemo_gym": ["success"], "gym_rpc": ["success"]}
    assert result["ratio"] <= MAX_POLL_RATIO, result


@pytest.mark.timeout(BUILD_TIMEOUT_SECONDS + 180)
def test_nemo_gyms_head_logged_no_error_or_warning(ng_run_head: Any) -> None:
    """Last in this module: everything above talked to the head; its log holds access lines only."""
    time.sleep(0.2)  # uvicorn writes a line after the answer
    log = ng_run_head.log()
    assert "GET /global_config_dict_yaml HTTP/1.1" in log  # the log is the one the calls above wrote to
    assert _problem_lines(log) == []
