"""The HTTP side cannot take the head down (issue 14, item 2): a head whose file-descriptor limit is 1024 is held
by 1,100 idle and slow-header sockets spread over its NeMo Gym HTTP port, its metrics port and its Connect port at
once, and its gRPC port still answers, its log stays small, and each port serves again once the sockets are
dropped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import selectors
import socket
import ssl
import subprocess
import time
from pathlib import Path

from aiohttp import web

from gym_rpc._logging import RateLimitedLog
from gym_rpc.client.control._clients import SyncControlClient
from gym_rpc.server.security._connection_limits import BoundedListener, connection_bound
from tests.support.cli import cli_command, cli_env
from tests.support.fd_limits import ATTACK_SOCKETS, head_with_fd_limit
from tests.support.security import Pki

BOUND_AT_1024 = (
    170  # connections per HTTP-side port at this limit (test_connection_bound_keeps_a_reserve_for_grpc)
)


def open_attack_sockets(port: int, count: int) -> list[socket.socket]:
    """`count` connections, opened in batches of 100 that each wait for the handshake (up to 5 s, or until none
    completed for 1 s: past the head's bound and the kernel's backlog the rest wait unanswered), so all the head
    takes reach it; half stay idle, half send a request line and one header and then nothing (slowloris)."""
    sockets: list[socket.socket] = []
    while len(sockets) < count:
        batch = []
        for _ in range(min(100, count - len(sockets))):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            batch.append(sock)
        with selectors.DefaultSelector() as selector:
            for sock in batch:
                selector.register(sock, selectors.EVENT_WRITE)
            pending, deadline = set(batch), time.monotonic() + 5.0
            progress = time.monotonic()
            while pending and time.monotonic() < min(deadline, progress + 1.0):
                for key, _ in selector.select(0.2):
                    pending.discard(key.fileobj)
                    selector.unregister(key.fileobj)
                    progress = time.monotonic()
        for index, sock in enumerate(batch):
            if index % 2:
                with contextlib.suppress(OSError):
                    sock.send(b"GET / HTTP/1.1\r\nHost: head\r\n")
        sockets += batch
    return sockets


def test_a_flood_of_silent_http_sockets_leaves_grpc_answering_and_the_log_small(tmp_path: Path, many_fds) -> None:
    """All three HTTP-side ports flooded at once, each past its bound (170 at this limit) and its kernel backlog:
    the worst case the descriptor reserve is sized for (test_connection_bound_keeps_a_reserve_for_grpc); 1,100
    sockets in all, more than the head's 1,024 descriptors."""
    log = tmp_path / "head.log"
    with head_with_fd_limit(log) as (head, address, ports):
        descriptors = Path(f"/proc/{head.pid}/fd")
        before = len(list(descriptors.iterdir()))
        sockets: list[socket.socket] = []
        try:
            for port in ports.values():
                sockets += open_attack_sockets(port, -(-ATTACK_SOCKETS // len(ports)))
            time.sleep(1.0)  # let the head accept what it will
            client = SyncControlClient(address, timeout_seconds=10.0)
            for _ in range(3):
                assert client.list_server_statuses().reports is not None
                assert client.head_status() == "success"
                time.sleep(1.0)
            # The flood reached the head, and took no more than the three bounds: the reserve stayed free (the
            # calls above alone would pass without it, once the 10 s header deadline frees descriptors).
            taken = len(list(descriptors.iterdir())) - before
            assert 3 * BOUND_AT_1024 // 2 < taken <= 3 * BOUND_AT_1024 + 16, taken
        finally:
            for sock in sockets:
                sock.close()
        # Each port serves again once the flood is gone (any HTTP answer: 200, or Connect's 404 for GET /).
        deadline = time.monotonic() + 20.0
        for side, port in ports.items():
            while not _answers_http(port):
                assert time.monotonic() < deadline, f"the {side} port never served again"
                time.sleep(0.2)
    size = log.stat().st_size
    assert size < 20_000, f"{size} bytes of log: {log.read_text()[:3000]}"


def _answers_http(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as probe:
            probe.sendall(b"GET / HTTP/1.1\r\nHost: head\r\nConnection: close\r\n\r\n")
            return probe.recv(64).startswith(b"HTTP/1.1 ")
    except OSError:
        return False


def test_the_head_raises_its_soft_fd_limit_to_the_hard_one(tmp_path: Path) -> None:
    def soft_1024_hard_2048() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 2048))

    process = subprocess.Popen(
        cli_command(["head", "--port", "0"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=cli_env(),
        preexec_fn=soft_1024_hard_2048,
    )
    try:
        assert process.stdout is not None
        assert "listening on" in process.stdout.readline()
        limits = Path(f"/proc/{process.pid}/limits").read_text()
        (line,) = [row for row in limits.splitlines() if row.startswith("Max open files")]
        assert line.split()[3:5] == ["2048", "2048"], line
    finally:
        process.kill()
        process.wait(timeout=10)


async def ok_runner(listener: BoundedListener) -> web.AppRunner:
    """An aiohttp app answering "ok" to GET /, set up to be served through `listener`."""

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[listener.mark_answered])
    app.router.add_get("/", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    return runner


async def test_silent_connections_are_dropped_at_the_header_deadline_and_the_bound_holds() -> None:
    listener = BoundedListener(max_connections=2, header_timeout_seconds=0.3)
    runner = await ok_runner(listener)
    port = listener.listen("127.0.0.1", 0)
    listener.start(runner)
    try:
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        # The first two are accepted and then dropped at the deadline; the third waits for a slot meanwhile.
        for reader, _ in silent[:2]:
            assert await asyncio.wait_for(reader.read(), timeout=10) == b""
        assert await asyncio.wait_for(silent[2][0].read(), timeout=10) == b""
        # A client that does send its request is answered, and kept past the deadline.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"ok"), timeout=10)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.6)
        writer.write(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), timeout=10)).startswith(b"HTTP/1.1 200")
        for _, silent_writer in silent:
            silent_writer.close()
        writer.close()
    finally:
        await listener.stop()
        await runner.cleanup()


async def test_a_silent_tls_client_is_dropped_at_the_deadline_without_stalling_the_others(pki: Pki) -> None:
    """The Connect port with TLS: a client that never sends its ClientHello is closed at the header deadline, and
    the handshake it owes does not hold up the accept loop meanwhile."""
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(pki.server_cert, pki.server_key)
    listener = BoundedListener(max_connections=2, header_timeout_seconds=3.0)
    runner = await ok_runner(listener)
    port = listener.listen("127.0.0.1", 0)
    assert runner.server is not None
    listener.start_protocol(runner.server, ssl_context=server_tls)
    try:
        silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", port)
        client_tls = ssl.create_default_context(cafile=str(pki.ca))
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_tls)
        writer.write(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), timeout=10)).startswith(b"HTTP/1.1 200")
        assert not silent_reader.at_eof()  # served while the silent one still waited for its deadline
        writer.close()
        assert await asyncio.wait_for(silent_reader.read(), timeout=10) == b""  # dropped at the deadline
        silent_writer.close()
    finally:
        await listener.stop()
        await runner.cleanup()


def test_connection_bound_keeps_a_reserve_for_grpc() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        # Three HTTP-side ports (HTTP head, metrics, Connect), all full, still leave 512 descriptors free.
        resource.setrlimit(resource.RLIMIT_NOFILE, (600, hard))
        assert connection_bound(256) == 29  # (600 - 512) // 3
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        assert connection_bound(256) == connection_bound(1024) == 170
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
        assert connection_bound(256) == 256 and connection_bound(1024) == 1024
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_repeating_failure_is_logged_once_per_interval(caplog) -> None:
    caplog.set_level(logging.WARNING)
    log = RateLimitedLog(logging.getLogger("tests.rate"), interval_seconds=60.0)
    for _ in range(1000):
        log.log("cannot accept: Too many open files")
    assert [r.getMessage() for r in caplog.records] == ["cannot accept: Too many open files"]
