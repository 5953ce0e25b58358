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
import json
import os
import socket
from typing import Any

import aiohttp
from nemo_gym.config_types import BaseServerConfig as NemoGymServerConfig
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
from shared import (
    LOOPBACK,
    Asgi,
    Receive,
    Scope,
    Send,
    gym_rpc_head,
    held_socket,
    serving,
    simple_agent,
    stub_turn,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

MODEL, RESOURCES, AGENT = "policy_model", "counter", "agent"
SESSION_COOKIE = f"StatefulCounterResourcesServer___{RESOURCES}"  # NeMo Gym's SimpleServer names it so
# (task index, rollout index, initial count, increment the model asks for, expected count). The last expectation is
# wrong on purpose: its reward must be 0.0, so a reward of 1.0 elsewhere means the session's counter was right.
ROLLOUTS = ((0, 0, 1, 2, 3), (0, 1, 5, 4, 9), (1, 0, 2, 2, 0))
ROLLOUT_TIMEOUT_SECONDS = 30.0


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


async def _responses(request: Request) -> JSONResponse:
    body = await request.json()
    # shared.stub_turn is untyped here (mypy reads it as Any): the annotation says what it returns
    answer: JSONResponse = stub_turn(
        body, "increment_counter", lambda: json.dumps({"count": _requested_increment(body)}), "done"
    )
    return answer


def stub_model_app() -> Starlette:
    """A Responses API model server answering on every path that ends in /v1/responses (with or without a rollout
    prefix), as NeMo Gym's model servers do."""
    return Starlette(routes=[Route("/{prefix:path}v1/responses", _responses, methods=["POST"])])


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


def make_client(kind: str, doc: dict[str, Any], head_port: int) -> Any:
    """The client the servers get: NeMo Gym's own, or gym_rpc's given NeMo Gym's own head config model."""
    head = NemoGymServerConfig(host=LOOPBACK, port=head_port)
    if kind == "nemo_gym":
        return NemoGymServerClient(head_server_config=head, global_config_dict=OmegaConf.create(doc))
    from gym_rpc.client.server_client import setup_server_client

    return setup_server_client(head)


async def run_mode(kind: str, observability: bool) -> dict[str, Any]:
    sockets = {name: held_socket() for name in (MODEL, RESOURCES, AGENT)}
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
        agent = simple_agent(ports[AGENT], client, RESOURCES)
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
