"""Rollouts through NeMo Gym's own code, with NeMo Gym's ServerClient or gym_rpc's injected: run in the NeMo Gym
venv (Python >= 3.13, `nemo-gym` from the package registry), never by pytest directly.

Per mode (client x observability) it starts, on loopback ports it holds from the start:
* a gym_rpc head (`python -m gym_rpc head`, a subprocess) serving the mode's global config;
* NeMo Gym's real `SimpleAgent` (responses_api_agents/simple_agent) and its real `example_session_state_mgmt`
  resources server (a counter kept per session cookie), both served by uvicorn with the client injected;
* a stub model server speaking the Responses API: the first turn asks for `increment_counter`, the next answers.
Then it posts rollouts to the agent's `/run` and records what every server saw: the raw request path (before any
middleware strips a prefix) and whether the resources server's session cookie came with it. It prints one JSON
object, `{mode: {"rewards": [...], "seen": {server: [[path, cookie], ...]}}}`, for
tests/nemo_gym/test_nemo_gym_compat.py to compare hop for hop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import aiohttp
import uvicorn
import yaml
from nemo_gym.config_types import BaseServerConfig as NemoGymServerConfig
from nemo_gym.config_types import ModelServerRef, ResourcesServerRef
from nemo_gym.server_utils import (
    GlobalAIOHTTPAsyncClientConfig,
    is_global_aiohttp_client_setup,
    set_global_aiohttp_client,
)
from nemo_gym.server_utils import ServerClient as NemoGymServerClient
from omegaconf import OmegaConf
from resources_servers.example_session_state_mgmt.app import (
    StatefulCounterResourcesServer,
    StatefulCounterResourcesServerConfig,
)
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

LOOPBACK = "127.0.0.1"
MODEL, RESOURCES, AGENT = "policy_model", "counter", "agent"
SESSION_COOKIE = f"StatefulCounterResourcesServer___{RESOURCES}"  # NeMo Gym's SimpleServer names it so
# (task index, rollout index, initial count, increment the model asks for, expected count). The last expectation is
# wrong on purpose: its reward must be 0.0, so a reward of 1.0 elsewhere means the session's counter was right.
ROLLOUTS = ((0, 0, 1, 2, 3), (0, 1, 5, 4, 9), (1, 0, 2, 2, 0))
HEAD_START_TIMEOUT_SECONDS = 30.0
ROLLOUT_TIMEOUT_SECONDS = 30.0
KEEP_ALIVE_SECONDS = 30  # what NeMo Gym gives uvicorn (timeout_keep_alive): longer than the clients' 15 s pool

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


class Recorder:
    """Outermost ASGI layer: the raw path of each HTTP request and whether the session cookie came with it."""

    def __init__(self, app: Asgi, seen: list[list[Any]]) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/":  # "/" is the gym_rpc head's prober, on its own clock
            cookie = b"".join(value for key, value in scope["headers"] if key == b"cookie").decode()
            self.seen.append([scope["path"], f"{SESSION_COOKIE}=" in cookie])
        await self.app(scope, receive, send)


def _requested_increment(body: dict[str, Any]) -> int:
    """The stub model's whole intelligence: the user message says `increment by N`."""
    for item in body["input"]:
        if item.get("role") == "user":
            return int(str(item["content"]).split()[-1])
    raise ValueError("no user message in the input")


def stub_turn(body: dict[str, Any], tool: str, arguments: Callable[[], str], text: str) -> JSONResponse:
    """A Responses API model's turn: a call of `tool` with `arguments()`, then, once the input holds the tool's
    output, the message `text`."""
    output: dict[str, Any]
    if any(item.get("type") == "function_call_output" for item in body["input"]):
        content = [{"type": "output_text", "text": text, "annotations": []}]
        output = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "content": content}
    else:
        output = {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": tool,
            "arguments": arguments(),
            "status": "completed",
        }
    response = {"id": "resp_1", "object": "response", "created_at": 0, "model": "stub", "output": [output]}
    return JSONResponse({**response, "parallel_tool_calls": False, "tool_choice": "auto", "tools": []})


async def _responses(request: Request) -> JSONResponse:
    body = await request.json()
    return stub_turn(body, "increment_counter", lambda: json.dumps({"count": _requested_increment(body)}), "done")


def stub_model_app() -> Starlette:
    """A Responses API model server answering on every path that ends in /v1/responses (with or without a rollout
    prefix), as NeMo Gym's model servers do."""
    return Starlette(routes=[Route("/{prefix:path}v1/responses", _responses, methods=["POST"])])


def _held_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    return sock


def global_config(ports: dict[str, int], observability: bool) -> dict[str, Any]:
    def entry(server_type: str, impl: str, name: str, **extra: Any) -> dict[str, Any]:
        return {server_type: {impl: {"host": LOOPBACK, "port": ports[name], "entrypoint": "app.py", **extra}}}

    return {
        "head_server": {"host": LOOPBACK, "port": 0},
        MODEL: entry("responses_api_models", "stub_model", MODEL),
        RESOURCES: entry("resources_servers", "example_session_state_mgmt", RESOURCES),
        AGENT: entry(
            "responses_api_agents",
            "simple_agent",
            AGENT,
            resources_server={"type": "resources_servers", "name": RESOURCES},
            model_server={"type": "responses_api_models", "name": MODEL},
        ),
        "observability_enabled": observability,
    }


@contextlib.contextmanager
def gym_rpc_head(doc: dict[str, Any]) -> Any:
    """A gym_rpc head in its own process; yields its port."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "config.yaml"
        path.write_text(yaml.safe_dump(doc), encoding="utf-8")
        command = [sys.executable, "-m", "gym_rpc", "head", "--config", str(path), "--port", "0"]
        with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
            try:
                assert process.stdout is not None
                line = process.stdout.readline()  # the banner; the head exits (EOF) when it cannot start
                if "listening on" not in line:
                    raise RuntimeError(f"the gym_rpc head did not start: {line!r}")
                address = line.split("listening on", 1)[1].split()[0]
                yield int(address.rsplit(":", 1)[1])
            finally:
                process.terminate()
                process.wait(timeout=HEAD_START_TIMEOUT_SECONDS)


@contextlib.asynccontextmanager
async def serving(apps: dict[str, tuple[Asgi, socket.socket]]) -> AsyncIterator[None]:
    """uvicorn on the held sockets, one server per app, until the block ends. Idle connections are kept 30 s, as
    NeMo Gym runs its servers ("server keepalive > client keepalive"): with uvicorn's default 5 s, under the
    clients' 15 s pool, a pooled connection could be reused just as the server closed it, and the call dropped
    after its request was written (a restart run saw one such drop of a call to the agent)."""
    servers = [
        uvicorn.Server(
            uvicorn.Config(
                app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=KEEP_ALIVE_SECONDS
            )
        )
        for app, _ in apps.values()
    ]
    tasks = [
        asyncio.create_task(server.serve(sockets=[sock]))
        for server, (_, sock) in zip(servers, apps.values(), strict=True)
    ]
    try:
        while not all(server.started for server in servers):
            if any(task.done() for task in tasks):
                raise RuntimeError("a server failed to start")
            await asyncio.sleep(0.02)
        yield
    finally:
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


def simple_agent(port: int, client: Any, resources: str = RESOURCES) -> SimpleAgent:
    """NeMo Gym's SimpleAgent on `port`, calling `resources` and the model through `client`."""
    return SimpleAgent.model_construct(
        config=SimpleAgentConfig(
            host=LOOPBACK,
            port=port,
            entrypoint="app.py",
            name=AGENT,
            resources_server=ResourcesServerRef(type="resources_servers", name=resources),
            model_server=ModelServerRef(type="responses_api_models", name=MODEL),
        ),
        server_client=client,
    )


def make_client(kind: str, doc: dict[str, Any], head_port: int) -> Any:
    """The client the servers get: NeMo Gym's own, or gym_rpc's given NeMo Gym's own head config model."""
    head = NemoGymServerConfig(host=LOOPBACK, port=head_port)
    if kind == "nemo_gym":
        return NemoGymServerClient(head_server_config=head, global_config_dict=OmegaConf.create(doc))
    from gym_rpc.client.server_client import setup_server_client

    return setup_server_client(head)


async def run_mode(kind: str, observability: bool) -> dict[str, Any]:
    sockets = {name: _held_socket() for name in (MODEL, RESOURCES, AGENT)}
    ports = {name: int(sock.getsockname()[1]) for name, sock in sockets.items()}
    doc = global_config(ports, observability)
    seen: dict[str, list[list[Any]]] = {name: [] for name in sockets}
    with gym_rpc_head(doc) as head_port:
        # gym_rpc's client fetches the config from the head with a blocking call: off the loop, as in a server.
        client = await asyncio.to_thread(make_client, kind, doc, head_port)
        resources = StatefulCounterResourcesServer.model_construct(
            config=StatefulCounterResourcesServerConfig(
                host=LOOPBACK, port=ports[RESOURCES], entrypoint="app.py", name=RESOURCES
            ),
            server_client=client,
        )
        agent = simple_agent(ports[AGENT], client)
        apps: dict[str, tuple[Asgi, socket.socket]] = {}
        for name, server in ((RESOURCES, resources), (AGENT, agent)):
            app = server.setup_webserver()
            server.setup_exception_middleware(app)  # as NeMo Gym's run_webserver does
            apps[name] = (Recorder(app, seen[name]), sockets[name])
        apps[MODEL] = (Recorder(stub_model_app(), seen[MODEL]), sockets[MODEL])
        rewards = []
        async with serving(apps), aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            for task_index, rollout_index, initial, increment, expected in ROLLOUTS:
                body = {
                    "responses_create_params": {"input": f"increment by {increment}"},
                    "initial_count": initial,
                    "expected_count": expected,
                    "_ng_task_index": task_index,
                    "_ng_rollout_index": rollout_index,
                }
                url = f"http://{LOOPBACK}:{ports[AGENT]}/run"
                async with session.post(url, json=body) as response:
                    result = await response.json()
                    if response.status != 200:
                        raise RuntimeError(f"/run answered {response.status}: {result}")
                rewards.append(result["reward"])
        if kind == "gym_rpc":
            await client.aclose()
    return {"rewards": rewards, "seen": seen}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", default="nemo_gym,gym_rpc")
    args = parser.parse_args()
    # NeMo Gym's client sends through one process-wide session; set it up as `setup_server_client` would, without
    # parsing a Hydra command line.
    if not is_global_aiohttp_client_setup():
        set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
    results = {}
    for kind in args.clients.split(","):
        for observability in (False, True):
            mode = f"{kind}/{'on' if observability else 'off'}"
            results[mode] = await asyncio.wait_for(run_mode(kind, observability), ROLLOUT_TIMEOUT_SECONDS * 4)
    print(json.dumps(results))


if __name__ == "__main__":
    os.environ.pop("NEMO_GYM_CONFIG_DICT", None)  # each mode's config comes from its head or is passed in
    asyncio.run(main())
