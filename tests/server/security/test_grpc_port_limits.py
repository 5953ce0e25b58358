"""The gRPC port is bounded too (issue 26, point 2): 1,100 HTTP/2 connections that send the preface and then
nothing, against a `gym-rpc head` limited to 1,024 descriptors, take no more than the port's bound (258 at this
limit), so the prober keeps a healthy server `success`, the Connect port answers, reloads (SIGHUP and
ReloadGlobalConfig) work, an operator's open connection keeps answering, and once the idle deadline has closed the
flood new clients connect.
"""

from __future__ import annotations

import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from gym_rpc.client.control._clients import SyncControlClient
from gym_rpc.server.security._connection_limits import grpc_connection_bound
from tests.support.cli import threaded_http_server
from tests.support.documents import document, server_entry
from tests.support.fd_limits import FD_LIMIT, head_with_fd_limit
from tests.support.loopback import closed_port

ATTACK_CONNECTIONS = 1100
GRPC_BOUND_AT_1024 = 258  # 1024 - 3 * 170 (the HTTP-side ports, all open here) - 256 (OTHER_FD_RESERVE)
IDLE_SECONDS = 3.0
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # + an empty SETTINGS frame


def test_the_grpc_bound_fits_the_descriptor_budget() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, hard))
        assert grpc_connection_bound() == GRPC_BOUND_AT_1024
        assert grpc_connection_bound(100) == 100
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_http2_flood(port: int, count: int) -> list[socket.socket]:
    """`count` connections that each send the HTTP/2 preface and an empty SETTINGS frame, then nothing."""
    sockets: list[socket.socket] = []
    for _ in range(count):
        sock = socket.socket()
        sock.settimeout(5)
        try:
            sock.connect(("127.0.0.1", port))
            sock.sendall(PREFACE)
        except OSError:  # refused at the bound (grpc closes at once), or the backlog is full: still an attempt
            pass
        sockets.append(sock)
    return sockets


def connect_call(port: int) -> int:
    """The HTTP status of a Connect ListServerStatuses call (200 when served)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/gym_rpc.v1.ControlPlaneService/ListServerStatuses",
        data=b"{}",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return int(answer.status)


def statuses(client: SyncControlClient) -> dict[str, str | None]:
    return {r.server_name: r.status for r in client.list_server_statuses(timeout=10).reports}


@pytest.mark.timeout(240)  # 1,100 connections opened one by one, a reload, the idle deadline: slow when loaded
def test_a_flood_of_idle_http2_connections_takes_only_the_grpc_bound(tmp_path: Path, many_fds) -> None:
    log = tmp_path / "head.log"
    with threaded_http_server() as server:
        servers = {"policy": server_entry(server.port)}
        config = tmp_path / "gym.yaml"
        config.write_text(yaml.safe_dump(document(servers)), encoding="utf-8")
        flags = ("--config", str(config), "--probe-interval", "0.2", "--connection-idle", str(IDLE_SECONDS))
        with head_with_fd_limit(log, *flags) as (head, address, ports):
            connect_port = ports["connect"]
            operator = SyncControlClient(address, timeout_seconds=10.0)
            # The operator's connection carries a watch, so it is never idle: it stays open through the flood.
            watch = operator.watch_server_statuses(heartbeat_seconds=0.5)
            assert next(iter(watch)).kind == "snapshot"
            descriptors = Path(f"/proc/{head.pid}/fd")
            before = len(list(descriptors.iterdir()))
            port = int(address.rsplit(":", 1)[1])
            flood = open_http2_flood(port, ATTACK_CONNECTIONS)
            try:
                time.sleep(1.0)
                taken = len(list(descriptors.iterdir())) - before
                assert GRPC_BOUND_AT_1024 // 2 < taken <= GRPC_BOUND_AT_1024 + 16, taken
                # Nothing starves: the prober (a healthy server stays up, no "Too many open files"), the Connect
                # port, and reloads by SIGHUP and by RPC over the operator's connection.
                for _ in range(3):
                    assert statuses(operator)["policy"] == "success"
                    assert connect_call(connect_port) == 200
                    time.sleep(0.5)
                config.write_text(yaml.safe_dump(document({**servers, "b": server_entry(closed_port())})))
                head.send_signal(signal.SIGHUP)
                deadline = time.monotonic() + 20
                while statuses(operator).get("b") != "connection_error":
                    assert time.monotonic() < deadline, f"the SIGHUP reload never served b: {log.read_text()}"
                    time.sleep(0.2)
                config.write_text(yaml.safe_dump(document({**servers, "c": server_entry(closed_port())})))
                assert operator.reload_global_config(timeout=10)[1]
                # Past the idle deadline the head has closed the flood's connections: new clients get in.
                time.sleep(IDLE_SECONDS + 2.0)
                assert SyncControlClient(address, timeout_seconds=10.0).head_status() == "success"
                closed = sum(1 for sock in flood[:50] if _closed_by_peer(sock))
                assert closed >= 40, closed
            finally:
                for sock in flood:
                    sock.close()
                watch.close()
    text = log.read_text()
    assert "Too many open files" not in text and "Traceback" not in text, text[:3000]
    assert len(text) < 20_000, text[:3000]


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the head ended this connection (EOF or reset after what it sent, such as a GOAWAY)."""
    sock.settimeout(2)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True
