"""Backpressure without storms (issue 39, point 4), on real aiohttp servers: a 429 or 503 from one instance of a
replicated server sends the call to another at once (counted as a `backpressure` resend), a stateful rollout waits
for its own instance instead; with one instance the client waits as Retry-After says, within the budget
`http_client.retry.backpressure` gives, and the caller gets the 429 or 503 itself when it runs out, so a 429 storm
costs each call a bounded number of attempts; and `max_concurrent_requests` on a server entry queues the calls
beyond it, each within its deadline."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from gym_rpc.client.data._http import Call, send
from gym_rpc.client.data._rollout import rollout_context
from gym_rpc.client.resend._policy import RetryPolicy
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig, GlobalConfig
from gym_rpc.errors import ConfigError, RequestTimeoutError
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.replicas import ReplicaServer

NAME = "judge"


@pytest.fixture
def instances(replica_servers) -> Callable[[int], Awaitable[list[ReplicaServer]]]:
    """Replica servers that stop at once (a call still held is cut)."""
    return functools.partial(replica_servers, shutdown_timeout=0.1)


def client_of(
    ports: list[int], server_type: str = "responses_api_models", retry: dict[str, Any] | None = None, **entry: Any
) -> ServerClient:
    """A client of `judge` at `ports` (the first the entry's own, the rest its replicas), following no head."""
    replicas = [f"{LOOPBACK}:{port}" for port in ports[1:]]
    doc = document(
        {NAME: server_entry(ports[0], server_type, replicas=replicas or None, **entry)},
        http_client={"retry": retry or {}},
    )
    client = ServerClient._from_global_config(
        BaseServerConfig(host=LOOPBACK, port=closed_port()), GlobalConfig.from_document(doc)
    )
    client.follow_instances(False)
    return client


async def call(client: ServerClient, **kwargs: Any) -> tuple[int, int]:
    """One POST: (its status, the port that answered)."""
    async with await client.post(NAME, "/v1/responses", json={}, **kwargs) as response:
        return response.status, int((await response.json())["instance"])


# --- a replicated server: to another instance --------------------------------------------------------------------


@pytest.mark.parametrize(("status", "retry_after"), [(429, None), (503, "30"), (429, "30")])
async def test_a_busy_instance_of_a_replicated_server_sends_the_call_to_another_at_once(
    instances, status: int, retry_after: str | None
) -> None:
    """Every call the busy instance gets is answered by the other one, at once: its Retry-After (30 s) is no wait
    when another instance may take the call. Before, the caller got the 429 or 503."""
    busy, free = await instances(2)
    busy.always = (status, retry_after)
    client = client_of([busy.port, free.port], outlier_detection=None)
    started = time.monotonic()
    answers = [await call(client) for _ in range(20)]
    assert answers == [(200, free.port)] * 20
    assert busy.calls >= 1  # some calls went there first (two choices), and moved on
    assert time.monotonic() - started < 20  # none waited out a Retry-After of 30 s


async def test_a_busy_answer_is_counted_as_a_backpressure_resend(instances) -> None:
    """What the worker metrics count (`gym.client.resends` by kind): the observer of the call is told."""
    busy, free = await instances(2)
    busy.always = (429, None)
    told: list[tuple[int, str]] = []

    class Told:
        kind = "test"

        def resent(self, attempt: int, kind: str) -> None:
            told.append((attempt, kind))

        def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None:
            told.append((attempts, f"answered {response.status}"))

        def failed(self, error: BaseException, attempts: int) -> None:
            raise AssertionError(error)

    urls = iter([f"http://{LOOPBACK}:{free.port}/v1/responses"])
    async with aiohttp.ClientSession() as session:
        url = f"http://{LOOPBACK}:{busy.port}/v1/responses"
        response = await send(
            Call(
                session,
                "POST",
                url,
                {"data": b"{}"},
                RetryPolicy(),
                resend=True,
                observer=Told(),
                reroute=lambda error: next(urls),
            )
        )
        async with response:
            assert response.status == 200
    assert told == [(2, "backpressure"), (2, "answered 200")]


async def test_a_rollout_of_a_model_server_moves_for_one_call_and_keeps_its_instance(instances) -> None:
    first, second = await instances(2)
    client = client_of([first.port, second.port])
    with rollout_context("rollout-1"):
        _, home = await call(client)
        pinned = first if home == first.port else second
        other = second if pinned is first else first
        pinned.answers = [(503, None)]
        assert await call(client) == (200, other.port)  # busy once: this call elsewhere
        assert await call(client) == (200, pinned.port)  # the next is back where its prefix is


async def test_a_rollout_of_a_resources_server_waits_for_its_own_instance(instances) -> None:
    """A resources server keeps a rollout's state on its instance: a busy answer is waited out there (its
    Retry-After), never sent elsewhere."""
    first, second = await instances(2)
    client = client_of([first.port, second.port], "resources_servers")
    with rollout_context("rollout-1"):
        _, home = await call(client)
        pinned = first if home == first.port else second
        other = second if pinned is first else first
        pinned.answers = [(429, "1"), (503, None)]
        started = time.monotonic()
        assert await call(client) == (200, pinned.port)
        assert time.monotonic() - started >= 0.9  # it waited as the Retry-After said
    assert other.calls == 0


# --- one instance: as Retry-After says, within the budget --------------------------------------------------------


async def test_one_instance_is_asked_again_after_its_retry_after(instances) -> None:
    (busy,) = await instances(1)
    client = client_of([busy.port])
    await call(client)
    for in_seconds in (True, False):
        http_date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 2))
        busy.answers = [(503, "1" if in_seconds else http_date)]
        calls = busy.calls
        started = time.monotonic()
        assert await call(client) == (200, busy.port)
        assert time.monotonic() - started >= 0.9  # seconds, or an HTTP date (at least 1 s ahead: it has seconds)
        assert busy.calls == calls + 2


async def test_a_retry_after_beyond_the_budget_gives_the_caller_the_answer_at_once(instances) -> None:
    (busy,) = await instances(1)
    client = client_of([busy.port], retry={"backpressure": {"seconds": 5}})
    await call(client)
    busy.answers = [(429, "3600")]
    started = time.monotonic()
    async with await client.post(NAME, "/v1/responses", json={}) as response:
        assert response.status == 429 and response.headers["Retry-After"] == "3600"
        assert (await response.json())["instance"] == busy.port  # the answer itself, readable
    assert time.monotonic() - started < 5


async def test_a_429_storm_costs_each_call_the_attempts_its_budget_allows(instances) -> None:
    """NeMo Gym #2527: 6.17 million retries of a 429 storm. Here every call ends after
    `http_client.retry.backpressure.attempts` attempts (4 by default), with the 429 itself; before, after one."""
    (storm,) = await instances(1)
    storm.always = (429, None)
    client = client_of([storm.port], retry={"initial_backoff_seconds": 0.01, "max_backoff_seconds": 0.02})
    statuses = [(await call(client))[0] for _ in range(10)]
    assert statuses == [429] * 10
    assert storm.calls == 10 * RetryPolicy().backpressure.attempts == 40


# --- a cap on calls in flight ------------------------------------------------------------------------------------


async def test_max_concurrent_requests_queues_the_calls_beyond_it(instances) -> None:
    """A judge allowing 2 calls at once: 12 calls at once reach it 2 at a time, in order, and every one is
    answered. Before, the key was ignored and all 12 arrived together."""
    (judge,) = await instances(1)
    judge.delay = 0.05
    client = client_of([judge.port], "resources_servers", max_concurrent_requests=2)
    answers = await asyncio.gather(*(call(client) for _ in range(12)))
    assert answers == [(200, judge.port)] * 12
    assert judge.most_in_flight == 2
    assert client._routing is not None
    cap = client._routing.routes[NAME].cap
    assert cap is not None and (cap.in_flight, cap.waiting) == (0, 0)


async def test_a_call_queued_past_its_deadline_fails_naming_the_cap(instances) -> None:
    (judge,) = await instances(1)
    judge.delay = 3.0
    client = client_of([judge.port], max_concurrent_requests=1)
    first = asyncio.create_task(call(client))
    async with asyncio.timeout(30):
        await judge.arrived.wait()  # the first call holds the only place, at the judge
    with pytest.raises(RequestTimeoutError, match="max_concurrent_requests allows") as raised:
        await call(client, timeout=aiohttp.ClientTimeout(total=0.3))
    assert not first.done()  # it ended at its own deadline, not when the place freed
    assert raised.value.server_name == NAME and raised.value.attempts == 0
    assert await first == (200, judge.port)
    assert judge.calls == 1  # the queued call never reached the judge
    assert await call(client) == (200, judge.port)  # its place was given back


@pytest.mark.parametrize("value", [0, -1, True, "4", 2.5])
def test_a_bad_max_concurrent_requests_is_one_error_naming_it(value: Any) -> None:
    doc = document({NAME: server_entry(8000, max_concurrent_requests=value)})
    with pytest.raises(ConfigError, match=f"server '{NAME}': max_concurrent_requests must be a positive integer"):
        GlobalConfig.from_document(doc)
