"""One HTTP/1.1 GET with a total deadline and a size bound, on the standard library (http.client).

http.client's `timeout` bounds each socket operation, not the request: a server that drips a byte now and then
(its status line, its headers or its body) keeps a GET going for as long as it likes, and `read()` reads a body
of any size into memory. Here every read of the connection is given only what is left of one deadline, and at most
`max_body` bytes of the body are read (http.client itself bounds the status line and headers: 100 lines of at most
64 KiB). What NeMo Gym's head and its servers are asked by a client (the config, `/server_instances`, the direct
status probes) goes through this, so `gym-rpc status --timeout 3` ends at its deadline whatever answers.
"""

from __future__ import annotations

import http.client
import io
import socket
import time
from dataclasses import dataclass

from gym_rpc._version import __version__

USER_AGENT = f"gym-rpc/{__version__}"


@dataclass(frozen=True)
class Answer:
    """What a GET got: the status code, and the body's first `max_body` bytes (`whole`: nothing more came)."""

    status: int
    body: bytes
    whole: bool


def bounded_get(
    host: str, port: int | None, path: str, *, timeout: float, max_body: int, accept: str | None = None
) -> Answer:
    """GET `path` from `host:port` within `timeout` seconds in all (connecting, sending, every read): TimeoutError
    when it passes, OSError or http.client.HTTPException when the connection or the answer fails."""
    deadline = time.monotonic() + max(timeout, 0.001)
    headers = {"User-Agent": USER_AGENT, **({"Accept": accept} if accept else {})}
    connection = _Connection(host, port, deadline)
    try:
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        body = response.read(max_body + 1)
    finally:
        connection.close()
    return Answer(response.status, body[:max_body], len(body) <= max_body)


class _Connection(http.client.HTTPConnection):
    """An HTTPConnection whose socket reads and writes all end at one deadline (time.monotonic())."""

    def __init__(self, host: str, port: int | None, deadline: float) -> None:
        super().__init__(host, port, timeout=max(deadline - time.monotonic(), 0.001))
        self._deadline = deadline

    def connect(self) -> None:
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self._deadline)


class _DeadlineSocket:
    """The part of a socket that http.client uses (sendall, makefile, close), each operation given what is left of
    the deadline; a read or write begun after it raises TimeoutError."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def left(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        self._sock.settimeout(left)
        return left

    def sendall(self, data: bytes) -> None:
        self.left()
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: object, **kwargs: object) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self))

    def recv_into(self, buffer: memoryview) -> int:
        self.left()
        return self._sock.recv_into(buffer)

    def close(self) -> None:
        self._sock.close()


class _DeadlineReader(io.RawIOBase):
    """The socket's incoming bytes as a file, each read within the deadline."""

    def __init__(self, sock: _DeadlineSocket) -> None:
        super().__init__()
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        return self._sock.recv_into(buffer)
