"""Loopback addresses and ports for tests: the address every test server binds, and ports held closed.

A "closed" port bound and released at once could be handed to the next `bind(port 0)` (the head under test
included), so `closed_port` keeps the socket bound, never listening, until the test (or module) that took it ends:
tests/conftest.py's autouse fixtures call `release_ports_held_since`.
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"

_held_ports: list[socket.socket] = []


def closed_port(host: str = LOOPBACK) -> int:
    """A loopback port that stays closed for the whole test: a socket bound to it, never listening.

    Connecting to it is refused at once, and no `bind(port 0)` anywhere on the machine (the head under test
    included) can be given it while it is held, as could happen to a port bound and released at once. The socket
    has SO_REUSEADDR, so a test may still start a server on this very port on purpose (a head "coming back") and
    keep the port through a stop and restart. Each socket is closed when the test (or the module, for a
    module-scoped fixture) that took it ends.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    _held_ports.append(sock)
    return int(sock.getsockname()[1])


def ports_held() -> int:
    """A mark for `release_ports_held_since`: how many closed ports are held now."""
    return len(_held_ports)


def release_ports_held_since(mark: int) -> None:
    """Close the ports taken after `mark` (newest first)."""
    while len(_held_ports) > mark:
        _held_ports.pop().close()


def tcp_keepalive_options(sock: socket.socket) -> list[int]:
    """A socket's SO_KEEPALIVE, TCP_KEEPIDLE, TCP_KEEPINTVL and TCP_KEEPCNT (Linux)."""
    return [
        sock.getsockopt(level, option)
        for level, option in (
            (socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            (socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
        )
    ]
