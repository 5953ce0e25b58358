"""Rollouts through NeMo Gym's real SimpleAgent and weather resources server (example_single_tool_call) with
gym_rpc's ServerClient injected, while the resources server is killed with `kill -9`: run in the NeMo Gym venv by
tests/nemo_gym/test_nemo_gym_compat.py, never by pytest directly.

The resources server runs in a process of its own (`restart.py serve-resources PORT`), so the kill is real: its
connections are reset, its port refuses. Told `kill` on stdin, it sends itself SIGKILL from its event loop at a
moment no response is half written: a kill between a response's headers and its body cuts off a response its
caller already has, which no client can resend (aiohttp's, NeMo Gym's and gym_rpc's all return at the headers),
and would make the count of lost rollouts hang on where the kill happened to land (2 of 256 did once). The agent
and a stub Responses API model (it asks for `get_weather`, then answers) run in this process on uvicorn, as in
harness.py. Rollouts are posted to the agent's `/run` at a fixed concurrency, each bounded by its own timeout (a
hung rollout is reported, never waited for). Modes:

* restart: after half of the rollouts, the server is killed and a new process is back on the same port 1 s later
  (started beforehand, so its imports are done and it binds when told), with gym_rpc's default settings;
* restart-short: the same with every kind's time budget at 0.2 s, shorter than the restart (as gym_rpc's policy was
  before budgets in time: 3 attempts from 0.05 s): the contrast that shows the restart is felt. So that it is felt
  on a loaded machine too, where the rollouts in flight may take the whole second to reach their next call to the
  server or be past their last one (soak run B1 of the 2026-12-06 evening: none of 128 failed), the kill comes
  after a quarter of the rollouts (a quarter have yet to start), and the server is back after 1 s and once a
  rollout has failed since the kill (at most SHORT_OUTAGE_MAX_SECONDS);
* gone: after a quarter of them, the server is killed for good; the config's `http_client.retry` gives every kind
  a budget of BUDGET_SECONDS, so the rollouts that need the server fail within it.

It prints one JSON object: per mode, the number of rollouts, how many answered 200 with a reward, the failures
(status or error) with their durations, how long the slowest rollout took and when the server was killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import uvicorn
from omegaconf import OmegaConf
from resources_servers.example_single_tool_call.app import (
    SimpleWeatherResourcesServer,
    SimpleWeatherResourcesServerConfig,
)
from shared import KEEP_ALIVE_SECONDS, LOOPBACK, Asgi, held_socket, serving, simple_agent, stub_turn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

MODEL, RESOURCES, AGENT = "policy_model", "weather", "agent"
CONCURRENCY = 64
ROLLOUT_TIMEOUT_SECONDS = 120.0  # far beyond any budget: a rollout still running then has hung
BUDGET_SECONDS = 2.0  # every kind's time budget in the gone mode (the default refused budget is 30 s)
SHORT_BUDGET_SECONDS = 0.2  # restart-short: shorter than the restart
SHORT_OUTAGE_MAX_SECONDS = 30.0  # restart-short: the longest it waits for a failed rollout before coming back
START_TIMEOUT_SECONDS = 120.0  # importing NeMo Gym on a loaded 2-core machine takes tens of seconds
# What a failed rollout's report keeps of the agent's answer: its end, where the error's cause is (the last 300
# characters, kept before, cut the cause off and left only "... host and port in the global config are right").
ERROR_CHARS = 4000


async def _responses(request: Request) -> JSONResponse:
    """A Responses API model: the first turn asks for `get_weather`, the turn after the tool's output answers."""
    # harness's stub_turn is untyped here (mypy reads it as Any): the annotation says what it returns
    answer: JSONResponse = stub_turn(
        await request.json(), "get_weather", lambda: json.dumps({"city": "Paris"}), "cold"
    )
    return answer


def weather_model_app() -> Starlette:
    return Starlette(routes=[Route("/{prefix:path}v1/responses", _responses, methods=["POST"])])


# --- the resources server's own process --------------------------------------------------------------------------


class KillBetweenResponses:
    """ASGI wrapper around the whole app: counts the responses whose headers are sent and whose body is not yet,
    so that the process can kill itself at a moment when none is (requests being handled are cut off, as a kill
    does; a response is never cut in two)."""

    def __init__(self, app: Asgi) -> None:
        self.app = app
        self.half_written = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def counting_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.half_written += 1
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and started:
                started = False
                self.half_written -= 1

        try:
            await self.app(scope, receive, counting_send)
        finally:
            if started:
                self.half_written -= 1

    def kill_when_no_response_is_half_written(self) -> None:
        """Runs on the event loop, so nothing is sent between the count's check and the kill."""
        if self.half_written == 0:
            os.kill(os.getpid(), signal.SIGKILL)
            return
        asyncio.get_running_loop().call_later(0.001, self.kill_when_no_response_is_half_written)


def _kill_when_told(loop: asyncio.AbstractEventLoop, app: KillBetweenResponses) -> None:
    for line in sys.stdin:
        if line.strip() == "kill":
            loop.call_soon_threadsafe(app.kill_when_no_response_is_half_written)


async def _serve(app: KillBetweenResponses, sock: socket.socket) -> None:
    threading.Thread(target=_kill_when_told, args=(asyncio.get_running_loop(), app), daemon=True).start()
    config = uvicorn.Config(
        app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=KEEP_ALIVE_SECONDS
    )
    print("listening", flush=True)
    await uvicorn.Server(config).serve(sockets=[sock])


def serve_resources(port: int, wait_for_go: bool) -> None:
    """Build the weather server, say "ready", wait for "go" on stdin when asked to, then bind and serve until
    told "kill"."""
    server = SimpleWeatherResourcesServer.model_construct(
        config=SimpleWeatherResourcesServerConfig(host=LOOPBACK, port=port, entrypoint="app.py", name=RESOURCES),
        server_client=None,  # it calls no other server
    )
    app = server.setup_webserver()
    server.setup_exception_middleware(app)
    print("ready", flush=True)
    if wait_for_go and sys.stdin.readline().strip() != "go":
        return
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the killed server's connections linger
    sock.bind((LOOPBACK, port))
    sock.listen(1024)
    asyncio.run(_serve(KillBetweenResponses(app), sock))


class ResourcesProcess:
    def __init__(self, port: int, wait_for_go: bool) -> None:
        command = [sys.executable, str(Path(__file__).resolve()), "serve-resources", str(port)]
        if wait_for_go:
            command.append("--wait-for-go")
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    async def line(self) -> str:
        assert self.process.stdout is not None
        return (await asyncio.to_thread(self.process.stdout.readline)).strip()

    async def expect(self, wanted: str) -> None:
        got = await asyncio.wait_for(self.line(), START_TIMEOUT_SECONDS)
        if got != wanted:
            raise RuntimeError(f"the resources server said {got!r}, not {wanted!r}")

    def _tell(self, word: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{word}\n")
        self.process.stdin.flush()

    def go(self) -> None:
        self._tell("go")

    def kill(self) -> None:
        """SIGKILL, sent by the server to itself between two responses (KillBetweenResponses). The wait blocks
        the caller's event loop, as a kill from outside takes no time: no rollout starts or ends meanwhile."""
        self._tell("kill")
        self.process.wait(10)
        if self.process.returncode != -signal.SIGKILL:
            raise RuntimeError(f"the resources server exited {self.process.returncode}, not killed")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


# --- the rollouts ------------------------------------------------------------------------------------------------


def _reserved_port() -> socket.socket:
    """A loopback port kept bound, never listening, while its mode runs: a connection to it is refused, and no
    bind(port 0) or outgoing connection on the machine can be given it in the tens of seconds a resources process
    imports NeMo Gym before binding it (SO_REUSEADDR on both sides). A port released at once was taken in that time
    (soak run B5 of 2026-12-06: the first process's bind failed with EADDRINUSE)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    return sock


def global_config(ports: dict[str, int], mode: str) -> dict[str, Any]:
    def entry(server_type: str, impl: str, name: str, **extra: Any) -> dict[str, Any]:
        return {server_type: {impl: {"host": LOOPBACK, "port": ports[name], "entrypoint": "app.py", **extra}}}

    doc: dict[str, Any] = {
        "head_server": {"host": LOOPBACK, "port": 0},  # never asked: the config is given to the client
        MODEL: entry("responses_api_models", "stub_model", MODEL),
        RESOURCES: entry("resources_servers", "example_single_tool_call", RESOURCES),
        AGENT: entry(
            "responses_api_agents",
            "simple_agent",
            AGENT,
            resources_server={"type": "resources_servers", "name": RESOURCES},
            model_server={"type": "responses_api_models", "name": MODEL},
        ),
    }
    if mode in ("gone", "restart-short"):
        every_kind = {"seconds": BUDGET_SECONDS if mode == "gone" else SHORT_BUDGET_SECONDS}
        doc["http_client"] = {
            "retry": {
                kind: every_kind for kind in ("refused", "dropped_before_write", "dropped_after_write", "timeout")
            }
        }
    return doc


async def _rollout(session: aiohttp.ClientSession, url: str, index: int) -> dict[str, Any]:
    body = {
        "responses_create_params": {"input": "What is the weather in Paris?"},
        "_ng_task_index": index,
        "_ng_rollout_index": 0,
    }
    started = time.monotonic()
    outcome: dict[str, Any] = {"index": index, "started": started}
    try:
        async with asyncio.timeout(ROLLOUT_TIMEOUT_SECONDS):
            async with session.post(url, json=body) as response:
                text = await response.text()
        outcome["status"] = response.status
        if response.status == 200:
            outcome["reward"] = json.loads(text).get("reward")
        else:
            outcome["error"] = text[-ERROR_CHARS:]
    except TimeoutError:
        outcome["hung"] = True
    except Exception as exc:  # the agent itself failing to answer is a failed rollout too
        outcome["error"] = f"{type(exc).__name__}: {exc}"
    outcome["seconds"] = time.monotonic() - started
    return outcome


class Servers:
    """The resources processes of one mode, started before any mode runs (importing NeMo Gym takes a while): the
    one serving at once, and, for a restart, the one that binds the same port when told."""

    def __init__(self, mode: str) -> None:
        self.reserved = _reserved_port()
        self.port = int(self.reserved.getsockname()[1])
        self.first = ResourcesProcess(self.port, wait_for_go=False)
        self.second = ResourcesProcess(self.port, wait_for_go=True) if mode.startswith("restart") else None

    async def ready(self) -> None:
        await self.first.expect("ready")
        await self.first.expect("listening")
        if self.second is not None:
            await self.second.expect("ready")

    def stop(self) -> None:
        for process in (self.first, self.second):
            if process is not None:
                process.stop()
        self.reserved.close()


def _answered(outcome: dict[str, Any]) -> bool:
    return outcome.get("status") == 200 and outcome.get("reward") == 1.0


async def run_mode(mode: str, rollouts: int, servers: Servers) -> dict[str, Any]:
    from gym_rpc.client.server_client import ServerClient
    from gym_rpc.config import BaseServerConfig

    sockets = {name: held_socket() for name in (MODEL, AGENT)}
    ports = {name: int(sock.getsockname()[1]) for name, sock in sockets.items()}
    ports[RESOURCES] = servers.port
    doc = global_config(ports, mode)
    first, second = servers.first, servers.second
    try:
        await servers.ready()
        client = ServerClient(
            head_server_config=BaseServerConfig(host=LOOPBACK, port=1), global_config_dict=OmegaConf.create(doc)
        )
        agent = simple_agent(ports[AGENT], client, resources=RESOURCES)
        agent_app = agent.setup_webserver()
        agent.setup_exception_middleware(agent_app)
        apps: dict[str, tuple[Asgi, socket.socket]] = {
            MODEL: (weather_model_app(), sockets[MODEL]),
            AGENT: (agent_app, sockets[AGENT]),
        }
        kill_after = rollouts // 2 if mode == "restart" else rollouts // 4
        done = 0
        killed_at: float | None = None
        back_at: float | None = None
        failed_since_kill = asyncio.Event()
        limit = asyncio.Semaphore(CONCURRENCY)
        url = f"http://{LOOPBACK}:{ports[AGENT]}/run"

        async def one(session: aiohttp.ClientSession, index: int) -> dict[str, Any]:
            nonlocal done, killed_at, back_at
            async with limit:
                outcome = await _rollout(session, url, index)
            done += 1
            if killed_at is not None and not _answered(outcome):
                failed_since_kill.set()
            if done == kill_after:
                first.kill()
                killed_at = time.monotonic()
                if second is not None:
                    await asyncio.sleep(1.0)
                    if mode == "restart-short":
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(failed_since_kill.wait(), SHORT_OUTAGE_MAX_SECONDS)
                    second.go()
                    await second.expect("listening")
                    back_at = time.monotonic()
            return outcome

        connector = aiohttp.TCPConnector(limit=CONCURRENCY)
        async with serving(apps), aiohttp.ClientSession(connector=connector) as session:
            started = time.monotonic()
            outcomes = await asyncio.gather(*(one(session, index) for index in range(rollouts)))
            took = time.monotonic() - started
        await client.aclose()
    finally:
        servers.stop()
    answered = [o for o in outcomes if _answered(o)]
    failed = [o for o in outcomes if o not in answered]
    return {
        "rollouts": rollouts,
        "answered": len(answered),
        "failed": [{k: v for k, v in o.items() if k != "started"} for o in failed],
        "hung": sum(1 for o in outcomes if o.get("hung")),
        "slowest_seconds": max(o["seconds"] for o in outcomes),
        "seconds": took,
        "killed": killed_at is not None,
        "back_after_seconds": None if back_at is None or killed_at is None else back_at - killed_at,
        "started_after_kill": sum(1 for o in outcomes if killed_at and o["started"] >= killed_at),
        "failed_started_after_kill": sum(1 for o in failed if killed_at and o["started"] >= killed_at),
        "budget_seconds": BUDGET_SECONDS,
    }


async def main(modes: list[str]) -> None:
    planned = [(mode, int(rollouts)) for mode, rollouts in (given.split(":") for given in modes)]
    servers = {mode: Servers(mode) for mode, _ in planned}
    results = {}
    try:
        for mode, rollouts in planned:
            results[mode] = await run_mode(mode, rollouts, servers[mode])
    finally:
        for each in servers.values():
            each.stop()
    print(json.dumps(results))


if __name__ == "__main__":
    os.environ.pop("NEMO_GYM_CONFIG_DICT", None)  # the config is handed to the client
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve-resources")
    serve.add_argument("port", type=int)
    serve.add_argument("--wait-for-go", action="store_true")
    run = sub.add_parser("run")
    run.add_argument("--modes", default="restart:256,restart-short:128,gone:128", help="MODE:ROLLOUTS,...")
    args = parser.parse_args()
    if args.command == "serve-resources":
        serve_resources(args.port, args.wait_for_go)
    else:
        asyncio.run(main(args.modes.split(",")))
