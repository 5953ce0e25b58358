"""Connections per client address on the gRPC port (issue 43, point 9b): one address flooding the port with idle
HTTP/2 connections takes only its own share, and a client from another address connects and gets answers.

Two client addresses that are not both loopback (every loopback address is one client) need a network namespace
of its own (`unshare -rn`), as in tests/server/registry/test_instance_identity.py: the head listens on 0.0.0.0
there, so it runs its relay (gym_rpc.server.security._grpc_relay); the flood comes from 127.0.0.1 and the other
client from 10.43.0.1, an address of the namespace's loopback interface. Through the relay every per-address rule
still sees the real caller: the watch shares, and the address a wildcard server registers at.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.client.control._credentials import client_security
from gym_rpc.errors import ControlPlaneError, HeadUnreachableError
from gym_rpc.server.security._grpc_relay import PeerMap, per_address_bound
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.namespaces import add_address, interface_up, needs_namespace, pytest_in_namespace
from tests.support.security import make_pki, tls_block

IN_NAMESPACE = "GYM_RPC_TEST_PER_ADDRESS_NETNS"
NODE = "10.43.0.1"  # another client address, on the namespace's loopback interface
MAX_CONNECTIONS = 40  # the port's total bound: the flood alone is 2.5 times it
FLOOD = 100
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # + an empty SETTINGS frame


@pytest.mark.process
@needs_namespace
def test_a_flood_of_idle_connections_from_one_address_leaves_room_for_others() -> None:
    """Runs the flood below inside a network namespace of its own."""
    pytest_in_namespace(f"{__file__}::test_the_flood_inside_a_namespace", IN_NAMESPACE)


def _flood(port: int) -> list[socket.socket]:
    """FLOOD connections from 127.0.0.1 that each send the HTTP/2 preface and an empty SETTINGS, then nothing."""
    sockets = []
    for _ in range(FLOOD):
        sock = socket.socket()
        sock.settimeout(10)
        try:
            sock.connect((LOOPBACK, port))
            sock.sendall(PREFACE)
        except OSError:  # closed at once by the head: still an attempt
            pass
        sockets.append(sock)
    return sockets


def _closed_by_the_head(sock: socket.socket) -> bool:
    """Whether the head ended this connection (EOF or a reset), reading whatever it sent first."""
    sock.settimeout(0.05)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


async def _settled(flood: list[socket.socket], held: int) -> None:
    """Wait until the head has closed every connection of the flood but the `held` it keeps (a state, not a
    time: each connection is accepted and judged in turn)."""
    open_ = list(flood)
    for _ in range(600):
        open_ = [sock for sock in open_ if not await asyncio.to_thread(_closed_by_the_head, sock)]
        if len(open_) <= held:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{len(open_)} of the flood's connections still open, expected {held}")


@pytest.mark.skipif(os.environ.get(IN_NAMESPACE) != "1", reason="runs inside a network namespace of its own")
async def test_the_flood_inside_a_namespace(head_factory: Any) -> None:
    interface_up(b"lo")
    add_address(b"lo:1", NODE)
    interface_up(b"lo:1")
    doc = document({"policy": server_entry(closed_port())})
    head = await head_factory(
        doc,
        host="0.0.0.0",
        open_registrations=True,
        max_connections=MAX_CONNECTIONS,
        max_watches_per_peer=2,
        connection_idle_seconds=120.0,  # the flood stays for the whole test
        handshake_timeout_seconds=120.0,
    )
    share = per_address_bound(1024, MAX_CONNECTIONS)
    flood = await asyncio.to_thread(_flood, head.port)
    try:
        # Without the per-address bound the flood holds all MAX_CONNECTIONS (grpc closes the rest), and the
        # client below is refused (its status connection_error); with it, the flood holds its address's share.
        await _settled(flood, MAX_CONNECTIONS)
        other = ControlClient(f"{NODE}:{head.port}", timeout_seconds=10.0)
        assert await other.head_status() == "success"
        await _settled(flood, share)
        statuses = await other.list_server_statuses()
        assert [report.server_name for report in statuses.reports] == ["policy"]
        assert head.relay is not None and head.relay.refused >= FLOOD - share

        # The flooding address gets nothing more (every loopback address is that one client).
        with pytest.raises(ControlPlaneError) as caught:
            await ControlClient(f"{LOOPBACK}:{head.port}", timeout_seconds=3.0).list_server_statuses()
        assert caught.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

        # The real caller behind the relay: its watch share is its own, and a wildcard server registering from
        # it is advertised at its address.
        watches = [other.watch_server_statuses() for _ in range(2)]
        for watch in watches:
            assert (await anext(aiter(watch))).kind == "snapshot"
        with pytest.raises(ControlPlaneError) as caught:
            await anext(aiter(other.watch_server_statuses()))
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"{NODE} already holds 2" in str(
            caught.value
        )
        port = closed_port()
        advertised = await other.register_server_instance("policy", listen_port=port, listen_host="0.0.0.0")
        assert advertised.startswith(f"http://{NODE}:"), advertised
        for watch in watches:
            await watch.aclose()
    finally:
        for sock in flood:
            sock.close()


class _Context:
    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer


def test_a_relayed_peer_the_map_does_not_know_is_no_loopback_caller() -> None:
    """A call on a relayed connection whose entry is gone (or a local process that bound the relay's source
    address itself) has no address, so it never passes for this machine."""
    peers = PeerMap()
    owner = object()
    peers.add("ipv4:127.77.0.1:40000", "ipv4:10.0.0.7:5000", owner)
    assert peers.caller(_Context("ipv4:127.77.0.1:40000")) == "ipv4:10.0.0.7:5000"  # type: ignore[arg-type]
    assert "127" not in peers.caller(_Context("ipv4:127.77.0.1:40001"))  # type: ignore[arg-type]
    assert peers.caller(_Context("ipv4:127.0.0.1:40000")) == "ipv4:127.0.0.1:40000"  # type: ignore[arg-type]
    peers.forget("ipv4:127.77.0.1:40000", object())  # another connection's: kept
    assert len(peers) == 1
    peers.forget("ipv4:127.77.0.1:40000", owner)
    assert len(peers) == 0


async def test_tls_and_client_certificates_pass_through_the_relay(head_factory: Any, tmp_path: Path) -> None:
    """grpc still terminates TLS behind the relay: a client trusting the CA and holding a certificate is served,
    one without a certificate is refused (mutual TLS), as without the relay."""
    pki = make_pki(tmp_path)
    head_server = {"host": LOOPBACK, "port": 0, "tls": tls_block(pki, mutual=True)}
    head = await head_factory(document({}, head_server=head_server), connection_relay=True)
    assert head.relay is not None

    def security(cert: bool) -> Any:
        tls = {"ca_file": str(pki.ca)}
        if cert:
            tls.update(client_cert_file=str(pki.client_cert), client_key_file=str(pki.client_key))
        return client_security({"host": LOOPBACK, "port": 1, "tls": tls})

    served = ControlClient(head.address, security=security(cert=True), timeout_seconds=10.0)
    assert (await served.list_server_statuses()).reports == []
    refused = ControlClient(head.address, security=security(cert=False), timeout_seconds=3.0)
    with pytest.raises(HeadUnreachableError):
        await refused.list_server_statuses()
    assert head.relay.open >= 1


_CLI_IN_NAMESPACE = r"""
import fcntl, json, re, socket, struct, subprocess, sys, time

with socket.socket() as s:  # SIOCGIFFLAGS, SIOCSIFFLAGS: lo up
    flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, struct.pack("16sh", b"lo", 0)))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 1))
config, preface = sys.argv[1], bytes.fromhex(sys.argv[2])
head = subprocess.Popen(
    [sys.executable, "-m", "gym_rpc", "head", "--config", config, "--host", "0.0.0.0", "--port", "0",
     "--max-connections-per-address", "2"],
    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
)
try:
    port = int(re.search(r"listening on [^ ]*:(\d+)", head.stdout.readline()).group(1))
    sockets = []
    for _ in range(3):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(preface)
        sockets.append(sock)
    closed = []
    for sock in sockets:  # the third is closed at once; the first two get grpc's SETTINGS and stay open
        sock.settimeout(1.0)
        try:
            while sock.recv(65536):
                pass
            closed.append(True)
        except TimeoutError:
            closed.append(False)
        except OSError:
            closed.append(True)
    print(json.dumps({"closed": closed}), flush=True)
finally:
    head.terminate()
    head.communicate(timeout=30)
"""


@pytest.mark.process
@needs_namespace
def test_the_cli_sets_the_per_address_bound(tmp_path: Path) -> None:
    """`gym-rpc head --host 0.0.0.0 --max-connections-per-address 2` (in a namespace of its own): a third
    connection from one address is closed at once, the two before it stay open."""
    config = tmp_path / "head.yaml"
    config.write_text("head_server: {host: 127.0.0.1, port: 0}\n", encoding="utf-8")
    done = subprocess.run(
        ["unshare", "-rn", sys.executable, "-c", _CLI_IN_NAMESPACE, str(config), PREFACE.hex()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"closed": [False, False, True]}


async def test_connections_that_come_and_go_leave_nothing_held(head_factory: Any) -> None:
    """200 connections through the relay (each closed at once, reset, or after the preface) and calls on fresh
    channels: once they are gone, the relay holds no connection and no count (with a share of 10 per address, a
    count left behind by each would lock the address out), and the next client is served."""
    doc = document({"policy": server_entry(closed_port())})
    head = await head_factory(doc, connection_relay=True, max_connections=MAX_CONNECTIONS)
    assert head.relay is not None

    def churn() -> None:
        for index in range(200):
            sock = socket.create_connection((LOOPBACK, head.port), timeout=10)
            if index % 3 == 1:
                sock.sendall(PREFACE)
            elif index % 3 == 2:  # a reset rather than a close
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()

    await asyncio.to_thread(churn)
    # every one accepted (not still in the listen backlog, where `open` is 0 too), and each pair ended at its
    # transports' connection_lost
    for _ in range(600):
        if head.relay.accepted >= 200 and head.relay.open == 0:
            break
        await asyncio.sleep(0.05)
    assert (head.relay.accepted, head.relay.open) == (200, 0)  # some refused while 10 were still closing
    for _ in range(3):
        client = ControlClient(f"{LOOPBACK}:{head.port}", timeout_seconds=10.0)
        assert await client.head_status() == "success"
