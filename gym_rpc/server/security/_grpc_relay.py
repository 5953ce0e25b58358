"""Connections per client address on the gRPC port (issue 43, point 9b).

grpc accepts its own connections and has no per-address bound, nor a way to be handed a socket accepted
elsewhere: one address opening idle connections takes the port's whole bound and new clients are refused. So on a
head reachable from more than one address, the public port is this accept loop: it counts connections per client
address (every loopback address one client, as for the watch shares), closes one past
`max_connections_per_address` at once, stops accepting at the total bound (further clients wait in the kernel's
backlog) and relays each accepted connection byte for byte to grpc listening on loopback. TLS passes through
untouched: grpc still terminates it (and so still checks client certificates).

grpc then sees every caller as the relay's upstream socket. Those sockets are bound to RELAY_SOURCE, a loopback
address of their own, and `PeerMap` keeps the real caller of each by the peer string grpc reports for it
(`ipv4:127.77.0.1:<port>`: a port is one connection while it is open), so everything that reads a caller's
address (the watch shares, the registration caps, the identity of instances, the address a wildcard server
registers at) reads it through `PeerMap.caller(context)`. A peer from RELAY_SOURCE the map does not know (a local
process that bound that address itself) is a caller of unknown address, never loopback.

Binding RELAY_SOURCE needs the whole 127.0.0.0/8 on the loopback interface (Linux has it; macOS and Windows have
only 127.0.0.1 unless an alias is added): where it cannot be bound, the head serves grpc on the public port as
before and says once that connections are bounded in total only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import Counter
from typing import Any

import grpc

from gym_rpc._logging import RateLimitedLog
from gym_rpc.server.security._connection_limits import accept_within, listening_sockets
from gym_rpc.server.security._watch_slots import client_key, peer_address

logger = logging.getLogger(__name__)

RELAY_SOURCE = "127.77.0.1"  # the relay's upstream sockets come from here (a loopback address of their own)
UPSTREAM_HOST = "127.0.0.1"  # grpc listens here, on a free port, behind the relay
DEFAULT_MAX_CONNECTIONS_PER_ADDRESS = 1024  # a busy node: 256 processes with a channel or two each, far below
DESCRIPTORS_PER_CONNECTION = 3  # the client's socket, the relay's upstream socket, grpc's accepted one
# A connection's entry outlives it this long: a call grpc read before the connection ended still finds its caller.
FORGET_AFTER_SECONDS = 10.0
STOP_SECONDS = 5.0  # stop() waits at most this long for closed connections to end
UNKNOWN_CALLER = "relayed:unknown"  # a peer string no address parses from


def relay_source_available(source: str = RELAY_SOURCE) -> bool:
    """Whether this machine lets a socket bind `source` (Linux routes all of 127.0.0.0/8 to the loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((source, 0))
        except OSError:
            return False
    return True


def per_address_bound(max_per_address: int, max_connections: int) -> int:
    """`max_per_address`, at most a quarter of the total bound (at least 1), so three addresses at their bound
    still leave room for others."""
    return max(1, min(max_per_address, max_connections // 4))


def grpc_peer(address: Any) -> str:
    """A socket address as grpc writes peers: `ipv4:10.0.0.7:5678`, `ipv6:[2001:db8::1]:5678`."""
    host, port = address[0], address[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


class PeerMap:
    """The real caller of each connection the relay made to grpc, by the peer string grpc reports for it."""

    def __init__(self, source: str = RELAY_SOURCE) -> None:
        self.source = source
        self._callers: dict[str, tuple[str, object]] = {}  # upstream peer -> (real peer, the connection)
        self._prefix = f"ipv4:{source}:"

    def caller(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        """The peer string of the client behind this call (grpc's own when it was not relayed)."""
        peer: str = context.peer()
        entry = self._callers.get(peer)
        if entry is not None:
            return entry[0]
        return UNKNOWN_CALLER if peer.startswith(self._prefix) else peer

    def __len__(self) -> int:
        return len(self._callers)

    def add(self, upstream_peer: str, real: str, owner: object) -> None:
        self._callers[upstream_peer] = (real, owner)

    def forget(self, upstream_peer: str, owner: object) -> None:
        """Drop the entry, unless the port already carries another connection's."""
        entry = self._callers.get(upstream_peer)
        if entry is not None and entry[1] is owner:
            del self._callers[upstream_peer]


class GrpcRelay:
    """The public gRPC port: accepts, bounds per client address and in total, relays to grpc on loopback."""

    def __init__(self, peers: PeerMap, *, max_connections: int, max_per_address: int) -> None:
        self.peers = peers
        self.max_connections = max_connections
        self.max_per_address = per_address_bound(max_per_address, max_connections)
        self._slots = asyncio.Semaphore(max_connections)
        self._per_client: Counter[str] = Counter()
        self._listeners: list[socket.socket] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._pairs: set[_Pair] = set()
        self._upstream: tuple[str, int] = (UPSTREAM_HOST, 0)
        self._refusals = RateLimitedLog(logger)
        self._failures = RateLimitedLog(logger)
        self.accepted = 0  # connections taken from the listen backlog, refused ones included
        self.refused = 0  # connections closed for their address's bound
        self._drained: asyncio.Event | None = None  # set when the last pair ends, while stopping

    @property
    def open(self) -> int:
        return len(self._pairs)

    def listen(self, host: str, port: int) -> int:
        """Bind and listen on every address of `host` (the same port on each); the port bound."""
        self._listeners = listening_sockets(host, port, min(socket.SOMAXCONN, 4096))
        return int(self._listeners[0].getsockname()[1])

    def start(self, upstream_port: int) -> None:
        """Relay to grpc on UPSTREAM_HOST:`upstream_port` from now on."""
        self._upstream = (UPSTREAM_HOST, upstream_port)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._accept(sock), name="gym_rpc grpc relay") for sock in self._listeners]

    def close(self) -> None:
        """Stop accepting (connections open stay open)."""
        for task in self._tasks:
            task.cancel()
        for sock in self._listeners:
            sock.close()
        self._listeners = []

    async def stop(self) -> None:
        """Stop accepting and end every relayed connection."""
        self.close()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for pair in list(self._pairs):
            if pair.setup is not None:
                pair.setup.cancel()
            pair.close()
        if self._pairs:  # each ends at its transports' connection_lost, a loop turn or two away
            self._drained = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), STOP_SECONDS)

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            connection, address = await accept_within(
                loop, listener, self._slots, self._failures, "the gRPC port cannot accept a connection"
            )
            self.accepted += 1
            real = grpc_peer(address)
            client = client_key(peer_address(real))
            if self._per_client[client] >= self.max_per_address:
                self._slots.release()
                connection.close()
                self.refused += 1
                self._refusals.log(
                    f"closed a gRPC connection from {peer_address(real)}: that client holds "
                    f"{self._per_client[client]} connections, the most one client address may "
                    f"(--max-connections-per-address)"
                )
                continue
            self._per_client[client] += 1
            pair = _Pair(self, connection, real, client)
            self._pairs.add(pair)
            setup = loop.create_task(pair.connect(self._upstream), name="gym_rpc grpc relay connection")
            pair.setup = setup

    def _ended(self, pair: _Pair) -> None:
        self._pairs.discard(pair)
        self._per_client[pair.client] -= 1
        if self._per_client[pair.client] <= 0:
            del self._per_client[pair.client]
        self._slots.release()
        if not self._pairs and self._drained is not None:
            self._drained.set()


class _Pair:
    """One client connection and its upstream connection to grpc."""

    def __init__(self, relay: GrpcRelay, connection: socket.socket, real: str, client: str) -> None:
        self._relay: GrpcRelay | None = relay
        self._connection: socket.socket | None = connection
        self.real, self.client = real, client
        self.setup: asyncio.Task[None] | None = None
        self.down = _Side(self)
        self.up = _Side(self)
        self.down.other, self.up.other = self.up, self.down
        self._upstream_peer: str | None = None
        self._closing = False

    async def connect(self, upstream: tuple[str, int]) -> None:
        """Open the upstream connection, then take the client's (what grpc sends meanwhile waits in the pair)."""
        loop = asyncio.get_running_loop()
        relay, connection = self._relay, self._connection
        assert relay is not None and connection is not None
        try:
            up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                up.setblocking(False)
                up.bind((relay.peers.source, 0))
                await loop.sock_connect(up, upstream)
            except BaseException:
                up.close()
                raise
            self._upstream_peer = grpc_peer(up.getsockname())
            relay.peers.add(self._upstream_peer, self.real, self)
            await loop.connect_accepted_socket(lambda: self.up, up)
            if self._closing:
                raise ConnectionAbortedError("closed while connecting")
            self._connection = None
            await loop.connect_accepted_socket(lambda: self.down, connection)
            if self._closing:  # grpc ended it meanwhile
                self.close()
        except (OSError, asyncio.CancelledError) as exc:
            if not isinstance(exc, (ConnectionAbortedError, asyncio.CancelledError)):
                relay._failures.log(f"could not relay a gRPC connection to grpc: {exc}")
            self.close()
            if self._connection is not None:  # not handed to a transport yet
                self._connection.close()
                self._connection = None
            self._side_lost()  # a side never made is lost already
            if isinstance(exc, asyncio.CancelledError):
                raise

    def close(self) -> None:
        self._closing = True
        for side in (self.down, self.up):
            if side.transport is not None and not side.transport.is_closing():
                side.transport.close()  # sends what is buffered first

    def _side_lost(self) -> None:
        if any(side.transport is not None and not side.lost for side in (self.down, self.up)):
            return
        relay, self._relay = self._relay, None
        if relay is None:
            return
        if self._upstream_peer is not None:
            loop = asyncio.get_running_loop()
            loop.call_later(FORGET_AFTER_SECONDS, relay.peers.forget, self._upstream_peer, self)
        relay._ended(self)


class _Side(asyncio.Protocol):
    """One side of a pair: what it receives is written to the other side; a full other side pauses its reads."""

    def __init__(self, pair: _Pair) -> None:
        self.pair = pair
        self.other: _Side = self
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._paused = False
        self._pending: list[bytes] = []  # received before the other side was there (grpc's first SETTINGS)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        for data in self.other._pending:
            transport.write(data)
        self.other._pending.clear()

    def data_received(self, data: bytes) -> None:
        other = self.other.transport
        if other is not None:
            other.write(data)
        else:
            self._pending.append(data)

    def eof_received(self) -> bool:
        self.pair.close()
        return False

    def pause_writing(self) -> None:
        self.other.pause_reading()

    def resume_writing(self) -> None:
        self.other.resume_reading()

    def pause_reading(self) -> None:
        if self.transport is not None and not self._paused and not self.transport.is_closing():
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and self._paused and not self.transport.is_closing():
            self._paused = False
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pair.close()
        self.pair._side_lost()
