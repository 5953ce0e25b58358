"""Run by tests/client/data/test_hot_path_allocations.py in a fresh interpreter: what `ServerClient.post` keeps
alive on its way to aiohttp, counted. A fresh process, and a client that follows no head, because the count is of
every object the collector tracks: a thread allocating meanwhile (another test's gRPC channel or watch, an instance
follower) would make it neither exact nor ours.

Counted without I/O on a real aiohttp ClientSession: a TraceConfig's `on_request_start` (aiohttp's public tracing
signal, sent inside `ClientSession._request` before any connection is made) counts the objects the garbage
collector tracks and raises, so the call goes no further. The same count for the same request made on the session
directly, with the body `json=` is turned into (gym_rpc's orjson payload), is subtracted: what remains is what
gym_rpc's code between the caller and aiohttp holds at that moment (its coroutines, its kwargs, its per-call
objects), whatever aiohttp itself allocates. The collector is off while counting, so the count is exact and the
same on every run; timing plays no part. An object made and freed before the hand-over is not counted: what the
bound keeps is what a call holds while aiohttp works, which is what the collector pays for at thousands in flight
(bench/allocations.py measures that against raw aiohttp, with the server).

Prints `RESULT {"plain": [n, n], "observed": n}` (the plain count twice, to show it is exact); with `unsampled`,
`RESULT {"unsampled": n}`, traced (an application's SDK provider) in a rollout the sampler dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from omegaconf import OmegaConf

from gym_rpc.client.data._http import close_http_sessions, json_payload
from gym_rpc.client.server_client import ServerClient, rollout_context
from gym_rpc.config import BaseServerConfig
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port

BODY: dict[str, Any] = {"model": "policy", "input": [{"role": "user", "content": "What is 6 * 7?"}]}


WARM_UP_CALLS = 3


class HandedOver(Exception):
    """Raised at aiohttp's request start, once counted: the call stops there, before any I/O."""


class Counter:
    """A real aiohttp session whose requests are counted at their start and stopped there."""

    def __init__(self) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(self._on_request_start)
        self.session = aiohttp.ClientSession(trace_configs=[trace], cookie_jar=aiohttp.DummyCookieJar())
        self.at_start: list[int] = []

    async def _on_request_start(self, session: aiohttp.ClientSession, context: Any, params: Any) -> None:
        self.at_start.append(len(gc.get_objects()))
        raise HandedOver

    async def objects_held(self, call: Callable[[], Awaitable[object]]) -> int:
        """Objects the collector tracks that are alive at aiohttp's request start and were not before `call`."""
        for _ in range(WARM_UP_CALLS):  # first calls fill caches (URLs, context variables, aiohttp's own)
            await handed_over(call)
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects())
            await handed_over(call)
        finally:
            gc.enable()
        return self.at_start[-1] - before


@contextlib.asynccontextmanager
async def counted_client(**global_keys: Any) -> AsyncIterator[tuple[ServerClient, Counter, str]]:
    """A client whose data pool is a Counter's session (for its running loop), and the URL its server has."""
    port = closed_port()  # never connected to: every call stops at its request start
    doc = document({"policy": server_entry(port)}, **global_keys)
    client = ServerClient(
        head_server_config=BaseServerConfig(host=LOOPBACK, port=closed_port()),
        global_config_dict=OmegaConf.create(doc),
    )
    client.follow_instances(False)  # no follower of the (absent) head allocating in its thread meanwhile
    counter = Counter()
    sessions = client._http.sessions()
    own, sessions.data = sessions.data, counter.session
    try:
        yield client, counter, f"http://{LOOPBACK}:{port}"
    finally:
        sessions.data = own
        await counter.session.close()
        await close_http_sessions()


async def extra_objects(client: ServerClient, counter: Counter, url: str, path: str, headers: Any = None) -> int:
    """What `client.post(json=BODY)` holds at aiohttp's request start beyond the same request sent directly (with
    `headers`, the ones the client adds)."""

    async def ours() -> object:
        return await client.post("policy", "/v1/responses", json=BODY)

    async def direct() -> object:
        return await counter.session.request("POST", url + path, data=json_payload(BODY), headers=headers)

    return await counter.objects_held(ours) - await counter.objects_held(direct)


async def handed_over(call: Callable[[], Awaitable[object]]) -> None:
    try:
        await call()
    except HandedOver:
        return
    raise AssertionError("the call was not stopped at its request start")


async def unsampled() -> int:
    """Traced, in a rollout its sampler dropped: the call makes no span and carries the rollout's context on."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from gym_rpc.client.data._call_spans import trace_context_headers

    trace.set_tracer_provider(TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.0))))
    async with counted_client(observability_enabled=True) as (client, counter, url):
        with rollout_context("rollout-7", span=True):
            parent = trace.get_current_span().get_span_context()
            assert parent.is_valid and not parent.trace_flags.sampled, parent
            headers = trace_context_headers(None, parent)
            return await extra_objects(client, counter, url, "/ng-rollout/rollout-7/v1/responses", headers)


async def main() -> None:
    if sys.argv[1:] == ["unsampled"]:  # tracing is decided once per process: this one traces
        print("RESULT " + json.dumps({"unsampled": await unsampled()}), flush=True)
        return
    async with counted_client() as (client, counter, url):
        plain = [await extra_objects(client, counter, url, "/v1/responses") for _ in range(2)]
    async with counted_client(observability_enabled=True) as (client, counter, url):
        with rollout_context("rollout-7"):
            observed = await extra_objects(client, counter, url, "/ng-rollout/rollout-7/v1/responses")
    print("RESULT " + json.dumps({"plain": plain, "observed": observed}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
