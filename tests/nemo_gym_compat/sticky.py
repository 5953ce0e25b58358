"""Rollouts through NeMo Gym's real SimpleAgent and weather resources server (example_single_tool_call), the
resources server as three instances, with gym_rpc's ServerClient injected into the agent: run in the NeMo Gym venv
by tests/nemo_gym/test_nemo_gym_compat.py, never by pytest directly.

Each rollout is `/run` on the agent, which calls the weather server three times: `/seed_session` (its body names
the rollout by `_ng_task_index`/`_ng_rollout_index`; NeMo Gym binds its own rollout context around `/run` only with
observability on), `/get_weather` (made from the agent's self-called `/v1/responses`, where no rollout is bound:
only the session cookie names it) and `/verify` (the body and, with observability on, the context). Whatever each
call is known by, all three must reach one instance. Each instance records, on the server side, which rollout each
call belonged to: `/seed_session` and `/verify` by their body's indices, `/get_weather` by the city the stub model
asks about (`city-<task>-<rollout>`, read from the rollout's user message).

Modes, each `<instances>/<observability>`:
* static: the three instances are the config entry and its `replicas:`; the client is given the config (it asks
  no head);
* registered: a gym_rpc head (a subprocess) serves a config naming one instance, all three register with it
  (`ServerRegistration`), and the client, made from the head, follows it;
* registered-relisted: as registered, with every rollout in flight held between its `/seed_session` and its later
  calls (the stub model holds its first turn) while one registered instance that holds sessions deregisters and
  registers again at its address (a lease that lapsed and was renewed): the harness waits until the agent's client
  no longer lists it, then lists it again, and only then lets the rollouts on. No call reaches the resources
  server while the instance is off the list, so each of its sessions must find it again.

It prints one JSON object: per mode, the rollouts run, how many answered with reward 1.0, the calls each instance
served, the rollouts whose calls reached more than one instance, and those whose three calls did not all arrive
(and, relisted, which instance left and came back and how many sessions it held then).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp
from nemo_gym.config_types import BaseServerConfig as NemoGymServerConfig
from omegaconf import OmegaConf
from resources_servers.example_single_tool_call.app import (
    SimpleWeatherResourcesServer,
    SimpleWeatherResourcesServerConfig,
)
from shared import LOOPBACK, Asgi, gym_rpc_head, held_socket, serving, simple_agent, stub_turn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

MODEL, RESOURCES, AGENT = "policy_model", "weather", "agent"
INSTANCES = 3
GROUP = 4  # rollouts per task: NeMo Gym's rollout ids are `<task index>-<rollout index>`
ROLLOUT_TIMEOUT_SECONDS = 60.0
# Bounds of the relisted mode's waits (generous for a loaded machine, where each takes well under a second): every
# rollout in flight held at the model, then the client's route following one deregistration and one registration.
# Together they stay under ROLLOUT_TIMEOUT_SECONDS, so a wait that fails is named before the held rollouts give up.
HELD_TIMEOUT_SECONDS = 20.0
FOLLOW_TIMEOUT_SECONDS = 15.0
CITY = re.compile(r"city-(\d+)-(\d+)")
RESOURCES_CALLS = ("/seed_session", "/get_weather", "/verify")

Message = MutableMapping[str, Any]


class Hold:
    """Holds the model's first turn of each rollout (after its `/seed_session`, before its `/get_weather`) until
    released; `all_held` is set once `expected` turns wait. Turns that come after the release are not held."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.held = 0
        self.all_held = asyncio.Event()
        self.released = asyncio.Event()

    async def first_turn(self) -> None:
        if self.released.is_set():
            return
        self.held += 1
        if self.held >= self.expected:
            self.all_held.set()
        async with asyncio.timeout(ROLLOUT_TIMEOUT_SECONDS):  # the rollout has given up by then
            await self.released.wait()


def model_app(hold: Hold | None = None) -> Starlette:
    async def responses(request: Request) -> JSONResponse:
        """The model asks for the weather in the city its user message names, then answers."""
        body = await request.json()
        user = next(item for item in body["input"] if item.get("role") == "user")
        city = CITY.search(str(user["content"]))
        assert city is not None, user
        first = not any(item.get("type") == "function_call_output" for item in body["input"])
        if hold is not None and first:
            await hold.first_turn()
        # shared.stub_turn is untyped here (mypy reads it as Any): the annotation says what it returns
        answer: JSONResponse = stub_turn(body, "get_weather", lambda: json.dumps({"city": city.group(0)}), "cold")
        return answer

    return Starlette(routes=[Route("/{prefix:path}v1/responses", responses, methods=["POST"])])


class Counting:
    """Outermost ASGI layer of one instance: which rollout each call to a resources path belongs to, read from the
    request's body (replayed to the app unchanged)."""

    def __init__(self, app: Asgi, port: int, seen: list[tuple[str, int, str]]) -> None:
        self.app = app
        self.port = port
        self.seen = seen

    async def __call__(self, scope: Message, receive: Callable[[], Awaitable[Message]], send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        call = next((name for name in RESOURCES_CALLS if path.endswith(name)), None)
        if call is None:
            await self.app(scope, receive, send)
            return
        messages = [await receive()]
        while messages[-1].get("more_body"):
            messages.append(await receive())
        body = json.loads(b"".join(message.get("body", b"") for message in messages) or b"{}")
        if call == "/get_weather":
            found = CITY.fullmatch(str(body.get("city")))
            rollout = f"{found.group(1)}-{found.group(2)}" if found else "?"
        else:
            rollout = f"{body.get('_ng_task_index')}-{body.get('_ng_rollout_index')}"
        self.seen.append((rollout, self.port, call))
        replay = iter(messages)

        async def replayed() -> Message:
            try:
                return next(replay)
            except StopIteration:
                return await receive()

        await self.app(scope, replayed, send)


def weather_app(port: int, seen: list[tuple[str, int, str]]) -> Asgi:
    server = SimpleWeatherResourcesServer.model_construct(
        config=SimpleWeatherResourcesServerConfig(host=LOOPBACK, port=port, entrypoint="app.py", name=RESOURCES),
        server_client=None,  # it calls no other server
    )
    app = server.setup_webserver()
    server.setup_exception_middleware(app)
    return Counting(app, port, seen)


def global_config(ports: dict[str, int], weather: list[int], static: bool, observability: bool) -> dict[str, Any]:
    def entry(server_type: str, impl: str, port: int, **extra: Any) -> dict[str, Any]:
        return {server_type: {impl: {"host": LOOPBACK, "port": port, "entrypoint": "app.py", **extra}}}

    replicas = {"replicas": [f"{LOOPBACK}:{port}" for port in weather[1:]]} if static else {}
    return {
        "head_server": {"host": LOOPBACK, "port": 0},
        MODEL: entry("responses_api_models", "stub_model", ports[MODEL]),
        RESOURCES: entry("resources_servers", "example_single_tool_call", weather[0], **replicas),
        AGENT: entry(
            "responses_api_agents",
            "simple_agent",
            ports[AGENT],
            resources_server={"type": "resources_servers", "name": RESOURCES},
            model_server={"type": "responses_api_models", "name": MODEL},
        ),
        "observability_enabled": observability,
    }


async def _rollout(session: aiohttp.ClientSession, url: str, task: int, rollout: int) -> float | None:
    body = {
        "responses_create_params": {"input": f"What is the weather in city-{task}-{rollout}?"},
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
    }
    async with asyncio.timeout(ROLLOUT_TIMEOUT_SECONDS), session.post(url, json=body) as response:
        answer = await response.json()
        if response.status != 200:
            raise RuntimeError(f"/run answered {response.status}: {answer}")
    reward: float | None = answer.get("reward")
    return reward


async def _registered_client(weather: list[int], head_port: int) -> tuple[Any, list[Any]]:
    """All three instances registered with the head, then a client made from the head (it follows the head)."""
    from gym_rpc.client.server_client import setup_server_client
    from gym_rpc.integrations import ServerRegistration

    head = f"{LOOPBACK}:{head_port}"
    registrations = [
        ServerRegistration(
            RESOURCES, port, listen_host=LOOPBACK, head=head, refresh_seconds=None, server_type="resources_servers"
        )
        for port in weather
    ]
    for registration in registrations:
        await registration.aregister()
    client = await asyncio.to_thread(setup_server_client, NemoGymServerConfig(host=LOOPBACK, port=head_port))
    return client, registrations


async def _until(done: Callable[[], bool], what: str) -> None:
    """Poll `done` (the client's route, which nothing tells of a change) until it holds; past
    FOLLOW_TIMEOUT_SECONDS the run fails naming `what`. tests/support's `eventually` is not importable here."""
    try:
        async with asyncio.timeout(FOLLOW_TIMEOUT_SECONDS):
            while not done():  # noqa: ASYNC110 (polled)
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise RuntimeError(f"not within {FOLLOW_TIMEOUT_SECONDS:g} s: {what}") from None


async def _relist(route: Any, registrations: list[Any], seen: list[tuple[str, int, str]]) -> dict[str, int]:
    """The registered instance (not the config's) holding the most sessions deregisters; once the client's route
    no longer lists it, it registers again at its address, and the route lists it again, alive."""
    seeded = collections.Counter(port for _, port, call in seen if call == "/seed_session")
    holding = [registration for registration in registrations[1:] if seeded[registration.port]]
    if not holding:
        raise RuntimeError(f"no registered instance holds a session: {dict(seeded)}")
    registration = max(holding, key=lambda held: seeded[held.port])
    instance_id = registration.instance_id
    if not await registration.aderegister():
        raise RuntimeError(f"the head did not take the deregistration of {instance_id}")
    await _until(lambda: instance_id not in route.by_id, f"the client stops listing {instance_id}")
    if not await registration.aregister():
        raise RuntimeError(f"the head did not take the registration of {instance_id} again")
    await _until(
        lambda: instance_id in route.by_id and route.by_id[instance_id].alive,
        f"the client lists {instance_id} again",
    )
    return {"port": registration.port, "sessions": seeded[registration.port]}


async def run_mode(mode: str, rollouts: int, concurrency: int) -> dict[str, Any]:
    from gym_rpc.client.server_client import ServerClient
    from gym_rpc.config import BaseServerConfig

    instances, observability = mode.split("/")
    static = instances == "static"
    hold = Hold(min(rollouts, concurrency)) if instances == "registered-relisted" else None
    sockets = {name: held_socket() for name in (MODEL, AGENT)}
    weather_sockets = [held_socket() for _ in range(INSTANCES)]
    ports = {name: int(sock.getsockname()[1]) for name, sock in sockets.items()}
    weather = [int(sock.getsockname()[1]) for sock in weather_sockets]
    doc = global_config(ports, weather, static, observability == "on")
    seen: list[tuple[str, int, str]] = []
    relisted: dict[str, int] = {}
    with gym_rpc_head(doc) if not static else _no_head() as head_port:
        registrations: list[Any] = []
        if static:
            client = ServerClient(
                head_server_config=BaseServerConfig(host=LOOPBACK, port=1),
                global_config_dict=OmegaConf.create(doc),
            )
        else:
            client, registrations = await _registered_client(weather, head_port)
        agent = simple_agent(ports[AGENT], client, resources=RESOURCES)
        agent_app = agent.setup_webserver()
        agent.setup_exception_middleware(agent_app)
        apps: dict[str, tuple[Asgi, socket.socket]] = {
            MODEL: (model_app(hold), sockets[MODEL]),
            AGENT: (agent_app, sockets[AGENT]),
        }
        for port, sock in zip(weather, weather_sockets, strict=True):
            apps[f"{RESOURCES}-{port}"] = (weather_app(port, seen), sock)
        limit = asyncio.Semaphore(concurrency)
        url = f"http://{LOOPBACK}:{ports[AGENT]}/run"

        async def one(session: aiohttp.ClientSession, index: int) -> float | None:
            async with limit:
                return await _rollout(session, url, index // GROUP, index % GROUP)

        connector = aiohttp.TCPConnector(limit=concurrency)
        async with serving(apps), aiohttp.ClientSession(connector=connector) as session:
            started = time.monotonic()
            running = asyncio.gather(*(one(session, index) for index in range(rollouts)))
            if hold is not None:
                try:
                    async with asyncio.timeout(HELD_TIMEOUT_SECONDS):
                        await hold.all_held.wait()
                    assert client._routing is not None  # a client made from a head routes
                    relisted = await _relist(client._routing.routes[RESOURCES], registrations, seen)
                except BaseException:
                    running.cancel()
                    await asyncio.gather(running, return_exceptions=True)
                    raise
                finally:
                    hold.released.set()  # before the servers stop: they wait for the held turns
            rewards = await running
            took = time.monotonic() - started
        routed = client._routing.routes[RESOURCES] if client._routing is not None else None
        route_instances = len(routed.instances) if routed is not None else 0
        await client.aclose()
        for registration in registrations:
            await registration.aderegister()
    by_rollout: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for rollout, port, call in seen:
        by_rollout[rollout].append((port, call))
    expected = {f"{index // GROUP}-{index % GROUP}" for index in range(rollouts)}
    return {
        "rollouts": rollouts,
        "rewarded": sum(1 for reward in rewards if reward == 1.0),
        "seconds": took,
        "route_instances": route_instances,
        "per_instance": dict(collections.Counter(port for _, port, _ in seen)),
        "split": sorted(rollout for rollout, calls in by_rollout.items() if len({port for port, _ in calls}) > 1),
        "incomplete": sorted(
            rollout
            for rollout in expected
            if sorted(call for _, call in by_rollout.get(rollout, [])) != sorted(RESOURCES_CALLS)
        ),
        "unexpected": sorted(set(by_rollout) - expected),
        "relisted": relisted,
    }


class _no_head:
    def __enter__(self) -> int:
        return 0

    def __exit__(self, *exc: object) -> None:
        return None


async def main(modes: list[str], rollouts: int, concurrency: int) -> None:
    results = {}
    for mode in modes:
        results[mode] = await run_mode(mode, rollouts, concurrency)
    print(json.dumps(results))


if __name__ == "__main__":
    os.environ.pop("NEMO_GYM_CONFIG_DICT", None)  # the config is handed to the client, or served by the head
    # The three instances share this process's one event loop with the agent and its rollouts: on a loaded machine
    # a probe of the head's can wait longer than its default 1 s for that loop, and the head would call every
    # instance down (NoHealthyInstanceError). What is checked here is where calls land, not probing: the heads
    # this harness starts (subprocesses, which read the variable) give a probe 30 s.
    os.environ["GYM_RPC_PROBE_TIMEOUT"] = "30"
    parser = argparse.ArgumentParser(description=__doc__)
    modes = ("static", "registered", "registered-relisted")
    parser.add_argument("--modes", default=",".join(f"{mode}/{obs}" for mode in modes for obs in ("off", "on")))
    parser.add_argument("--rollouts", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    asyncio.run(main(args.modes.split(","), args.rollouts, args.concurrency))
