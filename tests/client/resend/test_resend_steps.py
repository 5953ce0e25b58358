"""A resent call, step by step: the backoff, the same body each time, what the observer hears, the refused
server's reason.

Found by mutation testing (`make mutate`, bench/MUTATION.md; these tests were tests/test_exact_behaviour.py):
exact answers no other test pinned down. Each test names the mutant class it kills: a change to the code
that left the rest of the suite green.
"""

from __future__ import annotations

import asyncio
import random
import re

import aiohttp
import pytest

from gym_rpc.client.data._http import (
    Call,
    send,
)
from gym_rpc.client.resend._policy import RetryPolicy
from gym_rpc.errors import (
    ServerUnreachableError,
)
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.observers import RecordingObserver
from tests.support.servers import start_dropping_server


def test_backoff_is_exponential_capped_and_half_random() -> None:
    """RetryPolicy.backoff_seconds: after the n-th failure, a pause in [c/2, c] with c = min(max, initial *
    multiplier ** (n - 1)); both halves of that range are reached (random.seed: the same draws every run)."""
    policy = RetryPolicy(initial_backoff_seconds=0.1, multiplier=3.0, max_backoff_seconds=2.0)
    random.seed(18)
    for failed, ceiling in ((1, 0.1), (2, 0.3), (3, 0.9), (4, 2.0), (9, 2.0)):
        pauses = [policy.backoff_seconds(failed) for _ in range(200)]
        assert ceiling / 2 <= min(pauses) < ceiling * 0.55, (failed, min(pauses))
        assert ceiling * 0.95 < max(pauses) <= ceiling, (failed, max(pauses))


async def test_a_resent_request_carries_the_same_body_and_each_resend_is_counted() -> None:
    """send(): every attempt sends the caller's body again, and its observer hears the number of each attempt
    after the first (the metrics and the span's http.request.resend_count come from it)."""
    bodies: list[bytes] = []

    async def drop_then_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            body = await reader.readexactly(int(length.group(1))) if length else b""
            bodies.append(body)
            if len(bodies) == 3:  # the first two connections are dropped unanswered
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(drop_then_echo, LOOPBACK, 0)
    url = f"http://{LOOPBACK}:{server.sockets[0].getsockname()[1]}/v1/responses"
    observer = RecordingObserver()
    policy = RetryPolicy(attempts=3, initial_backoff_seconds=0.01, max_backoff_seconds=0.02)
    try:
        async with aiohttp.ClientSession() as session:
            response = await send(
                Call(session, "POST", url, {"json": {"a": 1}}, policy, resend=True, observer=observer)
            )
            async with response:
                assert await response.read() == b'{"a": 1}'
    finally:
        server.close()
        await server.wait_closed()
    assert bodies == [b'{"a": 1}'] * 3
    assert observer.told == [
        ("resent", 2, "dropped_after_write"),
        ("resent", 3, "dropped_after_write"),
        ("answered", response, 3),
    ]


async def test_send_tells_its_observer_each_resend_then_the_answer_or_error_with_the_attempts_made() -> None:
    """send(): after one dropped connection and then an answer, the observer hears resent(2) and the kind, then
    answered with the very response the caller gets and 2 attempts; for a refused port, every resend, then failed
    with the very ServerUnreachableError raised and all of the policy's attempts."""
    policy = RetryPolicy(attempts=3, initial_backoff_seconds=0.01, max_backoff_seconds=0.02)
    server, port, connections = await start_dropping_server(drops=1)
    answered = RecordingObserver()
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://{LOOPBACK}:{port}/v1/responses"
            async with await send(
                Call(session, "POST", url, {"data": b"{}"}, policy, resend=True, observer=answered)
            ) as response:
                assert response.status == 200
            assert answered.told == [("resent", 2, "dropped_after_write"), ("answered", response, 2)]
            assert connections == [2]

            failed = RecordingObserver()
            refused = f"http://{LOOPBACK}:{closed_port()}/v1/responses"
            with pytest.raises(ServerUnreachableError) as caught:
                await send(Call(session, "POST", refused, {"data": b"{}"}, policy, resend=True, observer=failed))
    finally:
        server.close()
        await server.wait_closed()
    assert failed.told == [("resent", 2, "refused"), ("resent", 3, "refused"), ("failed", caught.value, 3)]
    assert str(caught.value).startswith(f"POST {refused}: refused or unreachable, given up after 3 attempt(s) in ")


async def test_a_refused_server_is_named_with_the_operating_systems_reason() -> None:
    """ServerUnreachableError carries the OS error's text, not the wrapper's, after what ran out, and the server's
    name where send was given it."""
    port = closed_port()
    url = f"http://{LOOPBACK}:{port}/x"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ServerUnreachableError) as caught:
            await send(Call(session, "GET", url, {}, RetryPolicy(attempts=1), server="model", resend=True))
    assert re.fullmatch(
        re.escape(f"GET {url} (server 'model'): refused or unreachable, given up after 1 attempt(s) in ")
        + r"\d+\.\d s "
        + re.escape(
            f"(its refused budget's attempts ran out): [Errno 111] Connect call failed ('{LOOPBACK}', {port}); "
            "check that it runs and that its host and port in the global config are right"
        ),
        str(caught.value),
    )
    assert (caught.value.kind, caught.value.limit, caught.value.server_name) == ("refused", "attempts", "model")
