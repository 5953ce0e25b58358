"""Replica servers: instances of one replicated server on loopback, whose answers (statuses, Retry-After, holds,
resets, probes) a test sets, the `replica_servers` fixture that starts them, and `slowness_rule_off`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.replicas import _server_route
from tests.support.loopback import LOOPBACK


class ReplicaServer:
    """One instance of a replicated server on loopback, whose answers a test sets; it answers
    `{"instance": <its port>}` and counts what reaches it.

    * `status`: the answer's status (200); `answers`: (status, Retry-After or None) pairs answered first, in turn;
      `always`: one such pair for every call.
    * `hold`: an event each call waits for (None: none); `delay`: seconds each call then takes (a slow engine).
    * `fault`: "ok", "wedge" (never answers), "reset" (headers, part of the body, then a reset) or "silent"
      (headers, then a body that never comes).
    * `cookie`: (name, value) set on each answer (a NeMo Gym session cookie).
    * `probe_status`, with `probes_apart`: what `GET` (a head's probe) gets, apart from the calls and uncounted
      (None: the probe hangs, as a wedged process's would); without `probes_apart` a GET is a call like any other.
    * Counted: `calls`, `paths`, `in_flight` and `most_in_flight`; `arrived` is set by every call.

    It can stop and start again on the same port. `shutdown_timeout`: how long a stop waits for calls in flight.
    """

    def __init__(self, *, probes_apart: bool = False, shutdown_timeout: float = 60.0) -> None:
        self.probes_apart = probes_apart
        self.shutdown_timeout = shutdown_timeout
        self.status = 200
        self.answers: list[tuple[int, str | None]] = []
        self.always: tuple[int, str | None] | None = None
        self.hold: asyncio.Event | None = None
        self.delay = 0.0
        self.fault = "ok"
        self.cookie: tuple[str, str] | None = None
        self.probe_status: int | None = 200
        self.calls = 0
        self.paths: list[str] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.arrived = asyncio.Event()
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _probe(self, request: web.Request) -> web.StreamResponse:
        status = self.probe_status
        if status is None:
            await asyncio.sleep(3600)
            status = 504
        return web.json_response({"instance": self.port}, status=status)

    async def _call(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        self.arrived.set()
        self.paths.append(request.raw_path)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await request.read()
            if self.hold is not None:
                await self.hold.wait()
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.fault == "wedge":
                await asyncio.sleep(3600)
            if self.fault in ("reset", "silent"):
                response = web.StreamResponse(headers={"Content-Length": "1000"})
                await response.prepare(request)
                await response.write(b"{" * 10)
                if self.fault == "reset":
                    assert request.transport is not None
                    request.transport.abort()
                else:
                    await asyncio.sleep(3600)
                return response
            status, retry_after = self.always or (self.answers.pop(0) if self.answers else (self.status, None))
            headers = {"Retry-After": retry_after} if retry_after is not None else {}
            answer = web.json_response({"instance": self.port}, status=status, headers=headers)
            if self.cookie is not None:
                answer.set_cookie(*self.cookie)
            return answer
        finally:
            self.in_flight -= 1

    async def start(self, port: int = 0) -> int:
        app = web.Application()
        if self.probes_apart:
            app.router.add_get("/{tail:.*}", self._probe)
        app.router.add_route("*", "/{tail:.*}", self._call)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=self.shutdown_timeout)
        await runner.setup()
        await web.TCPSite(runner, LOOPBACK, port, reuse_address=True).start()
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@pytest.fixture
async def replica_servers() -> AsyncIterator[Callable[..., Awaitable[list[ReplicaServer]]]]:
    """Factory: `await replica_servers(count, **settings)` starts `count` ReplicaServers (settings: the
    constructor's); each is stopped, and the data plane's sessions closed, when the test ends."""
    started: list[ReplicaServer] = []

    async def start(count: int, **settings: Any) -> list[ReplicaServer]:
        made = [ReplicaServer(**settings) for _ in range(count)]
        for server in made:
            await server.start()
        started.extend(made)
        return made

    yield start
    await close_http_sessions()
    for server in started:
        await server.stop()


@pytest.fixture
def slowness_rule_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model server's route leaves an instance whose answers are slow (latency EWMA over 2.5x the median
    instance's and SLOW_MARGIN_SECONDS above it: gym_rpc.client.replicas._server_route), by design; its first
    answer counts in full, so one call a loaded machine stalls a few hundred ms makes it so, and a rollout placed
    there moves. A test of where a model server's rollouts go that is not about that rule turns it off (the rule's
    own tests are in tests/client/replicas/test_replicas_client.py); a resources server's rollouts stick exactly.
    """
    monkeypatch.setattr(_server_route, "SLOW_MARGIN_SECONDS", 3600.0)
