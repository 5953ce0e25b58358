"""Resend budgets on real loopback servers: each kind of failure (refused, dropped before and after the request
was written, timeouts, HTTP answers), the call's deadline over the whole, the client-wide budget (a dead server
sees the budgeted resends, not one stream per call; loops in several threads share it), the replicas hook,
observers that raise, the log's rate, and the config that sets it all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gym_rpc.client import FailureKind, ServerDroppedError
from gym_rpc.client.data._http import Call, LoopSessions, send
from gym_rpc.client.data._http_settings import HttpClientSettings
from gym_rpc.client.resend._budget import RESEND_BUDGET, ResendBudget
from gym_rpc.client.resend._policy import ClientBudget, RetryPolicy
from gym_rpc.errors import (
    ConfigError,
    RequestTimeoutError,
    ResendsExhaustedError,
    ServerUnreachableError,
)
from tests.support.loopback import LOOPBACK, closed_port, tcp_keepalive_options

FAST = {"initial_backoff_seconds": 0.01, "max_backoff_seconds": 0.05}


def policy(**keys: Any) -> RetryPolicy:
    """`http_client.retry` as a config gives it: pauses of 0.01-0.05 s unless `keys` say otherwise."""
    return RetryPolicy.model_validate({**FAST, **keys})


OK_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


class Told:
    """A CallObserver noting the kind of each resend and the outcome."""

    kind = "metrics"

    def __init__(self) -> None:
        self.resends: list[tuple[int, str]] = []
        self.outcome: tuple[Any, int] | None = None

    def resent(self, attempt: int, kind: str) -> None:
        self.resends.append((attempt, kind))

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None:
        self.outcome = (response.status, attempts)

    def failed(self, error: BaseException, attempts: int) -> None:
        self.outcome = (error, attempts)


class Counting:
    """A raw server: counts connections and complete request heads, and does with connection n what `act` says."""

    def __init__(self, act: Callable[[int], str]) -> None:
        self.act = act
        self.connections = 0
        self.requests = 0
        self.open = 0
        self.handlers: set[asyncio.Task[Any]] = set()
        self.requested = asyncio.Event()  # set once a request has been read
        self.server: asyncio.Server | None = None

    async def start(self, sock: socket.socket | None = None) -> int:
        if sock is None:
            self.server = await asyncio.start_server(self.handle, LOOPBACK, 0)
        else:
            self.server = await asyncio.start_server(self.handle, sock=sock)
        return int(self.server.sockets[0].getsockname()[1])

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self.handlers.add(handler)
        self.connections += 1
        what = self.act(self.connections)
        try:
            if what == "close at once":
                return
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            self.requests += 1
            self.requested.set()
            if what == "hold":
                await asyncio.sleep(30)  # cancelled by stop()
            elif what == "drop late":
                await asyncio.sleep(1.5)
            elif what == "drop soon":
                await asyncio.sleep(0.3)
            elif what == "answer":
                writer.write(OK_RESPONSE)
                await writer.drain()
            # "drop": read, then close unanswered
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self.handlers.discard(handler)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for handler in list(self.handlers):
            handler.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        if self.server is not None:
            await self.server.wait_closed()


@pytest.fixture
async def counting() -> AsyncIterator[Callable[[Callable[[int], str]], Counting]]:
    made: list[Counting] = []

    def make(act: Callable[[int], str]) -> Counting:
        made.append(Counting(act))
        return made[-1]

    yield make
    for server in made:
        await server.stop()


# --- each kind ---------------------------------------------------------------------------------------------------


async def test_a_refused_call_rides_out_a_restart_and_is_resent_even_without_resend_after_disconnect(
    counting: Callable[[Callable[[int], str]], Counting],
) -> None:
    """Refused: nothing was sent, so it is resent whatever `_resend_after_disconnect` says, for its time budget:
    a server that comes back on its port within it answers the call."""
    sock = socket.socket()
    sock.bind((LOOPBACK, 0))  # bound, not listening: refused until it listens
    port = sock.getsockname()[1]
    server = counting(lambda _: "answer")

    async def listen_later() -> None:
        await asyncio.sleep(0.5)
        sock.listen(16)
        await server.start(sock)

    later = asyncio.create_task(listen_later())
    told = Told()
    async with aiohttp.ClientSession() as session:
        url = f"http://{LOOPBACK}:{port}/v1/responses"
        response = await send(Call(session, "POST", url, {"data": b"{}"}, policy(), resend=False, observer=told))
        async with response:
            assert response.status == 200
    await later
    assert {kind for _, kind in told.resends} == {"refused"} and told.outcome == (200, len(told.resends) + 1)
    assert len(told.resends) >= 3  # refused for about 0.5 s: many short pauses
    assert server.requests == 1


async def test_a_drop_before_the_request_was_written_is_resent_even_without_resend_after_disconnect(
    counting: Callable[[Callable[[int], str]], Counting],
) -> None:
    """Dropped before written: the server closed the new connection before aiohttp wrote to it (a hook of the
    test's own session holds aiohttp back until the close has been read), aiohttp refuses to write, and the call
    is resent, `_resend_after_disconnect=False` notwithstanding: the server never saw it."""
    server = counting(lambda n: "close at once" if n == 1 else "answer")
    port = await server.start()
    made = 0

    async def first_connection_waits(*_: Any) -> None:
        nonlocal made
        made += 1
        if made == 1:
            await asyncio.sleep(0.3)  # the server's close arrives and is read meanwhile

    hooks = aiohttp.TraceConfig()
    hooks.on_connection_create_end.append(first_connection_waits)
    told = Told()
    async with aiohttp.ClientSession(trace_configs=[hooks]) as session:
        url = f"http://{LOOPBACK}:{port}/x"
        async with await send(Call(session, "GET", url, {}, policy(), resend=False, observer=told)) as response:
            assert response.status == 200
    assert told.resends == [(2, "dropped_before_write")] and told.outcome == (200, 2)
    assert (server.connections, server.requests) == (2, 1)


async def test_a_drop_after_the_request_was_written_is_resent_only_when_allowed(
    counting: Callable[[Callable[[int], str]], Counting],
) -> None:
    """Dropped after written: `_resend_after_disconnect=False` raises at once, True resends within the kind's
    attempts (3 by default); either way the error is a ServerDroppedError, which is aiohttp's too."""
    server = counting(lambda _: "drop")
    port = await server.start()
    url = f"http://{LOOPBACK}:{port}/v1/responses"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ServerDroppedError) as once:
            await send(Call(session, "POST", url, {"data": b"{}"}, policy(), server="model", resend=False))
        assert server.requests == 1
        with pytest.raises(aiohttp.ServerDisconnectedError) as bounded:  # what callers caught before
            await send(Call(session, "POST", url, {"data": b"{}"}, policy(), server="model", resend=True))
    assert server.requests == 1 + 3
    assert (once.value.kind, once.value.limit, once.value.attempts) == ("dropped_after_write", "no resend", 1)
    assert isinstance(bounded.value, ServerDroppedError)
    assert (bounded.value.kind, bounded.value.limit, bounded.value.attempts) == (
        "dropped_after_write",
        "attempts",
        3,
    )
    assert f"POST {url} (server 'model'): dropped after the request was written, given up after 3" in str(
        bounded.value
    )
    assert isinstance(bounded.value.__cause__, aiohttp.ServerDisconnectedError)
    assert isinstance(bounded.value, aiohttp.ClientOSError) and isinstance(bounded.value, ConnectionError)


@pytest.fixture
def full_backlog() -> Any:
    """A listening port whose accept queue is full and never drained: a new connection is never made, so connecting
    times out (nothing is sent)."""
    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):  # completes in the kernel's queue, or waits for room
            filler.connect((LOOPBACK, port))
        fillers.append(filler)
    yield port
    for sock in [*fillers, listener]:
        sock.close()


async def test_timeouts_are_resent_only_as_their_budget_allows(
    counting: Callable[[Callable[[int], str]], Counting], full_backlog: int
) -> None:
    """Timeouts: not resent by default; with `timeout.attempts` 2, a connect timeout (nothing sent) is resent
    whatever `_resend_after_disconnect` says, a silent read (sent) only when it allows."""

    def connect_timeout() -> Any:  # a fresh kwargs per call: send puts each resend's timeout in it
        return {"timeout": aiohttp.ClientTimeout(total=10, sock_connect=0.2)}

    resend_one = policy(timeout={"attempts": 2, "seconds": 5})
    mute = counting(lambda _: "hold")
    mute_url = f"http://{LOOPBACK}:{await mute.start()}/v1/responses"

    def read_timeout() -> Any:
        return {"timeout": aiohttp.ClientTimeout(total=10, sock_read=0.2), "data": b"{}"}

    async with aiohttp.ClientSession() as session:
        url = f"http://{LOOPBACK}:{full_backlog}/"
        with pytest.raises(RequestTimeoutError) as by_default:
            await send(Call(session, "GET", url, connect_timeout(), policy(), resend=True))
        with pytest.raises(RequestTimeoutError) as connect_resent:
            await send(Call(session, "GET", url, connect_timeout(), resend_one, resend=False))
        with pytest.raises(RequestTimeoutError) as read_not_resent:
            await send(Call(session, "POST", mute_url, read_timeout(), resend_one, resend=False))
        assert mute.requests == 1
        with pytest.raises(RequestTimeoutError) as read_resent:
            await send(Call(session, "POST", mute_url, read_timeout(), resend_one, resend=True))
        assert mute.requests == 1 + 2
    assert (by_default.value.attempts, by_default.value.limit) == (1, "attempts")
    assert (connect_resent.value.attempts, connect_resent.value.limit) == (2, "attempts")
    assert (read_not_resent.value.attempts, read_not_resent.value.limit) == (1, "no resend")
    assert (read_resent.value.attempts, read_resent.value.limit) == (2, "attempts")
    assert isinstance(connect_resent.value.__cause__, aiohttp.ConnectionTimeoutError)


async def test_an_http_answer_is_never_resent(http_server: Callable[..., Any]) -> None:
    """Any answer but a 429 or a 503 (tests/client/resend/test_backpressure.py), a 5xx too, is the caller's at
    once."""
    seen: list[str] = []

    async def unavailable(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.Response(status=502)

    app = web.Application()
    app.router.add_post("/v1/responses", unavailable)
    port = await http_server(app)
    told = Told()
    async with aiohttp.ClientSession() as session:
        url = f"http://{LOOPBACK}:{port}/v1/responses"
        async with await send(
            Call(session, "POST", url, {"data": b"{}"}, policy(), resend=True, observer=told)
        ) as response:
            assert response.status == 502
    assert seen == ["/v1/responses"] and told.resends == [] and told.outcome == (502, 1)


# --- the deadline over the whole ---------------------------------------------------------------------------------


async def test_the_calls_deadline_bounds_its_resends(counting: Callable[[Callable[[int], str]], Counting]) -> None:
    """A refused server with 30 s of refused budget is given up on at the call's 0.5 s deadline; and a resend gets
    only the time left (a drop after 1.5 s, then a server that never answers: the call ends at its 2 s, not at
    1.5 + 2 s)."""
    refused = f"http://{LOOPBACK}:{closed_port()}/v1/responses"
    server = counting(lambda n: "drop late" if n == 1 else "hold")
    held = f"http://{LOOPBACK}:{await server.start()}/v1/responses"
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        with pytest.raises(ServerUnreachableError) as unreachable:
            timeout = aiohttp.ClientTimeout(total=0.5)
            await send(Call(session, "POST", refused, {"timeout": timeout}, policy(), resend=True))
        refused_for = time.monotonic() - started
        started = time.monotonic()
        with pytest.raises(RequestTimeoutError) as timed_out:
            await send(
                Call(session, "POST", held, {"timeout": aiohttp.ClientTimeout(total=2)}, policy(), resend=True)
            )
        held_for = time.monotonic() - started
    assert unreachable.value.limit == "deadline" and unreachable.value.attempts > 1
    assert refused_for < 0.5 + 2.0  # not the refused budget's 30 s
    assert (timed_out.value.limit, timed_out.value.attempts) == ("deadline", 2)
    assert held_for < 3.0  # 2 s and slack; the resend with a fresh 2 s would end after 3.5 s
    assert "got no answer within its deadline (total 2 s)" in str(timed_out.value)


async def test_a_pause_is_not_taken_when_the_resend_after_it_would_have_less_time_than_the_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A refused server, a 0.15 s deadline and pauses of exactly 0.1 s: a resend after the first pause would get
    about 0.05 s, so the call ends at once, unreachable by its deadline. (A resend with a sliver of time ends on
    the deadline before it reaches the server: the call then ended as a timeout though the server had refused,
    CI's failure of the test above.)"""
    monkeypatch.setattr("gym_rpc.client.resend._policy.random.uniform", lambda low, high: high)
    refused = f"http://{LOOPBACK}:{closed_port()}/v1/responses"
    retry = policy(initial_backoff_seconds=0.1, max_backoff_seconds=0.1)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ServerUnreachableError) as unreachable:
            await send(
                Call(session, "POST", refused, {"timeout": aiohttp.ClientTimeout(total=0.15)}, retry, resend=True)
            )
    assert (unreachable.value.limit, unreachable.value.attempts) == ("deadline", 1)


# --- the client-wide budget --------------------------------------------------------------------------------------


async def _resends_seen_by_a_dead_server(
    counting: Callable[[Callable[[int], str]], Counting], budget: ClientBudget, calls: int
) -> tuple[int, list[BaseException]]:
    """`calls` calls at once to a server that drops every request, each allowed to resend for 1 s with pauses of
    0.05-0.1 s: how many resends the server saw, and what each call raised."""
    server = counting(lambda _: "drop")
    url = f"http://{LOOPBACK}:{await server.start()}/v1/responses"
    retry = policy(
        initial_backoff_seconds=0.1,
        max_backoff_seconds=0.1,
        dropped_after_write={"attempts": 1000, "seconds": 1.0},
        client_budget=budget,
    )
    async with aiohttp.ClientSession() as session:
        outcomes = await asyncio.gather(
            *(send(Call(session, "POST", url, {"data": b"{}"}, retry, resend=True)) for _ in range(calls)),
            return_exceptions=True,
        )
    assert all(isinstance(outcome, BaseException) for outcome in outcomes)
    return server.requests - calls, [outcome for outcome in outcomes if isinstance(outcome, BaseException)]


async def test_a_dead_server_sees_the_budgeted_resends_not_one_stream_per_call(
    counting: Callable[[Callable[[int], str]], Counting],
) -> None:
    """40 calls failing against one server for 1 s: with 2 slots (20 % of nothing in flight is nothing, so the
    floor), the server sees about 2 resends per pause of 0.05-0.1 s; without the budget, every call resends every
    pause. The calls that never got a slot fail at once at their budget's end, saying the client's budget was
    full."""
    calls = 40
    budgeted, errors = await _resends_seen_by_a_dead_server(counting, ClientBudget(share=0.2, floor=2), calls)
    unbudgeted, _ = await _resends_seen_by_a_dead_server(counting, ClientBudget(share=1.0, floor=100_000), calls)
    # 2 slots x 1 s / 0.05 s, plus 20 % of the 40 first attempts while they were in flight, plus slack.
    assert budgeted <= 2 * 20 + 8 + 20
    assert unbudgeted >= 3 * budgeted  # each of the 40 calls resends about 13 times on its own
    assert all(isinstance(error, ServerDroppedError) for error in errors)
    starved = [
        error for error in errors if isinstance(error, ResendsExhaustedError) and error.limit == "client budget"
    ]
    assert len(starved) >= calls // 2
    assert "the client's resend budget had no free slot in the time left" in str(starved[0])
    assert (RESEND_BUDGET.held, RESEND_BUDGET.waiting) == (0, 0)  # every slot taken was given back


async def test_resends_out_at_the_server_never_widen_the_budget(
    counting: Callable[[Callable[[int], str]], Counting],
) -> None:
    """The slots are a share of the first attempts in flight: resends out at a server that drops each 0.3 s after
    reading it are no load that earns more. 40 ServerClient calls, 1 slot (floor) of 0.05-0.1 s pauses for 1.5 s:
    about 20 resends after the first burst (half of the 40 first attempts' failures), where resends counted as
    load would let all 40 calls resend every 0.4 s (about 150)."""
    from omegaconf import OmegaConf

    from gym_rpc.client.data._http import close_http_sessions
    from gym_rpc.client.server_client import ServerClient
    from gym_rpc.config import BaseServerConfig
    from tests.support.documents import document, server_entry

    server = counting(lambda _: "drop soon")
    retry = {
        "initial_backoff_seconds": 0.1,
        "max_backoff_seconds": 0.1,
        "dropped_after_write": {"attempts": 1000, "seconds": 1.5},
        "client_budget": {"share": 0.5, "floor": 1},
    }
    client = ServerClient(
        head_server_config=BaseServerConfig(host=LOOPBACK, port=closed_port()),
        global_config_dict=OmegaConf.create(
            document({"slow": server_entry(await server.start())}, http_client={"retry": retry})
        ),
    )
    calls = 40
    try:
        outcomes = await asyncio.gather(
            *(client.post("slow", "/v1/responses", json={}) for _ in range(calls)), return_exceptions=True
        )
    finally:
        await close_http_sessions()
    assert all(isinstance(outcome, ServerDroppedError) for outcome in outcomes)
    assert server.requests - calls <= 20 + 2 * 1.5 / 0.05  # the burst, then 1 slot at 0.05-0.1 s pauses
    assert (RESEND_BUDGET.held, RESEND_BUDGET.waiting, RESEND_BUDGET.resending) == (0, 0, 0)


def test_loops_in_other_threads_share_the_budget_and_are_woken_when_a_slot_frees() -> None:
    """One budget for the process: a loop in another thread that finds every slot held waits, and is woken (through
    its loop) when this thread's loop frees one; a waiter that times out leaves no slot behind."""
    budget, floor = ResendBudget(), ClientBudget(floor=2)
    holding = threading.Event()
    results: dict[str, Any] = {}

    async def hold_both_then_release() -> None:
        assert await budget.acquire("judge", floor, 1) and await budget.acquire("judge", floor, 1)
        holding.set()
        await asyncio.sleep(0.3)
        budget.release("judge")

    def other_thread() -> None:
        async def wait_for_one() -> None:
            holding.wait(10)
            started = time.monotonic()
            results["timed_out"] = not await budget.acquire("judge", floor, 0.05)  # both held: times out
            results["got"] = await budget.acquire("judge", floor, 10)  # woken by the release in the other thread
            results["waited"] = time.monotonic() - started
            budget.release("judge")

        asyncio.run(wait_for_one())

    thread = threading.Thread(target=other_thread)
    thread.start()
    asyncio.run(hold_both_then_release())
    thread.join(10)
    assert results["timed_out"] is True and results["got"] is True
    assert 0.1 < results["waited"] < 5.0
    assert (budget.held, budget.waiting) == (1, 0)  # the first loop holds one; the timed-out waiter took none
    budget.release("judge")


# --- the replicas hook -------------------------------------------------------------------------------------------


async def test_the_reroute_hook_tries_other_instances_at_once_and_pauses_when_all_were_tried(
    counting: Callable[[Callable[[int], str]], Counting],
) -> None:
    """A refused instance is followed at once by the one `reroute` names (no pause: backoff here is 1-2 s); when
    every instance refuses, a pause comes only after each was tried, and the refused budget's time bounds it
    all."""
    down_a, down_b = (f"http://{LOOPBACK}:{closed_port()}/v1/responses" for _ in range(2))
    up = counting(lambda _: "answer")
    up_url = f"http://{LOOPBACK}:{await up.start()}/v1/responses"
    slow_pauses = {"initial_backoff_seconds": 2.0, "max_backoff_seconds": 2.0}
    asked: list[BaseException] = []

    def to_the_live_one(error: BaseException) -> str:
        asked.append(error)
        return up_url

    told = Told()
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        response = await send(
            Call(
                session,
                "POST",
                down_a,
                {"data": b"{}"},
                policy(**slow_pauses),
                resend=True,
                observer=told,
                reroute=to_the_live_one,
            )
        )
        async with response:
            assert response.status == 200
        failed_over_in = time.monotonic() - started

        urls = [down_a, down_b]
        tried: list[str] = []

        def round_robin(error: BaseException) -> str:
            tried.append(urls[len(tried) % 2])  # the URL whose attempt just failed
            return urls[len(tried) % 2]

        with pytest.raises(ServerUnreachableError) as caught:
            await send(
                Call(
                    session, "POST", down_a, {}, policy(refused={"seconds": 0.5}), resend=True, reroute=round_robin
                )
            )
    [refused] = asked
    assert isinstance(refused, aiohttp.ClientConnectorError) and told.outcome == (200, 2)
    assert failed_over_in < 1.0  # a pause would have been at least 1 s
    assert tried[:4] == [down_a, down_b, down_a, down_b]
    # asked after every failure (the last one too: its pause depends on the URL it names)
    assert caught.value.attempts == len(tried) and caught.value.url in urls and caught.value.limit == "time"


# --- observers, the log, the config ------------------------------------------------------------------------------


class Raising:
    kind = "metrics"

    def resent(self, attempt: int, kind: str) -> None:
        raise RuntimeError("resent")

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None:
        raise RuntimeError("answered")

    def failed(self, error: BaseException, attempts: int) -> None:
        raise RuntimeError("failed")


async def test_an_observer_that_raises_never_fails_the_call(
    counting: Callable[[Callable[[int], str]], Counting],
) -> None:
    """The answer reaches the caller (who releases it) and an error stays the call's own, whatever the observer."""
    flaky = counting(lambda n: "drop" if n == 1 else "answer")
    flaky_url = f"http://{LOOPBACK}:{await flaky.start()}/v1/responses"
    steady = counting(lambda _: "answer")
    steady_url = f"http://{LOOPBACK}:{await steady.start()}/v1/responses"
    async with aiohttp.ClientSession() as session:
        async with await send(
            Call(session, "POST", steady_url, {}, policy(), resend=True, observer=Raising())
        ) as response:
            assert response.status == 200  # the first attempt answered (observer raised at answered)
        async with await send(
            Call(session, "POST", flaky_url, {}, policy(), resend=True, observer=Raising())
        ) as response:
            assert response.status == 200  # resent (observer raised at resent) and answered (raised again)
        refused = f"http://{LOOPBACK}:{closed_port()}/"
        with pytest.raises(ServerUnreachableError):
            await send(Call(session, "GET", refused, {}, RetryPolicy(attempts=1), resend=True, observer=Raising()))


async def test_a_dead_server_gets_one_log_line_per_interval_not_one_per_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = closed_port()
    url = f"http://{LOOPBACK}:{port}/v1/responses"
    retry = policy(refused={"seconds": 0.3})
    caplog.set_level(logging.WARNING, logger="gym_rpc.client.resend._log")
    async with aiohttp.ClientSession() as session:
        outcomes = await asyncio.gather(
            *(send(Call(session, "POST", url, {}, retry, server="gone", resend=True)) for _ in range(30)),
            return_exceptions=True,
        )
    assert all(isinstance(outcome, ServerUnreachableError) for outcome in outcomes)
    lines = [record.getMessage() for record in caplog.records if f":{port}" in record.getMessage()]
    assert len(lines) == 1, lines  # 30 calls, dozens of resends each, one interval
    assert lines[0].startswith(
        f"server 'gone' at http://{LOOPBACK}:{port}: 1 failed attempt(s) resent (refused 1)"
    )


def test_retry_config_keeps_its_old_keys_and_gains_budgets_per_kind() -> None:
    """`retry.attempts` is each kind's attempts (not timeouts'), unless the kind sets its own; a kind's block may
    give one key; the defaults outlast a restart and a bad value is one error naming its key."""
    default = HttpClientSettings().retry
    assert (default.refused.attempts, default.refused.seconds) == (100, 30.0)
    assert (default.dropped_after_write.attempts, default.timeout.attempts) == (3, 1)
    assert default.max_backoff_seconds == 2.0 and default.client_budget == ClientBudget(share=0.2, floor=3)
    legacy = HttpClientSettings.from_document(
        {"http_client": {"retry": {"attempts": 5, "dropped_after_write": {"attempts": 2}}}}
    ).retry
    assert [legacy.budget(kind).attempts for kind in FailureKind] == [5, 5, 2, 1, 4]  # not a busy answer's
    assert legacy.refused.seconds == 30.0
    partial = HttpClientSettings.from_document({"http_client": {"retry": {"refused": {"seconds": 120}}}}).retry
    assert (partial.refused.attempts, partial.refused.seconds) == (100, 120.0)
    for bad, named in (
        ({"refused": {"seconds": -1}}, "http_client.retry.refused.seconds"),
        ({"timeout": {"attempts": 0}}, "http_client.retry.timeout.attempts"),
        ({"client_budget": {"share": 1.5}}, "http_client.retry.client_budget.share"),
        ({"refused": {"sconds": 1}}, "http_client.retry.refused.sconds"),
    ):
        with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
            HttpClientSettings.from_document({"http_client": {"retry": bad}})


def test_nemo_gyms_keepalive_keys_are_honoured_and_the_pool_idles_below_uvicorns_keepalive() -> None:
    """NeMo Gym's `global_aiohttp_tcp_keepalive_*` set the TCP keepalive (agreeing with `http_client` where both
    say); its defaults otherwise (60/10/3), and pooled connections idle for 15 s, under uvicorn's 30 s."""
    default = HttpClientSettings()
    assert (default.tcp_keepalive_idle_seconds, default.tcp_keepalive_interval_seconds) == (60, 10)
    assert default.tcp_keepalive_probes == 3
    assert default.keepalive_timeout_seconds < 30  # NeMo Gym's servers: uvicorn's timeout_keep_alive=30
    upstream = HttpClientSettings.from_document(
        {
            "global_aiohttp_tcp_keepalive_idle_seconds": 30,
            "global_aiohttp_tcp_keepalive_interval_seconds": 5,
            "global_aiohttp_tcp_keepalive_probes": 2,
        }
    )
    assert (upstream.tcp_keepalive_idle_seconds, upstream.tcp_keepalive_interval_seconds) == (30, 5)
    assert upstream.tcp_keepalive_probes == 2
    with pytest.raises(ConfigError, match="global_aiohttp_tcp_keepalive_probes"):
        HttpClientSettings.from_document({"global_aiohttp_tcp_keepalive_probes": 128})
    with pytest.raises(ConfigError, match="disagree"):
        HttpClientSettings.from_document(
            {"global_aiohttp_tcp_keepalive_probes": 2, "http_client": {"tcp_keepalive_probes": 4}}
        )


async def test_sockets_and_the_pool_follow_the_keepalive_settings(http_server: Callable[..., Any]) -> None:
    """NeMo Gym's TCP keepalive keys reach every socket of the pool; an idle pooled connection is dropped after
    `keepalive_timeout_seconds` (a new one is made), and reused within it."""
    peers: list[Any] = []
    looked = asyncio.Event()

    async def remember_the_peer(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first")
        await looked.wait()  # the connection stays checked out while the test looks at its socket
        return response

    app = web.Application()
    app.router.add_get("/", remember_the_peer)
    url = f"http://{LOOPBACK}:{await http_server(app)}/"
    document = {
        "global_aiohttp_tcp_keepalive_idle_seconds": 30,
        "global_aiohttp_tcp_keepalive_interval_seconds": 5,
        "global_aiohttp_tcp_keepalive_probes": 2,
        "http_client": {"keepalive_timeout_seconds": 0.3},
    }
    sessions = LoopSessions(HttpClientSettings.from_document(document))
    try:
        async with sessions.data.get(url) as response:
            assert response.connection is not None and response.connection.transport is not None
            sock = response.connection.transport.get_extra_info("socket")
            options = tcp_keepalive_options(sock)
            looked.set()
            await response.read()
        async with sessions.data.get(url) as response:  # at once: the pooled connection again
            await response.read()
        await asyncio.sleep(1.0)  # idle past 0.3 s: dropped from the pool
        async with sessions.data.get(url) as response:
            await response.read()
    finally:
        looked.set()
        await sessions.close()
    assert options == [1, 30, 5, 2]
    assert peers[0] == peers[1] and peers[2] != peers[1]


@pytest.mark.timeout(120)
async def test_by_default_a_server_that_never_returns_fails_the_call_within_a_minute() -> None:
    """The default bound, in real time: a refused call is resent for its 30 s (no sooner given up: it must outlast
    a restart), then fails with an error naming the server, the URL, the kind, the attempts and the time."""
    url = f"http://{LOOPBACK}:{closed_port()}/v1/responses"
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        with pytest.raises(ServerUnreachableError) as caught:
            await send(Call(session, "POST", url, {"data": b"{}"}, RetryPolicy(), server="gone", resend=True))
        took = time.monotonic() - started
    assert 30.0 - 2.0 <= took < 60.0  # the last pause (at most 2 s) may not fit in the 30 s
    assert (caught.value.kind, caught.value.limit, caught.value.server_name) == ("refused", "time", "gone")
    assert 10 < caught.value.attempts < 100  # pauses doubling from 0.05 s to 2 s
    assert f"POST {url} (server 'gone'): refused or unreachable, given up after {caught.value.attempts} " in str(
        caught.value
    )


def test_the_errors_name_everything_and_survive_pickling() -> None:
    """A Ray task's error reaches its caller whole: every field, the message, and what it is also."""
    import pickle

    errors: list[ResendsExhaustedError] = [
        ServerUnreachableError("http://h:1/v", 23, "refused", server_name="s", elapsed_seconds=29.4, limit="time"),
        ServerDroppedError("http://h:1/v", 3, "Server disconnected", kind="dropped_after_write", errno=104),
        RequestTimeoutError("s", "POST", "http://h:1/v", 2.0, 10.0, attempts=2, limit="deadline"),
    ]
    for error in errors:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error) and copy.args == error.args
        fields = ("server_name", "method", "url", "kind", "attempts", "elapsed_seconds", "limit", "detail")
        assert [getattr(copy, name) for name in fields] == [getattr(error, name) for name in fields]
        assert getattr(copy, "errno", None) == getattr(error, "errno", None)
    assert "given up after 23 attempt(s) in 29.4 s (its refused budget's time ran out): refused" in str(errors[0])
    dropped = errors[1]
    assert isinstance(dropped, ServerDroppedError) and isinstance(dropped, aiohttp.ServerDisconnectedError)
    assert dropped.errno == 104


async def test_server_client_counts_its_calls_in_flight_for_the_budget_and_frees_them_on_every_exit(
    counting: Callable[[Callable[[int], str]], Counting],
) -> None:
    """The budget's measure of load: ServerClient.request counts a call while it is out (per loop, no lock) and
    never leaves it counted, whether the call is answered, fails or is cancelled."""
    from omegaconf import OmegaConf

    from gym_rpc.client.data._http import close_http_sessions
    from gym_rpc.client.resend._budget import calls_in_flight
    from gym_rpc.client.server_client import ServerClient
    from gym_rpc.config import BaseServerConfig
    from tests.support.documents import document, server_entry

    held = counting(lambda _: "hold")
    answering = counting(lambda _: "answer")
    servers = {
        "held": server_entry(await held.start()),
        "ok": server_entry(await answering.start()),
        "gone": server_entry(closed_port()),
    }
    doc = document(servers, http_client={"retry": {**FAST, "attempts": 1}})
    client = ServerClient(
        head_server_config=BaseServerConfig(host=LOOPBACK, port=closed_port()),
        global_config_dict=OmegaConf.create(doc),
    )
    try:
        before = calls_in_flight()
        call = asyncio.create_task(client.post("held", "/v1/responses", json={}))
        await asyncio.wait_for(held.requested.wait(), 10)
        assert calls_in_flight() == before + 1
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        async with await client.post("ok", "/v1/responses", json={}) as response:
            assert response.status == 200
        with pytest.raises(ServerUnreachableError):
            await client.post("gone", "/v1/responses", json={})
        assert calls_in_flight() == before
    finally:
        await close_http_sessions()
