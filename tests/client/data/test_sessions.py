"""The data plane's aiohttp sessions: built from the settings, per loop, kept alive, traced alongside aiohttp's
instrumentation, metered calls in flight until they end.

Found by mutation testing (`make mutate`, bench/MUTATION.md; these tests were tests/test_exact_behaviour.py):
exact answers no other test pinned down. Each test names the mutant class it kills: a change to the code
that left the rest of the suite green.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gym_rpc.client.data import _call_metrics as client_metrics
from gym_rpc.client.data._call_spans import ObserverPair, call_span, observer_for
from gym_rpc.client.data._http import (
    Call,
    LoopSessions,
    _sessions_by_loop,
    close_loop_sessions,
    loop_sessions,
    send,
)
from gym_rpc.client.data._http_settings import HttpClientSettings
from gym_rpc.client.resend._policy import RetryPolicy
from gym_rpc.client.tracing._aiohttp_instrumentation import _ATTRIBUTES_KEY, _add_attributes
from gym_rpc.config import (
    GlobalConfig,
)
from gym_rpc.errors import (
    ConfigError,
)
from gym_rpc.metrics import METRICS
from gym_rpc.telemetry import TRACING
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, tcp_keepalive_options
from tests.support.observers import RecordingObserver
from tests.support.servers import start_dropping_server


async def test_closing_a_loops_sessions_forgets_them_and_is_harmless_twice() -> None:
    """close_loop_sessions: nothing opened is nothing to close; closing one settings' sessions keeps the others
    and the loop's entry; the last one removes the loop's entry."""
    loop = asyncio.get_running_loop()
    first, second = HttpClientSettings(), HttpClientSettings(max_connections=5)
    await close_loop_sessions(first)  # no session of this loop yet
    first_sessions, second_sessions = loop_sessions(first), loop_sessions(second)
    await close_loop_sessions(first)
    assert first_sessions.is_closed and not second_sessions.is_closed
    assert list(_sessions_by_loop[loop]) == [second]
    await close_loop_sessions(first)  # already closed
    await close_loop_sessions(second)
    assert loop not in _sessions_by_loop


def test_a_server_whose_address_cannot_be_resolved_is_named_when_called() -> None:
    """GlobalConfig.raise_unusable: only the server that cannot be resolved raises, with one exact line."""
    config = GlobalConfig.from_document(
        document({"good": server_entry(8000), "bad": server_entry(8001, host="${oc.env:H18_UNSET_HOST}")}),
        lenient=True,
    )
    config.raise_unusable("good")
    for call in (config.raise_unusable, config.server):
        with pytest.raises(ConfigError) as caught:
            call("bad")
        assert str(caught.value).startswith("server 'bad' cannot be called: cannot resolve ")
        assert "H18_UNSET_HOST" in str(caught.value)


POOLS = HttpClientSettings(
    max_connections=7,
    max_connections_per_host=3,
    control_max_connections=5,
    keepalive_timeout_seconds=4.5,
    connect_timeout_seconds=2.5,
    total_timeout_seconds=60.0,
    control_total_timeout_seconds=9.0,
)


async def test_the_data_and_control_sessions_are_built_from_the_settings() -> None:
    """LoopSessions: each setting reaches the pool it names; no proxies from the environment, no cookies."""
    sessions = LoopSessions(POOLS)
    try:
        assert sessions.loop is asyncio.get_running_loop() and sessions.is_closed is False
        for session, limit, per_host, total in ((sessions.data, 7, 3, 60.0), (sessions.control, 5, 0, 9.0)):
            connector = session.connector
            assert isinstance(connector, aiohttp.TCPConnector)
            assert (connector.limit, connector.limit_per_host, connector._keepalive_timeout) == (
                limit,
                per_host,
                4.5,
            )
            assert session.timeout == aiohttp.ClientTimeout(total=total, sock_connect=2.5)
            assert session.trust_env is False and isinstance(session.cookie_jar, aiohttp.DummyCookieJar)
    finally:
        await sessions.close()
    assert sessions.is_closed is True and sessions.data.closed and sessions.control.closed


async def test_pooled_connections_use_tcp_keepalive(http_server) -> None:
    """_keepalive_socket: a connection of the data pool has keepalive on, idle 60 s, every 10 s, 3 probes."""
    done = asyncio.Event()

    async def streaming(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first")
        await done.wait()  # the connection stays checked out while the test looks at its socket
        return response

    app = web.Application()
    app.router.add_get("/", streaming)
    port = await http_server(app)
    sessions = LoopSessions(POOLS)
    try:
        async with sessions.data.get(f"http://{LOOPBACK}:{port}/") as response:
            assert response.connection is not None and response.connection.transport is not None
            sock = response.connection.transport.get_extra_info("socket")
            options = tcp_keepalive_options(sock)
            done.set()
    finally:
        done.set()
        await sessions.close()
    assert options == [1, 60, 10, 3]  # NeMo Gym's global_aiohttp_tcp_keepalive_* defaults


async def test_one_loop_gets_the_same_sessions_until_they_are_closed() -> None:
    first = loop_sessions(POOLS)
    try:
        assert loop_sessions(POOLS) is first
    finally:
        await close_loop_sessions(POOLS)
    second = loop_sessions(POOLS)
    try:
        assert second is not first and not second.is_closed
    finally:
        await close_loop_sessions(POOLS)


def sessions_made_while_instrumented() -> LoopSessions:
    """Sessions made while opentelemetry-instrumentation-aiohttp-client is on (and off again at once)."""
    from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor

    instrumentor = AioHttpClientInstrumentor()
    instrumentor.instrument()
    try:
        return LoopSessions(POOLS)
    finally:
        instrumentor.uninstrument()


async def test_sessions_carry_our_trace_config_while_aiohttps_instrumentation_is_on() -> None:
    """_new_session: with opentelemetry-instrumentation-aiohttp-client active, every new session gets the
    TraceConfig that adds gym_rpc's attributes to the instrumentation's spans; without it, none."""

    def ours(session: aiohttp.ClientSession) -> bool:
        return any(_add_attributes in config.on_request_headers_sent for config in session.trace_configs)

    plain = LoopSessions(POOLS)
    traced = sessions_made_while_instrumented()
    try:
        assert not ours(plain.data) and ours(traced.data) and ours(traced.control)
    finally:
        await plain.close()
        await traced.close()


async def test_a_call_on_an_instrumented_session_tells_the_other_observer_everything() -> None:
    """A traced call on a session aiohttp's instrumentation traces: the call's attributes (the resend count among
    them) go to the instrumentation's span through `trace_request_ctx`, and the other observer (the worker
    metrics', first in the pair `observer_for` makes) hears each resend and the answer as from any traced call."""
    server, port, connections = await start_dropping_server(drops=1)
    base = f"http://{LOOPBACK}:{port}"
    policy = RetryPolicy(attempts=2, initial_backoff_seconds=0.01, max_backoff_seconds=0.02)
    observer = RecordingObserver()
    traced = sessions_made_while_instrumented()
    kwargs: Any = {"data": b"{}"}
    try:
        call = Call(traced.data, "POST", f"{base}/v1/x", kwargs, policy, server="srv")
        span = call_span(call, base)
        assert span is not None
        response = await send(
            Call(
                traced.data, "POST", call.url, kwargs, policy, server="srv", observer=ObserverPair(observer, span)
            )
        )
        async with response:
            assert response.status == 200
    finally:
        await traced.close()
        server.close()
        await server.wait_closed()
    assert (observer.told, connections) == (
        [("resent", 2, "dropped_after_write"), ("answered", response, 2)],
        [2],
    )
    assert kwargs["trace_request_ctx"][_ATTRIBUTES_KEY] == {
        "gym.server.name": "srv",
        "http.request.resend_count": 1,
    }


@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
async def test_a_metered_call_is_sends_own_coroutine_to_its_url_and_in_flight_until_it_ends(
    monkeypatch: pytest.MonkeyPatch, traced: bool
) -> None:
    """A metered call (worker metrics on), traced or not: its observers chosen beforehand (`observer_for`, no
    coroutine), then `send`'s own coroutine (none of ours between the caller and aiohttp), to its URL under the
    caller's resend rule, counted in flight from its observer's making until its answer or its error."""
    monkeypatch.setattr(TRACING, "enabled", traced)
    monkeypatch.setattr(METRICS, "enabled", True)
    server, port, connections = await start_dropping_server(drops=1)
    base = f"http://{LOOPBACK}:{port}"
    policy = RetryPolicy(attempts=2, initial_backoff_seconds=0.01, max_backoff_seconds=0.02)
    in_flight = client_metrics._in_flight
    try:
        async with aiohttp.ClientSession() as session:
            call = Call(session, "POST", f"{base}/v1/x", {"data": b"{}"}, policy, server="srv")
            call.observer = observer_for(call, base)
            sending = send(call)
            assert inspect.iscoroutine(sending) and sending.cr_code is send.__code__
            assert in_flight[("srv", "POST")] == 1
            async with await sending as response:
                assert (response.status, str(response.url)) == (200, f"{base}/v1/x")
            assert (connections, in_flight[("srv", "POST")]) == ([2], 0)
            connections[0] = 0
            with pytest.raises(aiohttp.ServerDisconnectedError):
                call = Call(session, "POST", f"{base}/v1/x", {"data": b"{}"}, policy, server="srv", resend=False)
                call.observer = observer_for(call, base)
                await send(call)
            assert (connections, in_flight[("srv", "POST")]) == ([1], 0)
    finally:
        server.close()
        await server.wait_closed()
