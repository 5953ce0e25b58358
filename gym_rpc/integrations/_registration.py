"""Register a Gym server with the head while it serves, so clients on other hosts can reach it.

A server bound to a wildcard address (0.0.0.0, ::) appears in the global config under that address, which only
its own host can dial. Registered, it is advertised by the head at the address the registration came from (or
the one it names), and ServerClient dials it there. The helper never stops a server from serving: a head that is
unreachable or refuses the call costs a warning in the log, within a bounded time.

* aiohttp.web: `register_aiohttp_app(app, "policy_model", port=8000)` (an `app.cleanup_ctx` entry).
* ASGI: `app = with_registration(app, "policy_model", port=8000)` (wraps the lifespan protocol).
* anything else: `ServerRegistration(...)` as an async context manager, or its register()/deregister().

The first two drain on SIGTERM (gym_rpc.integrations._draining): the instance is marked draining so clients send
it no new work, its calls in flight finish (within `drain_grace_seconds`), then it deregisters and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, TypedDict

import grpc
from aiohttp import web

from gym_rpc._tasks import cancel_and_wait
from gym_rpc.client import ControlClient, ServerClient, SyncControlClient, client_security, head_address
from gym_rpc.config import BaseServerConfig, parse_head_addresses, parse_host_port
from gym_rpc.errors import ControlPlaneError, GymRpcError
from gym_rpc.integrations._draining import (
    DEFAULT_DRAIN_GRACE_SECONDS,
    InFlight,
    SigtermDrain,
    counting_middleware,
    hand_on_sigterm,
    stop_aiohttp,
    wait_until_drained,
)
from gym_rpc.wire import label_problem

logger = logging.getLogger(__name__)

REGISTRATION_TIMEOUT_SECONDS = 2.0
# A head keeps registrations in memory: re-registering now and then brings a restarted head up to date, and renews
# the registration's lease (LEASE_REFRESHES refresh periods), so a process killed -9 is dropped soon after.
DEFAULT_REFRESH_SECONDS = 10.0
LEASE_REFRESHES = 3
MIN_LEASE_SECONDS = 0.5  # the shortest lease a head grants
# While registered, a process follows each head's health watch (a stream that sends only when the head's own
# status changes): when it breaks and a new one answers, the head restarted or came back, and the process registers
# there again at once instead of at its next renewal. Reconnects back off from 0.2 s to at most this.
HEAD_WATCH_MAX_BACKOFF_SECONDS = 2.0

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def process_start_time() -> float:
    """When this process started (epoch seconds): from /proc on Linux, else the time gym_rpc was imported."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of stat(5), counted after the command name
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


def _head_server(head: BaseServerConfig | str | None) -> BaseServerConfig:
    if isinstance(head, BaseServerConfig):
        return head
    if isinstance(head, str):
        addresses = parse_head_addresses(head, "head address")
        host, port = parse_host_port(addresses[0], "head address")
        if len(addresses) > 1:
            return BaseServerConfig.model_validate({"host": host, "port": port, "addresses": list(addresses)})
        return BaseServerConfig(host=host, port=port)
    return ServerClient.load_head_server_config()  # the injected config, GYM_RPC_HEAD, or the default


class _Registered(TypedDict):
    """What RegisterServerInstance says about this process, besides its server name."""

    listen_port: int
    listen_host: str
    advertise_host: str
    pid: int
    start_time: float
    lease_seconds: float | None
    labels: dict[str, str]
    server_type: str
    draining: bool
    in_flight: int


class ServerRegistration:
    """Registers one server process with the head, keeps it registered, and deregisters it on stop.

    `head`: a BaseServerConfig or "HOST:PORT"; None takes the injected config's head_server, else GYM_RPC_HEAD,
    else 127.0.0.1:11000 (as ServerClient does). `listen_host`: the host the server binds; a wildcard lets the
    head advertise the address it sees the registration come from. `advertise_host`: the host clients should
    dial, when the server knows better (NAT, several interfaces). `refresh_seconds`: how often to register again
    while serving (None: never), so a restarted head learns the address again. `lease_seconds`: how long the head
    keeps the registration without a renewal; None: three refresh periods, at least 0.5 s (the head's default
    lease when not refreshing: 300 s for `gym-rpc head`, where no registration lives forever); 0: the head's
    default lease. A process that dies without deregistering is dropped by the head about that late.

    A server name may have several instances (replicas): each process registers at its own address, and one
    registering where an instance already is replaces it (a restart). `labels` (at most 16 short `key: value`
    pairs, e.g. `{"weights_version": "42"}`) let clients pick among them; `server_type` (e.g.
    "responses_api_models"), when given, must be the config's, or the head refuses the registration.

    `in_flight` counts the calls the process has in flight (the app helpers count requests themselves): renewals
    report it (`gym-rpc status -o json` shows it) and `adrain()` waits for it to reach 0, for at most
    `drain_grace_seconds`. `drain_on_sigterm` (the app helpers' default) drains on SIGTERM before the server stops.
    """

    def __init__(
        self,
        server_name: str,
        port: int,
        *,
        listen_host: str = "0.0.0.0",
        advertise_host: str = "",
        head: BaseServerConfig | str | None = None,
        timeout_seconds: float = REGISTRATION_TIMEOUT_SECONDS,
        refresh_seconds: float | None = DEFAULT_REFRESH_SECONDS,
        lease_seconds: float | None = None,
        labels: Mapping[str, str] | None = None,
        server_type: str = "",
        in_flight: Callable[[], int] | None = None,
        drain_on_sigterm: bool = False,
        drain_grace_seconds: float = DEFAULT_DRAIN_GRACE_SECONDS,
        follow_head: bool = True,
    ) -> None:
        if lease_seconds is None:
            lease_seconds = (
                max(LEASE_REFRESHES * refresh_seconds, MIN_LEASE_SECONDS) if refresh_seconds is not None else 0.0
            )
        if not lease_seconds >= 0:
            raise ValueError(f"lease_seconds must be >= 0 (0: the head's default lease), got {lease_seconds!r}")
        if lease_seconds and refresh_seconds is not None and lease_seconds <= refresh_seconds:
            raise ValueError(
                f"lease_seconds ({lease_seconds:g}) must be longer than refresh_seconds ({refresh_seconds:g}), "
                f"or the lease would run out between renewals"
            )
        problem = label_problem(labels or {})
        if problem is not None:
            raise ValueError(f"{server_name}: {problem}")
        self.server_name = server_name
        self.port = port
        if not drain_grace_seconds >= 0:
            raise ValueError(f"drain_grace_seconds must be >= 0, got {drain_grace_seconds!r}")
        self.labels = dict(labels or {})
        self.server_type = server_type
        self.in_flight: Callable[[], int] = in_flight if in_flight is not None else _none_in_flight
        self.drain_on_sigterm = drain_on_sigterm
        self.drain_grace_seconds = drain_grace_seconds
        self.draining = False  # set by adrain(): renewals then say so
        self.listen_host = listen_host
        self.advertise_host = advertise_host
        self.head = _head_server(head)
        self.timeout_seconds = timeout_seconds
        self.refresh_seconds = refresh_seconds
        self.lease_seconds = lease_seconds or None
        self.pid = os.getpid()
        self.start_time = process_start_time()
        self.advertised_url: str | None = None  # set while registered
        self.instance_id = ""  # the instance the head says this registration holds, once it has answered
        self._refresher: asyncio.Task[None] | None = None
        self.follow_head = follow_head
        self._head_watches: list[asyncio.Task[None]] = []
        self.reregistered = 0  # registrations made because a head was seen to be new (tests read it)
        # Register and deregister never overlap, and a refresh still running in its thread when deregister() is
        # called cannot land after it: a cancelled task does not stop a thread.
        self._lock = threading.Lock()
        self._deregistered = False
        # Every head of the deployment (head_server.addresses, or GYM_RPC_HEAD=a:11000,b:11000): the registration
        # and each renewal go to each one, so every head knows every instance (docs/multi-host.md).
        listed = (self.head.model_extra or {}).get("addresses")
        self.head_addresses: tuple[str, ...] = (
            parse_head_addresses(listed, "head_server.addresses")
            if listed
            else (head_address(self.head.host, self.head.port),)
        )
        self._instance_ids: dict[str, str] = {}  # head address -> the instance id that head answered
        self._missed: set[str] = set()  # of several heads, those the last call did not reach (warned once)

    @property
    def head_address(self) -> str:
        return ",".join(self.head_addresses)

    def _control(self, address: str) -> SyncControlClient:
        return SyncControlClient(
            address, timeout_seconds=self.timeout_seconds, security=client_security(self.head)
        )

    def register(self, *, quiet: bool = False) -> bool:
        """Register now (blocking, bounded); False, warned unless `quiet`, when the head did not take it."""
        with self._lock:
            self._deregistered = False
            return self._register(quiet)

    def _refresh(self, quiet: bool) -> bool:
        """Register again, unless deregister() came first."""
        with self._lock:
            return False if self._deregistered else self._register(quiet)

    def _refresh_at(self, address: str) -> bool:
        """Register again at one head (it is new), unless deregister() came first."""
        with self._lock:
            if self._deregistered:
                return False
            self.reregistered += 1
            return self._register_at(address, False)

    def _where(self) -> _Registered:
        return {
            "listen_port": self.port,
            "listen_host": self.listen_host,
            "advertise_host": self.advertise_host,
            "pid": self.pid,
            "start_time": self.start_time,
            "lease_seconds": self.lease_seconds,
            "labels": self.labels,
            "server_type": self.server_type,
            "draining": self.draining,
            "in_flight": self.in_flight(),
        }

    def _register(self, quiet: bool) -> bool:
        """Register at every head, each within the timeout; True when any took it."""
        if len(self.head_addresses) == 1:
            return self._register_at(self.head_addresses[0], quiet)
        return any(
            _at_every_head(self.head_addresses, lambda at: self._register_at(at, quiet or at in self._missed))
        )

    def _register_at(self, address: str, quiet: bool) -> bool:
        try:
            registered = self._control(address).register_instance(self.server_name, **self._where())
        except GymRpcError as exc:
            self._missed.add(address)
            if not quiet:
                logger.warning(
                    "%s: not registered with the head at %s (%s); serving anyway, but clients on other hosts "
                    "may not find it",
                    self.server_name,
                    address,
                    exc,
                )
            return False
        if address in self._missed and len(self.head_addresses) > 1:
            logger.warning("%s: registered with the head at %s again", self.server_name, address)
        self._missed.discard(address)
        self._instance_ids[address] = registered.instance_id
        if self.advertised_url is None or address == self.head_addresses[0]:
            self.advertised_url, self.instance_id = registered.advertised_url, registered.instance_id
        logger.info(
            "%s: registered with the head at %s as %s", self.server_name, address, registered.advertised_url
        )
        return True

    def deregister(self) -> bool:
        """Tell every head this process stops (blocking, bounded); False when none could be told."""
        with self._lock:
            self._deregistered = True
            self.advertised_url = None
            if len(self.head_addresses) == 1:
                return self._deregister_at(self.head_addresses[0])
            return any(_at_every_head(self.head_addresses, self._deregister_at))

    def _deregister_at(self, address: str) -> bool:
        instance_id = self._instance_ids.get(address, self.instance_id)
        try:
            return self._control(address).deregister_server_instance(
                self.server_name, pid=self.pid, instance_id=instance_id
            )
        except GymRpcError as exc:
            logger.warning("%s: could not deregister from the head at %s (%s)", self.server_name, address, exc)
            return False

    async def aregister(self) -> bool:
        """register() off the event loop, then keep registered every `refresh_seconds` until aderegister()."""
        registered = await asyncio.to_thread(self.register)
        if self.refresh_seconds is not None and self._refresher is None:
            self._refresher = asyncio.create_task(self._keep_registered(self.refresh_seconds))
        if self.follow_head and not self._head_watches:
            self._head_watches = [asyncio.create_task(self._follow_head(at)) for at in self.head_addresses]
        return registered

    async def _stop_following(self) -> None:
        await cancel_and_wait(self._refresher)
        self._refresher = None
        watches, self._head_watches = self._head_watches, []
        for watch in watches:
            await cancel_and_wait(watch)

    async def _follow_head(self, address: str) -> None:
        """Register at `address` again whenever a health watch of it answers after the last one broke (or before
        the head ever took this registration); ends on an error not worth waiting out (a head without the health
        service, one that refuses the watch), leaving it to the renewals."""
        client = ControlClient(address, security=client_security(self.head))
        fresh = address in self._missed  # the head did not take the registration: register as soon as it answers
        failures = 0
        while True:
            try:
                async with contextlib.aclosing(client.watch_head_health()) as statuses:
                    async for _ in statuses:
                        failures = 0
                        if fresh:
                            fresh = False
                            logger.info("%s: the head at %s is new (restarted or back)", self.server_name, address)
                            await asyncio.to_thread(self._refresh_at, address)
            except ControlPlaneError as error:
                if error.code != grpc.StatusCode.UNAVAILABLE:
                    logger.info(
                        "%s: not following the head at %s (%s); a restart of it is learned at the next renewal",
                        self.server_name,
                        address,
                        error.code.name,
                    )
                    return
            fresh = True
            failures += 1
            await asyncio.sleep(min(HEAD_WATCH_MAX_BACKOFF_SECONDS, 0.1 * 2**failures))

    async def aderegister(self) -> bool:
        await self._stop_following()
        if self.draining and self._deregistered:
            return False  # a drain deregistered already
        return await asyncio.to_thread(self.deregister)

    async def adrain(self, hurry: asyncio.Event | None = None) -> bool:
        """Stop getting new work, finish what is in flight, leave: register again as draining (clients learn it
        from the head's watch), wait until no call is in flight (at least DRAIN_SETTLE_SECONDS, at most
        `drain_grace_seconds`, less once `hurry` is set), then deregister. True when the head was told."""
        self.draining = True
        logger.info(
            "%s: draining, %d calls in flight; deregistering once they finish (within %gs)",
            self.server_name,
            self.in_flight(),
            self.drain_grace_seconds,
        )
        await asyncio.to_thread(self._refresh, False)
        left = await wait_until_drained(self.in_flight, self.drain_grace_seconds, hurry or asyncio.Event())
        if left:
            logger.warning("%s: deregistering with %d calls still in flight", self.server_name, left)
        await self._stop_following()
        return await asyncio.to_thread(self.deregister)

    async def _keep_registered(self, interval: float) -> None:
        registered = self.advertised_url is not None
        while True:
            await asyncio.sleep(interval)
            now_registered = await asyncio.to_thread(self._refresh, not registered)
            if now_registered and not registered:
                logger.warning("%s: registered with the head at %s again", self.server_name, self.head_address)
            registered = now_registered

    async def __aenter__(self) -> ServerRegistration:
        await self.aregister()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aderegister()

    async def aiohttp_cleanup_ctx(self, app: web.Application) -> AsyncIterator[None]:
        """For `app.cleanup_ctx`: registered from startup to cleanup (and drained on SIGTERM, when asked)."""
        await self.aregister()
        drain = SigtermDrain(self.adrain, stop_aiohttp)
        if self.drain_on_sigterm:
            drain.install()
        yield
        drain.uninstall()
        await self.aderegister()

    def asgi(self, app: ASGIApp) -> ASGIApp:
        """`app` with this registration tied to its lifespan."""
        return RegistrationLifespan(app, self)


def register_aiohttp_app(
    app: web.Application, server_name: str, port: int, *, drain_on_sigterm: bool = True, **options: Any
) -> ServerRegistration:
    """Register the aiohttp app's server with the head on startup and deregister it on cleanup; on SIGTERM,
    drain first (web.run_app's own stop follows). The app counts its requests in flight (a middleware, first)."""
    in_flight = InFlight()
    app.middlewares.insert(0, counting_middleware(in_flight))
    registration = ServerRegistration(
        server_name, port, in_flight=in_flight, drain_on_sigterm=drain_on_sigterm, **options
    )
    app.cleanup_ctx.append(registration.aiohttp_cleanup_ctx)
    return registration


def with_registration(
    app: ASGIApp, server_name: str, port: int, *, drain_on_sigterm: bool = True, **options: Any
) -> ASGIApp:
    """An ASGI app that registers with the head at lifespan startup and deregisters at shutdown; on SIGTERM, it
    drains first, then hands SIGTERM to the server's own handler (uvicorn's: its graceful stop)."""
    return ServerRegistration(server_name, port, drain_on_sigterm=drain_on_sigterm, **options).asgi(app)


def _at_every_head(addresses: tuple[str, ...], call: Callable[[str], bool]) -> list[bool]:
    """`call` made for every head at once, one thread each: a head that hangs delays none of the others."""
    with ThreadPoolExecutor(len(addresses), thread_name_prefix="gym-rpc registration") as pool:
        return list(pool.map(call, addresses))


def _none_in_flight() -> int:
    return 0


class RegistrationLifespan:
    """ASGI wrapper: registers once the app has started and deregisters when shutdown begins. An app that does
    not speak the lifespan protocol (raises or returns on a lifespan scope) gets it spoken for it."""

    def __init__(self, app: ASGIApp, registration: ServerRegistration) -> None:
        self.app = app
        self.registration = registration
        self.in_flight = InFlight()
        if registration.in_flight is _none_in_flight:
            registration.in_flight = self.in_flight
        self._drain = SigtermDrain(registration.adrain, hand_on_sigterm)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            with self.in_flight.call():
                await self.app(scope, receive, send)
            return
        await self._lifespan(scope, receive, send)

    async def _started(self) -> None:
        await self.registration.aregister()
        if self.registration.drain_on_sigterm:
            self._drain.install()

    async def _stopping(self) -> None:
        self._drain.uninstall()
        await self.registration.aderegister()

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        seen: set[str] = set()  # lifespan message types received from the server or sent by the app

        async def app_receive() -> Message:
            message = await receive()
            seen.add(message["type"])
            if message["type"] == "lifespan.shutdown":
                await self._stopping()
            return message

        async def app_send(message: Message) -> None:
            seen.add(message["type"])
            if message["type"] == "lifespan.startup.complete":
                await self._started()
            await send(message)

        try:
            await self.app(scope, app_receive, app_send)
        except Exception:
            if seen & {"lifespan.startup.complete", "lifespan.startup.failed"}:
                raise  # the app speaks lifespan and failed: not ours to hide
            await self._speak_lifespan(receive, send, startup_received="lifespan.startup" in seen)
            return
        if "lifespan.startup.complete" not in seen and "lifespan.startup.failed" not in seen:
            await self._speak_lifespan(receive, send, startup_received="lifespan.startup" in seen)

    async def _speak_lifespan(self, receive: Receive, send: Send, *, startup_received: bool) -> None:
        """The lifespan protocol for an app that has none: register at startup, deregister at shutdown."""
        if not startup_received:
            await receive()  # lifespan.startup
        await self._started()
        await send({"type": "lifespan.startup.complete"})
        while (await receive())["type"] != "lifespan.shutdown":
            pass
        await self._stopping()
        await send({"type": "lifespan.shutdown.complete"})
