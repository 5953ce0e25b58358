"""Several hosts: the head, a data server binding 0.0.0.0 and a worker, each in its own network namespace.

The test builds its own hosts with `ip netns add` and veth pairs on a private subnet that exists only inside those
namespaces (10.231.0.0/24 behind a bridge in the head's namespace): no route leads anywhere else, so no traffic
leaves them. The server registers with the head; the worker, which would dial its own loopback for a 0.0.0.0 entry,
reaches the server through the address the head advertises, and `gym-rpc status` run on the worker's host shows the
server up. Needs root (CAP_SYS_ADMIN) and iproute2; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import REPO_ROOT

HEAD_IP, SERVER_IP, WORKER_IP = "10.231.0.1", "10.231.0.2", "10.231.0.3"
PREFIX_LENGTH = 24
HEAD_PORT, SERVER_PORT = 11000, 8000
READY_TIMEOUT_SECONDS = 20

SERVER_SCRIPT = """
import sys
from aiohttp import web
from gym_rpc.integrations._registration import register_aiohttp_app

async def answer(request):
    return web.json_response({"path": request.raw_path, "peer": request.remote})

app = web.Application()
app.router.add_route("*", "/{tail:.*}", answer)
register_aiohttp_app(app, "policy", int(sys.argv[2]), head=sys.argv[1], refresh_seconds=None)
web.run_app(app, host="0.0.0.0", port=int(sys.argv[2]), print=lambda *_: print("serving", flush=True),
            access_log=None)
"""

WORKER_SCRIPT = """
import asyncio, json, sys
from gym_rpc.client.data._rollout import rollout_context
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig, parse_host_port
from gym_rpc.client.control._clients import SyncControlClient

mode, head = sys.argv[1], sys.argv[2]
if mode == "instances":
    rows = SyncControlClient(head).list_server_instances()
    print(json.dumps({r.name: {"advertised_url": r.advertised_url, "pid": r.pid} for r in rows}))
    sys.exit()
host, port = parse_host_port(head, "head")
client = ServerClient.load_from_global_config(BaseServerConfig(host=host, port=port))

async def rollouts():
    answers = []
    for i in range(3):
        with rollout_context(f"multihost-{i}"):
            response = await client.post("policy", "/v1/responses", json={"i": i})
            answers.append({"status": response.status, **(await response.json())})
    await client.aclose()
    return answers

answers = asyncio.run(rollouts())
print(json.dumps({"url": client._resolve_base_url("policy"), "answers": answers}))
"""


def run(*argv: str, timeout: float = 10) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=timeout)


def clean_environment() -> dict[str, str]:
    """The test's environment without anything that would point a gym_rpc process elsewhere."""
    drop = ("GYM_RPC_", "NEMO_GYM_", "OTEL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and "proxy" not in k.lower()}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return env


class TestHosts:
    """Three namespaces joined by veth pairs to a bridge in the head's namespace; torn down by `destroy`."""

    __test__ = False  # not a test class

    def __init__(self, tag: str) -> None:
        self.namespaces = {role: f"gymrpc-{role}-{tag}" for role in ("head", "server", "worker")}
        self.created: list[str] = []
        self.processes: list[subprocess.Popen[str]] = []

    def build(self) -> None:
        for namespace in self.namespaces.values():
            run("ip", "netns", "add", namespace)
            self.created.append(namespace)
            run("ip", "-n", namespace, "link", "set", "lo", "up")
        head = self.namespaces["head"]
        run("ip", "-n", head, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", head, "addr", "add", f"{HEAD_IP}/{PREFIX_LENGTH}", "dev", "br0")
        run("ip", "-n", head, "link", "set", "br0", "up")
        for role, address in (("server", SERVER_IP), ("worker", WORKER_IP)):
            # Both ends are made inside the namespaces: no interface ever appears in the machine's own.
            port_name = f"to-{role}"
            other = self.namespaces[role]
            run("ip", "-n", head, "link", "add", port_name, "type", "veth", "peer", "name", "eth0", "netns", other)
            run("ip", "-n", head, "link", "set", port_name, "master", "br0")
            run("ip", "-n", head, "link", "set", port_name, "up")
            run("ip", "-n", other, "addr", "add", f"{address}/{PREFIX_LENGTH}", "dev", "eth0")
            run("ip", "-n", other, "link", "set", "eth0", "up")

    def start(self, role: str, *argv: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces[role], *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_environment(),
            cwd=REPO_ROOT,
        )
        self.processes.append(process)
        return process

    def run_in(self, role: str, *argv: str, timeout: float = 20) -> str:
        completed = subprocess.run(
            ["ip", "netns", "exec", self.namespaces[role], *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=clean_environment(),
            cwd=REPO_ROOT,
        )
        assert completed.returncode == 0, f"{argv} on {role}: {completed.stderr}"
        return completed.stdout

    def destroy(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate(timeout=5)
        for namespace in self.created:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)


def wait_for_line(process: subprocess.Popen[str], text: str) -> str:
    """Read the process's stdout until it shows `text` (bounded by READY_TIMEOUT_SECONDS)."""
    assert process.stdout is not None
    descriptor = process.stdout.fileno()
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    seen = b""
    while text.encode() not in seen:
        remaining = deadline - time.monotonic()
        ready, _, _ = select.select([descriptor], [], [], max(0.0, min(0.2, remaining)))
        chunk = os.read(descriptor, 65536) if ready else b""
        seen += chunk
        if (ready and not chunk) or remaining <= 0:  # the process ended, or time is up
            stderr = process.stderr.read() if process.stderr is not None and process.poll() is not None else ""
            pytest.fail(f"no {text!r} from {process.args!r} within {READY_TIMEOUT_SECONDS}s: {seen!r} {stderr}")
    return seen.decode()


@pytest.fixture
def hosts() -> Iterator[TestHosts]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    test_hosts = TestHosts(str(os.getpid()))
    try:
        try:
            run("ip", "netns", "add", test_hosts.namespaces["head"])
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot make network namespaces here (`ip netns add` failed: {exc.stderr.strip()})")
        run("ip", "netns", "del", test_hosts.namespaces["head"])
        test_hosts.build()
        yield test_hosts
    finally:
        test_hosts.destroy()


def config(tmp_path: Path) -> Path:
    doc: dict[str, Any] = {
        "head_server": {"host": HEAD_IP, "port": HEAD_PORT},
        "policy": {"responses_api_models": {"remote_model": {"host": "0.0.0.0", "port": SERVER_PORT}}},
        "observability_enabled": True,
    }
    path = tmp_path / "multihost.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def test_worker_reaches_a_wildcard_server_on_another_host(hosts: TestHosts, tmp_path: Path) -> None:
    head_address = f"{HEAD_IP}:{HEAD_PORT}"
    gym_rpc = [sys.executable, "-m", "gym_rpc"]
    head = hosts.start(
        "head",
        *gym_rpc,
        "head",
        "--config",
        str(config(tmp_path)),
        "--probe-interval",
        "0.2",
        "--probe-timeout",
        "1",
        "--open-registrations",  # a head beyond loopback without a token takes registrations only when told to
    )
    wait_for_line(head, "listening on")
    server = hosts.start("server", sys.executable, "-c", SERVER_SCRIPT, head_address, str(SERVER_PORT))
    wait_for_line(server, "serving")  # registered (startup) and listening

    instances = json.loads(hosts.run_in("worker", sys.executable, "-c", WORKER_SCRIPT, "instances", head_address))
    assert instances["policy"]["advertised_url"] == f"http://{SERVER_IP}:{SERVER_PORT}"  # the address it came from
    assert instances["policy"]["pid"] > 0

    outcome = json.loads(hosts.run_in("worker", sys.executable, "-c", WORKER_SCRIPT, "rollouts", head_address))
    assert outcome["url"] == f"http://{SERVER_IP}:{SERVER_PORT}"
    assert [a["status"] for a in outcome["answers"]] == [200, 200, 200]
    assert [a["path"] for a in outcome["answers"]] == [f"/ng-rollout/multihost-{i}/v1/responses" for i in range(3)]
    assert {a["peer"] for a in outcome["answers"]} == {WORKER_IP}  # really from the worker's host

    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while True:  # the head probes the advertised address every 0.2 s
        rows = json.loads(hosts.run_in("worker", *gym_rpc, "status", "--head", head_address, "--json"))
        policy = next(row for row in rows if row["name"] == "policy")
        if policy["status"] == "success":
            break
        assert time.monotonic() < deadline, f"gym-rpc status never showed policy up: {rows}"
        time.sleep(0.2)
    assert policy["url"] == f"http://{SERVER_IP}:{SERVER_PORT}"

    server.terminate()  # aiohttp's cleanup deregisters
    server.communicate(timeout=10)
    instances = json.loads(hosts.run_in("worker", sys.executable, "-c", WORKER_SCRIPT, "instances", head_address))
    assert instances["policy"] == {"advertised_url": "", "pid": 0}
