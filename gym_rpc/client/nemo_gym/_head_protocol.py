"""Which protocol the head at an address speaks: gym_rpc's gRPC, or NeMo Gym's HTTP head (an `ng_run` deployment).

Found out once per process and address, by one plaintext connection that sends an HTTP/1.1 `GET /` and reads the
first bytes of the answer: a gRPC server (HTTP/2) writes its SETTINGS frame first, an HTTP/1.1 server answers
`HTTP/1.x ...`. NeMo Gym's head answers `GET /` with `{"status": "ok"}` and logs only its usual access line; a
preface of HTTP/2 would cost it a warning, which is why gRPC is never tried first. The gRPC head closes the
connection without a word. The look may take the call's whole deadline: a head slow to answer (a loaded machine)
is still told apart, where a shorter bound would try a slow NeMo Gym head over gRPC and make it log warnings. A
head that cannot be reached, or answers neither way in time, is not remembered: the call goes on over gRPC with
what is left of its deadline (and fails there as it always did), and the next call asks again. With TLS there is
nothing to find out: NeMo Gym's head serves no TLS.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Literal

from gym_rpc._version import __version__
from gym_rpc.config import parse_host_port

HeadProtocol = Literal["grpc", "nemo_gym_http"]
GRPC: HeadProtocol = "grpc"
NEMO_GYM_HTTP: HeadProtocol = "nemo_gym_http"

# The look's bound for a caller with no deadline of its own (the instance follower): the control plane's default.
DETECT_TIMEOUT_SECONDS = 5.0
_HTTP2_FRAME_HEADER_BYTES = 9
_HTTP2_SETTINGS_FRAME = 0x04
# gRPC target schemes a caller may spell out (`unix:PATH`); anything else must be HOST:PORT.
GRPC_TARGET_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")

_known: dict[str, HeadProtocol] = {}
_looks: dict[str, threading.Lock] = {}  # one per address: a slow look at one head holds up no other
_looks_lock = threading.Lock()


def head_protocol(address: str, *, tls: bool, timeout: float = DETECT_TIMEOUT_SECONDS) -> HeadProtocol:
    """The protocol of the head at `address` (HOST:PORT), found out on the first call and remembered."""
    known = known_head_protocol(address, tls=tls)
    if known is not None:
        return known
    with _looks_lock:
        look = _looks.setdefault(address, threading.Lock())
    with look:  # one look per address, however many threads ask at once
        known = _known.get(address)
        if known is None:
            found = detect(address, timeout)
            if found is None:
                return GRPC
            known = _known[address] = found
    return known


def known_head_protocol(address: str, *, tls: bool) -> HeadProtocol | None:
    """What `head_protocol` would answer without looking (None: it has to look first)."""
    if tls or address.startswith(GRPC_TARGET_SCHEMES):
        return GRPC
    return _known.get(address)


def remembered_head_protocol(address: str) -> HeadProtocol | None:
    """What an earlier look at `address` found, if this process remembers it (never a TLS or scheme default)."""
    return _known.get(address)


def forget_head_protocol(address: str) -> None:
    """Look again next time: the head at `address` went away (another one may start there)."""
    _known.pop(address, None)


def detect(address: str, timeout: float) -> HeadProtocol | None:
    """One look at the head: None when it cannot be reached or its first bytes are neither HTTP/2 nor HTTP/1.x."""
    host, port = parse_host_port(address, "head address")
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as connection:
            request = (
                f"GET / HTTP/1.1\r\nHost: {address}\r\nUser-Agent: gym-rpc/{__version__}\r\n"
                "Accept: application/json\r\nConnection: close\r\n\r\n"
            )
            connection.sendall(request.encode("ascii"))
            first = b""
            while len(first) < _HTTP2_FRAME_HEADER_BYTES:
                connection.settimeout(max(deadline - time.monotonic(), 0.001))
                chunk = connection.recv(4096)
                if not chunk:
                    break
                first += chunk
            protocol = protocol_of_answer(first)
            if protocol == NEMO_GYM_HTTP:
                _read_to_end(connection, deadline)  # let the HTTP head finish its answer before we close
            return protocol
    except (OSError, ValueError):
        return None


def protocol_of_answer(first: bytes) -> HeadProtocol | None:
    """The protocol an answer's first bytes are in: HTTP/1.x (NeMo Gym's head), HTTP/2 (gRPC's), or neither."""
    if first.startswith(b"HTTP/1."):
        return NEMO_GYM_HTTP
    # An HTTP/2 frame header: 3 bytes length, type, flags, 4 bytes stream id; a server's first is SETTINGS on 0.
    if len(first) >= _HTTP2_FRAME_HEADER_BYTES and first[3] == _HTTP2_SETTINGS_FRAME and first[5:9] == b"\0" * 4:
        return GRPC
    return None


def _read_to_end(connection: socket.socket, deadline: float) -> None:
    """Drain a short answer (`Connection: close`: the server ends it), within the look's deadline."""
    received = 0
    try:
        while received < 65536 and (left := deadline - time.monotonic()) > 0:
            connection.settimeout(left)
            chunk = connection.recv(4096)
            if not chunk:
                return
            received += len(chunk)
    except OSError:
        return
