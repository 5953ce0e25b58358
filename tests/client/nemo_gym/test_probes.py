"""A probe of a NeMo Gym-style server, exactly: what it reports, its unsampled traceparent, its session (a fresh
connection each time, no proxy, no cookies, not traced), and the harness headers.

Found by mutation testing (`make mutate`, bench/MUTATION.md; these tests were tests/test_exact_behaviour.py):
exact answers no other test pinned down. Each test names the mutant class it kills: a change to the code
that left the rest of the suite green.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from gym_rpc.config import (
    GlobalConfig,
)
from gym_rpc.errors import (
    ConfigError,
)
from gym_rpc.server.fleet._prober import new_probe_session, probe, unsampled_traceparent
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port


def test_a_harness_package_without_a_header_declares_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """_declared_header: a harness package that defines no ASSISTANT_MESSAGE_HEADER declares no header; one that
    defines something other than text or bytes is one exact line naming the server."""
    (tmp_path / "plain_harness.py").write_text("NAME = 'x'\n", encoding="utf-8")
    (tmp_path / "odd_harness.py").write_text("ASSISTANT_MESSAGE_HEADER = 42\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))

    def agent(package: str) -> dict[str, object]:
        entry = server_entry(8100, "responses_api_agents", harness_package=package)
        next(iter(entry["responses_api_agents"].values()))["model_server"] = {"name": "policy"}
        return entry

    plain = GlobalConfig.from_document(document({"policy": server_entry(8000), "agent": agent("plain_harness")}))
    assert plain.assistant_message_header("policy") is None
    odd = GlobalConfig.from_document(document({"policy": server_entry(8000), "agent": agent("odd_harness")}))
    with pytest.raises(ConfigError) as caught:
        odd.assistant_message_header("policy")
    assert str(caught.value) == "server 'agent': assistant_message_header must be text or bytes"


async def test_a_probe_reports_exactly_what_it_got(http_server, silent_server: int) -> None:
    """probe(): any HTTP answer is success with its status code and no detail; a refused connection says why,
    with no HTTP status; a silent server is a timeout naming the deadline."""
    answering, refused = await http_server(), closed_port()
    async with new_probe_session() as session:
        ok = await probe(session, "ok", f"http://{LOOPBACK}:{answering}", 5)
        down = await probe(session, "down", f"http://{LOOPBACK}:{refused}", 5)
        mute = await probe(session, "mute", f"http://{LOOPBACK}:{silent_server}", 0.2)
    assert (ok.status, ok.http_status, ok.detail) == ("success", 200, "")
    assert (down.status, down.http_status, down.detail) == (
        "connection_error",
        0,
        f"[Errno 111] Connect call failed ('{LOOPBACK}', {refused})",
    )
    assert (mute.status, mute.http_status, mute.detail) == ("timeout", 0, "no answer within 0.2s")
    assert 0 <= mute.latency_seconds < 1.0  # the deadline is the probe's own 0.2 s, not a floor above it


def test_probe_traceparents_are_unsampled_and_random() -> None:
    """unsampled_traceparent: W3C version 00, a random 128-bit trace id and 64-bit span id, sampled flag off."""
    seen = {unsampled_traceparent() for _ in range(200)}
    assert len(seen) == 200
    assert all(re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-00", header) for header in seen)
    assert len({header[3:35] for header in seen}) == 200 and len({header[36:52] for header in seen}) == 200


async def test_a_probe_sends_an_unsampled_traceparent_and_names_an_unexpected_error(http_server) -> None:
    seen: list[str] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(request.headers.get("traceparent", ""))
        return web.Response()

    app = web.Application()
    app.router.add_get("/", record)
    port = await http_server(app)
    async with new_probe_session() as session:
        answered = await probe(session, "s", f"http://{LOOPBACK}:{port}/", 5)
        bad = await probe(session, "bad", "http://[::1", 5)
    assert len(seen) == 1 and re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-00", seen[0]), seen
    assert 0 < answered.latency_seconds < 5
    assert (bad.status, bad.detail) == ("unknown_error", "InvalidUrlClientError: http://[::1")


_Seen = tuple[int, tuple[tuple[bytes, bytes], ...]]  # the client's port and the raw request headers


async def _probe_recorder(http_server: Callable[..., Awaitable[int]]) -> tuple[int, list[_Seen]]:
    """A real aiohttp server that records each request's client port and raw headers and sets a cookie."""
    seen: list[_Seen] = []

    async def answer(request: web.Request) -> web.Response:
        assert request.transport is not None
        seen.append((request.transport.get_extra_info("peername")[1], request.raw_headers))
        response = web.Response(text="ok")
        response.set_cookie("session", "abc")
        return response

    app = web.Application()
    app.router.add_get("/", answer)
    return await http_server(app), seen


async def test_a_probe_session_opens_a_fresh_connection_per_probe_with_our_user_agent_and_no_cookies(
    http_server: Callable[..., Awaitable[int]],
) -> None:
    """new_probe_session: force_close (two probes, two client ports), the probe User-Agent spelled as written, and
    no cookie sent back (to a hostname: aiohttp's default jar would ignore cookies for an IP address anyway)."""
    port, seen = await _probe_recorder(http_server)
    async with new_probe_session() as session:
        for _ in range(2):
            report = await probe(session, "s", f"http://localhost:{port}", 5)
            assert (report.status, report.http_status) == ("success", 200)
    assert len(seen) == 2 and seen[0][0] != seen[1][0]
    for _, raw_headers in seen:
        names = [name for name, _ in raw_headers]
        assert [value for name, value in raw_headers if name.lower() == b"user-agent"] == [b"gym-rpc-probe/0.1.0"]
        assert b"User-Agent" in names and b"Cookie" not in names and b"cookie" not in names


async def test_a_probe_session_ignores_proxy_settings_in_the_environment(
    http_server: Callable[..., Awaitable[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """trust_env=False: an HTTP_PROXY that refuses connections does not turn a live server into an error."""
    monkeypatch.setenv("HTTP_PROXY", f"http://{LOOPBACK}:{closed_port()}")
    for name in ("NO_PROXY", "no_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    port, seen = await _probe_recorder(http_server)
    async with new_probe_session() as session:
        report = await probe(session, "s", f"http://{LOOPBACK}:{port}", 5)
    assert (report.status, report.http_status, report.detail, len(seen)) == ("success", 200, "", 1)


async def test_a_probe_session_has_the_connection_limit_it_is_given() -> None:
    async with new_probe_session() as default, new_probe_session(3) as three:
        assert default.connector is not None and three.connector is not None
        assert (default.connector.limit, three.connector.limit) == (100, 3)


async def test_a_probe_session_is_not_traced_while_aiohttps_instrumentation_is_on(
    http_server: Callable[..., Awaitable[int]],
) -> None:
    """The instrumentation's trace config is removed from the probe session: no span for a probe."""
    from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    port, seen = await _probe_recorder(http_server)
    instrumentor = AioHttpClientInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        async with new_probe_session() as session:
            report = await probe(session, "s", f"http://{LOOPBACK}:{port}", 5)
            assert session.trace_configs == []
    finally:
        instrumentor.uninstrument()
    assert (report.status, len(seen), exporter.get_finished_spans()) == ("success", 1, ())
