"""`gym-rpc relay`: one process per node follows the head's status watch once and serves the same watch to the
node's own processes, on a loopback port or a unix socket.

A head holds one gRPC stream per follower process, and grpc.aio's own cost per stream (about 24 KiB and tens of µs
per push on these cores, bench/SCALE.md) is above the fleet's goals at 10,000 followers. With a relay per node the
head holds one stream per node: etcd's gRPC proxy merges identical watches the same way, and Consul's agents answer
from a local cache. The relay's own watches are the head's (gym_rpc.server.service.WatchStream over a WatchFeed):
each push is built and encoded once for every local watcher, debounced, and a slow local watcher gets the latest
state merged. Its state is the head's as its watch told it (`StatusMirror`); it follows several head addresses as
a client does (`a:11000,b:11000`: the next one when the one followed goes away).

Fail static: while the head is down the relay keeps serving what it last knew (heartbeats go on), and its watch
reconnects and resumes by itself. Until its first snapshot it refuses local watches with UNAVAILABLE, so a worker
follows the head directly rather than taking an empty list from a relay that knows nothing yet.

Security: the relay calls the head as any client of the node does (GYM_RPC_TOKEN, GYM_RPC_TLS_CA, ...), and asks
the same token of its local callers when one is set. It listens on loopback or a unix socket only, unless told
otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from gym_rpc._logging import RateLimitedLog
from gym_rpc._tasks import cancel_and_wait
from gym_rpc.client.control import ClientSecurity, ControlClient, StatusWatch, client_security
from gym_rpc.config import parse_host_port, url_host
from gym_rpc.errors import ControlPlaneError, GymRpcError
from gym_rpc.server.fleet import DEFAULT_MAX_DELAY_SECONDS, DEFAULT_QUIET_SECONDS, WatchFeed
from gym_rpc.server.security import (
    DEFAULT_STALL_SECONDS,
    BoundedWrites,
    ServerSecurity,
    WatchSlots,
    bound_to_loopback,
    grpc_connection_bound,
    peer_address,
    server_options,
)
from gym_rpc.server.service import DecodeGuardInterceptor, WatchStream, add_watch_service
from gym_rpc.server.watch_relay._mirror import StatusMirror
from gym_rpc.wire import WATCH_RELAY_ENV_VAR

logger = logging.getLogger("gym_rpc.server.watch_relay")

DEFAULT_RELAY_PORT = 11090
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_RELAY_PORT}"
DEFAULT_MAX_WATCHES = 16_384  # a node's processes: far more than a node runs
# The head's watch: a heartbeat this often, so a head that went away silently is noticed (keepalive does too).
UPSTREAM_HEARTBEAT_SECONDS = 5.0
# A head that refuses the relay (a wrong token, no gym_rpc head there) is asked again this often, never given up:
# the relay keeps serving what it knows meanwhile.
REFUSED_RETRY_SECONDS = 10.0
NOT_SYNCED = "the watch relay at {listen} has not reached the head at {head} yet: follow the head directly"


def checked_listen_address(address: str, *, allow_remote: bool = False) -> str:
    """`unix:PATH`, or HOST:PORT on loopback (any host with `allow_remote`); else a GymRpcError naming the rule."""
    if address.startswith("unix:"):
        if not address[len("unix:") :]:
            raise GymRpcError(f"relay listen address {address!r}: unix: needs a path (unix:/run/gym-rpc.sock)")
        return address
    host, port = parse_host_port(address, f"relay listen address ({WATCH_RELAY_ENV_VAR} takes the same)")
    if not 0 <= port < 65536:
        raise GymRpcError(f"relay listen address {address!r}: the port must be in 0..65535")
    if not allow_remote and not bound_to_loopback(host):
        raise GymRpcError(
            f"relay listen address {address!r} is not on loopback: the relay serves the node's own processes "
            "(127.0.0.1:PORT or unix:PATH; --allow-remote to serve others)"
        )
    return f"{url_host(host)}:{port}"


class WatchRelay:
    """Follows the head's watch (`start`) and serves it at `listen`; `address` is where it listens once started
    (the port chosen when `listen` asked for port 0)."""

    def __init__(
        self,
        head_address: str,
        listen: str = DEFAULT_LISTEN,
        *,
        security: ClientSecurity | None = None,
        allow_remote: bool = False,
        max_watches: int = DEFAULT_MAX_WATCHES,
        watch_stall_seconds: float = DEFAULT_STALL_SECONDS,
        push_quiet_seconds: float = DEFAULT_QUIET_SECONDS,
        push_max_delay_seconds: float = DEFAULT_MAX_DELAY_SECONDS,
    ) -> None:
        self.head_address = head_address
        self.listen = checked_listen_address(listen, allow_remote=allow_remote)
        self.security = security if security is not None else client_security()
        self.mirror = StatusMirror(
            push_quiet_seconds=push_quiet_seconds, push_max_delay_seconds=push_max_delay_seconds
        )
        self.feed = WatchFeed(lambda: self.mirror, lambda: self.mirror.engine_loads)
        self.slots = WatchSlots("relayed watches", max_watches, max_watches, instead="follow the head directly")
        self.writes = BoundedWrites(watch_stall_seconds)
        self.address: str | None = None
        self.upstream_events = 0  # events taken from the head's watch (tests and the scale bench read it)
        self._server: grpc.aio.Server | None = None
        self._follow: asyncio.Task[None] | None = None
        self._refusals = RateLimitedLog(logger)
        self._head_down = False

    @property
    def watches(self) -> int:
        """Local watches open now."""
        return self.slots.open

    async def start(self) -> None:
        """Listen, and follow the head in the background (a head that is down now is waited for)."""
        local = ServerSecurity(token=self.security.token)  # the node's token, asked of local callers too
        server = grpc.aio.server(
            interceptors=[*local.interceptors(), DecodeGuardInterceptor()],
            options=server_options(max_connections=grpc_connection_bound()),
        )
        add_watch_service(self._write_watch, self.feed, server)
        try:
            port = server.add_insecure_port(self.listen)
        except RuntimeError as exc:
            raise GymRpcError(f"the watch relay cannot listen on {self.listen}: {exc}") from exc
        if self.listen.startswith("unix:"):
            self.address = self.listen
            with contextlib.suppress(OSError):  # the node's own user only: the socket carries the head's view
                os.chmod(Path(self.listen[len("unix:") :]), 0o600)
        else:
            self.address = f"{self.listen.rpartition(':')[0]}:{port}"
        await server.start()
        self._server = server
        self._follow = asyncio.create_task(self._follow_head(), name="gym-rpc watch relay")

    async def stop(self, grace_seconds: float = 1.0) -> None:
        """Stop following the head and serving (local watches end; their workers follow the head meanwhile)."""
        await cancel_and_wait(self._follow)
        self._follow = None
        self.mirror.close()
        if self._server is not None:
            await self._server.stop(grace_seconds)
            self._server = None
        if self.listen.startswith("unix:"):
            with contextlib.suppress(OSError):
                os.unlink(self.listen[len("unix:") :])  # one unlink, at stop

    async def _follow_head(self) -> None:
        """The head's watch, folded into the mirror, for as long as the relay runs: reconnects (and, of several
        heads, moves on) by itself; a head that refuses the relay is asked again every REFUSED_RETRY_SECONDS."""
        client = ControlClient(self.head_address, security=self.security)
        watch = StatusWatch(
            client, heartbeat_seconds=UPSTREAM_HEARTBEAT_SECONDS, on_retry=self._retrying, engine_load=True
        )
        while True:
            try:
                async with contextlib.aclosing(watch.events()) as events:
                    async for event in events:
                        self.upstream_events += 1
                        if self._head_down:
                            self._head_down = False
                            logger.info("following the head at %s again", watch.source or self.head_address)
                        self.mirror.apply(event)
            except ControlPlaneError as error:  # not worth the watch's own retries: refused, not a gym_rpc head
                self._refusals.log(
                    f"the head at {self.head_address} refuses the watch relay ({error}); serving what it last "
                    f"knew, asking again every {REFUSED_RETRY_SECONDS:g} s"
                )
                await asyncio.sleep(REFUSED_RETRY_SECONDS)

    def _retrying(self, error: ControlPlaneError, pause: float) -> None:
        if not self._head_down:
            self._head_down = True
            logger.info(
                "cannot follow the head at %s (%s): serving the %d servers last known to %d local watches, "
                "resuming when it is back",
                self.head_address,
                error.code.name,
                len(self.mirror.reports()),
                self.slots.open,
            )

    async def _write_watch(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """One local watch, written as the head writes its own (ControlPlaneServicer.write_watch)."""
        if not self.mirror.synced:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, NOT_SYNCED.format(listen=self.address, head=self.head_address)
            )
        peer = context.peer()
        key = await self.slots.take_or_abort(context, peer_address(peer))
        try:
            await self.writes.write_all(context, WatchStream(self.feed, request).next, peer)
        finally:
            self.slots.release(key)


async def run_relay(relay: WatchRelay, on_started: Callable[[WatchRelay], None]) -> None:
    """Serve until SIGTERM or SIGINT (`gym-rpc relay`)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await relay.start()
    on_started(relay)  # once the handlers are in place: a signal sent right after the banner stops cleanly
    try:
        await stop.wait()
    finally:
        await relay.stop()
