"""NeMo Gym head mode is bounded like the rest (issue 43, point 6): every HTTP read a client makes against NeMo
Gym's head and its servers (the config, `/server_instances`, the direct status probes) ends at its deadline and
reads at most a bounded body.

Real loopback servers that drip their answer (a byte every DRIP_EVERY_SECONDS, each byte sooner than any read's
timeout, for DRIP_SECONDS, then close) or answer a 300 MiB body. Before, http.client's timeout bounded each read,
not the call: a dripping answer held a probe or a config GET until the server stopped (`gym-rpc status --timeout 3`
hung 40 s and more), and a probe read a body of any size whole (679 MB of RSS for 300 MiB). Each test tells the
old behaviour apart by what it returns, not only by the time it took: a drip that ends by closing the connection
made the old code fail as a broken answer, where a bounded read reports the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
import yaml

from gym_rpc.client.nemo_gym._head_endpoints import NemoGymEndpoints
from gym_rpc.client.nemo_gym._probe import MAX_PROBE_BODY_BYTES, ProbeResult, probe
from gym_rpc.errors import ControlPlaneError, HeadTimeoutError, UpstreamError
from gym_rpc.server._bridge import MAX_UPSTREAM_ANSWER_BYTES, fetch_upstream
from tests.support.cli import cli_start_seconds, run_cli
from tests.support.documents import server_entry
from tests.support.loopback import LOOPBACK

DRIP_EVERY_SECONDS = 0.2
DRIP_SECONDS = 20.0  # far past every deadline below: the old code waited it out
HUGE_BODY_BYTES = 300 * 1024 * 1024
CHUNK = b"x" * (1024 * 1024)

Handler = Callable[[str, asyncio.StreamWriter], Awaitable[None]]


async def _drip(writer: asyncio.StreamWriter, data: bytes) -> None:
    """`data` a byte at a time, for DRIP_SECONDS at most; then the connection is closed."""
    ends_at = time.monotonic() + DRIP_SECONDS
    for index in range(len(data)):
        if time.monotonic() >= ends_at:
            return
        writer.write(data[index : index + 1])
        await writer.drain()
        await asyncio.sleep(DRIP_EVERY_SECONDS)


def _answer(body: bytes, length: int | None = None) -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {length or len(body)}\r\n\r\n"
    return head.encode("ascii") + body


@contextlib.asynccontextmanager
async def _raw_server(handle: Handler) -> AsyncIterator[str]:
    """A loopback HTTP/1.1 server written by hand: `handle(path, writer)` answers each request; its address. Its
    handlers still running (a drip) are cancelled when it stops."""
    tasks: set[asyncio.Task[None] | None] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks.add(task := asyncio.current_task())
        try:
            request = await reader.readuntil(b"\r\n\r\n")
            await handle(request.split(b" ")[1].decode("ascii"), writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client gave up, as it should
        finally:
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(serve, LOOPBACK, 0)
    try:
        yield f"{LOOPBACK}:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        running = [task for task in tasks if task is not None]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await server.wait_closed()


async def _timed(call: Callable[[], object]) -> tuple[object, float]:
    """`call()` in a thread: what it returned (or raised), and how long it took."""
    started = time.monotonic()
    try:
        result: object = await asyncio.to_thread(call)
    except Exception as error:
        result = error
    return result, time.monotonic() - started


@pytest.mark.parametrize("part", ["status line", "headers", "body"])
async def test_a_probe_of_a_dripping_server_ends_at_its_timeout(part: str) -> None:
    body = json.dumps({"status": "ok", "padding": "y" * 400}).encode()
    whole = _answer(body)
    sent_at_once = {"status line": 0, "headers": len(b"HTTP/1.1 200 OK\r\n"), "body": len(whole) - len(body)}[part]

    async def dripping(path: str, writer: asyncio.StreamWriter) -> None:
        writer.write(whole[:sent_at_once])
        await _drip(writer, whole[sent_at_once:])

    async with _raw_server(dripping) as address:
        result, took = await _timed(lambda: probe(f"http://{address}/", 1.0))
    assert isinstance(result, ProbeResult) and result.status == "timeout", result
    assert took < DRIP_SECONDS / 2, f"took {took:.1f} s"


async def test_a_probe_reads_a_bounded_body_of_a_huge_answer() -> None:
    """300 MiB answered to `GET /`: the probe is "success" (any HTTP answer is up) and reads at most its bound;
    the server got to send less than a tenth of it before the probe closed the connection (kernel buffers hold
    some)."""
    sent = [0]

    async def huge(path: str, writer: asyncio.StreamWriter) -> None:
        writer.write(_answer(b"", HUGE_BODY_BYTES))
        while sent[0] < HUGE_BODY_BYTES:
            writer.write(CHUNK)
            await writer.drain()
            sent[0] += len(CHUNK)

    async with _raw_server(huge) as address:
        result, _ = await _timed(lambda: probe(f"http://{address}/", 30.0))
    assert isinstance(result, ProbeResult) and (result.status, result.http_status) == ("success", 200), result
    assert sent[0] < HUGE_BODY_BYTES // 10, f"the server sent {sent[0] / 2**20:.0f} MiB"
    assert MAX_PROBE_BODY_BYTES <= 1024 * 1024


@pytest.mark.parametrize("path", ["/global_config_dict_yaml", "/server_instances"])
async def test_a_dripping_nemo_gym_head_fails_the_call_at_its_deadline(path: str) -> None:
    """The config and the instances from NeMo Gym's head: a dripping answer is the head's timeout, at the call's
    deadline (before: the GET lasted as long as the drip, then failed as "unreachable")."""

    async def dripping(asked: str, writer: asyncio.StreamWriter) -> None:
        await _drip(writer, _answer(json.dumps("head_server: {}" if "config" in asked else []).encode()))

    async with _raw_server(dripping) as address:
        head = NemoGymEndpoints(address)
        call = head.instances if path == "/server_instances" else lambda t: head.config(t, include_secrets=False)
        result, took = await _timed(lambda: call(1.0))
    assert isinstance(result, HeadTimeoutError), result
    assert path in str(result) and "within 1 s" in str(result)
    assert took < DRIP_SECONDS / 2, f"took {took:.1f} s"


async def test_a_huge_config_is_refused_after_its_bound() -> None:
    sent = [0]

    async def huge(path: str, writer: asyncio.StreamWriter) -> None:
        writer.write(_answer(b"", HUGE_BODY_BYTES))
        while sent[0] < HUGE_BODY_BYTES:
            writer.write(CHUNK)
            await writer.drain()
            sent[0] += len(CHUNK)

    async with _raw_server(huge) as address:
        result, _ = await _timed(lambda: NemoGymEndpoints(address).config(30.0, include_secrets=False))
    assert isinstance(result, ControlPlaneError) and "more than 67108864 bytes" in str(result), result
    assert sent[0] < HUGE_BODY_BYTES // 2, f"the server sent {sent[0] / 2**20:.0f} MiB"


# --- the command: `gym-rpc status --timeout 2` in a real subprocess ---


def _nemo_gym_head_handler(config: dict, drip_config: bool) -> Handler:
    """NeMo Gym's head endpoints (`GET /` answered at once, so the client tells it apart); the config dripped when
    `drip_config`."""

    async def handle(path: str, writer: asyncio.StreamWriter) -> None:
        if path == "/global_config_dict_yaml":
            answer = _answer(json.dumps(yaml.safe_dump(config)).encode())
            await (_drip(writer, answer) if drip_config else _write(writer, answer))
        else:
            await _write(writer, _answer(b"[]" if path == "/server_instances" else b'{"status": "ok"}'))

    return handle


async def _write(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    await writer.drain()


async def _dripping_server(path: str, writer: asyncio.StreamWriter) -> None:
    await _drip(writer, _answer(b'{"status": "ok"}'))


@pytest.mark.parametrize("dripping", ["head config", "server"])
async def test_status_ends_at_its_deadline_against_a_dripping_nemo_gym_deployment(dripping: str) -> None:
    """`gym-rpc status --timeout 2` makes two calls (instances, statuses), each within 2 s: a dripping config is
    the head's timeout (exit 3), a dripping server is down with "timeout" (exit 1). Before: 40 s and more."""
    timeout = 2.0
    async with _raw_server(_dripping_server) as server_address:
        port = int(server_address.rsplit(":", 1)[1])
        config = {"head_server": {"host": LOOPBACK, "port": 1}, "slow": server_entry(port)}
        handler = _nemo_gym_head_handler(config, drip_config=dripping == "head config")
        async with _raw_server(handler) as head_address:
            start = await asyncio.to_thread(cli_start_seconds)
            started = time.monotonic()
            args = ["status", "--json", "--head", head_address, "--timeout", str(timeout)]
            result = await asyncio.to_thread(run_cli, args, timeout=60)
            took = time.monotonic() - started
            start = max(start, await asyncio.to_thread(cli_start_seconds))  # the machine's load, before and after
    if dripping == "head config":
        assert result.returncode == 3, result.stderr
        assert "did not answer GET /global_config_dict_yaml" in result.stderr
    else:
        assert result.returncode == 1, result.stderr
        assert [row["status"] for row in json.loads(result.stdout)] == ["timeout"]
    # two calls of 2 s, on top of the command's own start (measured beside it) and a loaded machine's slack
    assert took < start + 2 * timeout + 4.0, f"took {took:.1f} s, a bare start {start:.1f} s"


@pytest.mark.parametrize("says_its_length", [True, False])
async def test_the_bridge_refuses_a_huge_upstream_answer_as_it_comes(says_its_length: bool) -> None:
    """`gym-rpc bridge` reads NeMo Gym's head too: a 300 MiB config is refused past 64 MiB (at once when its
    Content-Length says so), never read whole. Before, the bridge read whatever came within its fetch timeout."""
    sent = [0]

    async def huge(path: str, writer: asyncio.StreamWriter) -> None:
        length = f"Content-Length: {HUGE_BODY_BYTES}" if says_its_length else "Connection: close"
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{length}\r\n\r\n".encode("ascii"))
        while sent[0] < HUGE_BODY_BYTES:
            writer.write(CHUNK)
            await writer.drain()
            sent[0] += len(CHUNK)

    async with _raw_server(huge) as address, aiohttp.ClientSession(trust_env=False) as session:
        with pytest.raises(UpstreamError, match=f"more than {MAX_UPSTREAM_ANSWER_BYTES} bytes"):
            await fetch_upstream(session, f"http://{address}")
    assert sent[0] < MAX_UPSTREAM_ANSWER_BYTES * 2, f"the upstream sent {sent[0] / 2**20:.0f} MiB"
