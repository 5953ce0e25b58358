"""The control-plane server (`gym-rpc head`, and `gym-rpc bridge` with another config source): the service,
standard health, reflection, the background prober, and the sequences that start and stop them."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gym_rpc._tasks import cancel_and_wait
from gym_rpc._telemetry_switches import TELEMETRY_KEY
from gym_rpc.config import (
    GlobalConfig,
    ServerEntry,
    checked_port,
    checked_probe_interval,
    checked_seconds,
    url_host,
)
from gym_rpc.errors import ConfigError, GymRpcError
from gym_rpc.metrics import metrics_disabled, setup_metrics
from gym_rpc.server._sources import ConfigSource, FileSource
from gym_rpc.server.fleet import (
    DEFAULT_MAX_DELAY_SECONDS,
    DEFAULT_QUIET_SECONDS,
    MAX_PUSH_DELAY_SECONDS,
    EngineLoads,
    StatusProber,
    engine_targets,
    serves,
)
from gym_rpc.server.fleet import events as events
from gym_rpc.server.http import ConnectServer, HttpHead, PageServer, StatusPage
from gym_rpc.server.observability import MetricsServer, server_interceptors
from gym_rpc.server.observability import head_metrics as head_metrics
from gym_rpc.server.registry import InstanceRegistry, RegistrationLimits
from gym_rpc.server.registry import registrations_file as registrations_file
from gym_rpc.server.security import (
    CONNECTION_IDLE_SECONDS,
    DEFAULT_MAX_CONCURRENT_WATCHES,
    DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
    DEFAULT_MAX_GRPC_CONNECTIONS,
    DEFAULT_MAX_WATCHES_PER_PEER,
    DEFAULT_STALL_SECONDS,
    DESCRIPTORS_PER_CONNECTION,
    HANDSHAKE_TIMEOUT_SECONDS,
    UPSTREAM_HOST,
    AddressPolicy,
    GrpcRelay,
    PeerMap,
    ServerSecurity,
    bound_to_loopback,
    build_health_server,
    grpc_connection_bound,
    raise_fd_soft_limit,
    relay_source_available,
    server_options,
)
from gym_rpc.server.service import (
    ControlPlaneServicer,
    DecodeGuardInterceptor,
    HealthServicer,
    add_control_plane_service,
)
from gym_rpc.telemetry import setup_tracing
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import ReportedProcess, StatusReport

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ControlPlaneService"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_UNKNOWN = health_pb2.HealthCheckResponse.UNKNOWN
_SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


@dataclass(frozen=True)
class HeadOptions:
    """How the head runs; the config file says what it serves."""

    host: str | None = None  # None: the config's head_server.host
    port: int | None = None  # None: the config's head_server.port; 0: a free port
    probe_interval_seconds: float = 2.0
    probe_timeout_seconds: float = 1.0
    reflection: bool = True
    watch_history_size: int = 1024  # status changes a watch can resume across
    shutdown_grace_seconds: float = 0.5
    http_port: int | None = None  # NeMo Gym's HTTP head; None: head_server.http_port (absent: none); 0: free port
    connect_port: int | None = None  # the Connect protocol; None: head_server.connect_port (absent: none); 0: free
    max_concurrent_watches: int = DEFAULT_MAX_CONCURRENT_WATCHES  # more get RESOURCE_EXHAUSTED
    max_watches_per_peer: int = DEFAULT_MAX_WATCHES_PER_PEER  # per client IP address; more get RESOURCE_EXHAUSTED
    metrics_port: int | None = None  # GET /metrics alone on this port; None: only on the HTTP head (if any)
    ui_port: int | None = None  # the status page alone on this port; None: only on the HTTP head (if any)
    status_max_age_seconds: float | None = None  # GetServerStatus freshness when unstated; None: half the interval
    handshake_timeout_seconds: float = HANDSHAKE_TIMEOUT_SECONDS  # a gRPC connection not set up by then is closed
    # A status or health watch whose reader takes no message for this long is dropped (its slot freed).
    watch_stall_seconds: float = DEFAULT_STALL_SECONDS
    # gRPC connections at once (fewer when the descriptor limit is low: grpc_connection_bound); more are closed.
    max_connections: int = DEFAULT_MAX_GRPC_CONNECTIONS
    connection_idle_seconds: float = CONNECTION_IDLE_SECONDS  # a gRPC connection without a call this long closes
    # gRPC connections from one client address at once (every loopback address one client), at most a quarter of
    # max_connections; more are closed at once. Enforced by the relay (gym_rpc.server._grpc_relay).
    max_connections_per_address: int = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS
    # The relay in front of grpc that bounds connections per address: None (the default) runs it when the head is
    # bound beyond loopback and the system allows (Linux), True insists on it, False never runs it.
    connection_relay: bool | None = None
    # Instances exported one by one in gym.instance.* metrics (0, the default: none, so metrics name no address);
    # past it they are counted, not named.
    instance_series: int = head_metrics.DEFAULT_INSTANCE_SERIES
    # Accept registrations without a token on a head bound beyond loopback (--open-registrations): off, such a
    # head refuses RegisterServerInstance and DeregisterServerInstance (SECURITY.md, "No open head").
    open_registrations: bool = False
    # Status changes are pushed to watchers once nothing changed for this long, and never held longer than the max
    # (gym_rpc.server.fleet._pushes): a storm of changes reaches each watcher as a few merged messages.
    push_quiet_seconds: float = DEFAULT_QUIET_SECONDS
    # Registrations survive a restart: kept in `<config>.registrations.json` beside a config file (none without
    # one) and taken back at start (gym_rpc.server.registry.registrations_file).
    keep_registrations: bool = True
    push_max_delay_seconds: float = DEFAULT_MAX_DELAY_SECONDS

    def __post_init__(self) -> None:
        """Refuse what would spin (a 0 interval), never end (nan, inf) or bind another port (70000 wraps)."""
        checked_probe_interval(self.probe_interval_seconds)
        checked_seconds(self.probe_timeout_seconds, "the probe timeout (--probe-timeout)")
        checked_seconds(self.handshake_timeout_seconds, "HeadOptions.handshake_timeout_seconds")
        checked_seconds(self.watch_stall_seconds, "HeadOptions.watch_stall_seconds")
        checked_seconds(self.connection_idle_seconds, "HeadOptions.connection_idle_seconds")
        for seconds, name in ((self.push_quiet_seconds, "quiet"), (self.push_max_delay_seconds, "max_delay")):
            if not 0 <= seconds <= MAX_PUSH_DELAY_SECONDS:
                raise ConfigError(
                    f"HeadOptions.push_{name}_seconds must be between 0 and {MAX_PUSH_DELAY_SECONDS:g} s, "
                    f"got {seconds}"
                )
        checked_port(self.port, "the head port (--port)")
        checked_port(self.http_port, "the HTTP head port (--http-port)")
        checked_port(self.metrics_port, "the metrics port (--metrics-port)")
        checked_port(self.ui_port, "the status page port (--ui-port)")
        if min(self.watch_history_size, self.max_concurrent_watches, self.max_watches_per_peer) < 1:
            raise ConfigError(
                "watch_history_size, max_concurrent_watches and max_watches_per_peer must be at least 1"
            )
        if not 0 <= self.instance_series <= head_metrics.MAX_INSTANCE_SERIES:
            raise ConfigError(
                f"instance_series (--instance-series) must be between 0 (no per-instance metrics) and "
                f"{head_metrics.MAX_INSTANCE_SERIES}"
            )
        if self.max_connections < 1 or self.max_connections_per_address < 1:
            raise ConfigError("max_connections and max_connections_per_address must be at least 1")


class HeadServer:
    """The one control-plane server: a grpc.aio server with the service, standard health, reflection, the prober,
    and optionally NeMo Gym's HTTP head and a plaintext health port. Start with `start()`, end with `stop()`.

    `config` is what it serves first and where its own `head_server` block (bind address, token, TLS, health port,
    HTTP port) comes from; `source` is where later configs come from: the file (`gym-rpc head`, the default) or an
    upstream NeMo Gym head (`gym-rpc bridge`, gym_rpc.server._bridge). Both get every serving feature alike.
    """

    def __init__(
        self,
        config: GlobalConfig,
        options: HeadOptions = HeadOptions(),
        config_path: Path | None = None,
        *,
        source: ConfigSource | None = None,
        service_name: str = "gym-rpc-head",
    ):
        self.config = config
        self.options = options
        self.source: ConfigSource = source if source is not None else FileSource(config_path)
        self._own_config = config  # the head_server block it serves with, whatever the source says later
        self._service_name = service_name
        self.pid = os.getpid()
        self.start_time = time.time()
        self.port = 0
        self.peers = PeerMap()  # the real caller of each connection the relay makes to grpc
        self.relay: GrpcRelay | None = None  # the per-address bound in front of grpc, when it runs
        # Health watches are open to everyone (no token): capped per client and in total as status watches are,
        # in a pool of their own.
        self._health = HealthServicer(
            max_watches=options.max_concurrent_watches,
            max_watches_per_peer=options.max_watches_per_peer,
            stall_seconds=options.watch_stall_seconds,
            peers=self.peers,
        )
        self.prober = StatusProber(
            config.servers,
            interval_seconds=options.probe_interval_seconds,
            probe_timeout_seconds=options.probe_timeout_seconds,
            history_size=options.watch_history_size,
            on_change=self._follow_health,
            default_max_age_seconds=options.status_max_age_seconds,
            push_quiet_seconds=options.push_quiet_seconds,
            push_max_delay_seconds=options.push_max_delay_seconds,
        )
        self.registry = InstanceRegistry(lambda: self.config.servers)  # RegisterServerInstance's instances
        # The engines' load from their /metrics (entries with session_affinity_header; none: nothing is read).
        self.engine_loads = EngineLoads(lambda: engine_targets(self.config.servers, self._report_or_none))
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None  # plaintext health only (head_server.health_port)
        self.health_port: int | None = None
        self.security = ServerSecurity()
        self._http_head: HttpHead | None = None
        self.status_page: StatusPage | None = None  # /ui/ on the HTTP head's port and/or --ui-port, when served
        self._page_server: PageServer | None = None  # the page alone on --ui-port
        self.problem: str | None = None  # why ControlPlaneService calls are refused now (a source's upstream)
        self._connect: ConnectServer | None = None
        self._metrics_server: MetricsServer | None = None
        self._servicer: ControlPlaneServicer | None = None
        self._registrations_file: registrations_file.RegistrationsFile | None = None
        self._running_reload: asyncio.Task[bool] | None = None
        self._next_reload: asyncio.Task[bool] | None = None  # shared by every caller arriving while one runs
        self.registrations_off: str | None = None  # why registrations are refused (an open head), None: taken

    @property
    def config_path(self) -> Path | None:
        """The config file a file-fed head reloads (None: the embedded config, or another source)."""
        return self.source.path if isinstance(self.source, FileSource) else None

    @property
    def processes(self) -> Mapping[str, ReportedProcess]:
        return self.source.processes

    @property
    def host(self) -> str:
        return self.options.host if self.options.host is not None else self._own_config.head_server.host

    @property
    def address(self) -> str:
        """host:port the head listens on (IPv6 bracketed)."""
        return f"{url_host(self.host)}:{self.port}"

    @property
    def http_port(self) -> int | None:
        """The port of NeMo Gym's HTTP endpoints, None when not served."""
        return self._http_head.port if self._http_head is not None else None

    @property
    def connect_url(self) -> str | None:
        """Where the Connect protocol is served (http:// or https://), None when it is not."""
        if self._connect is None:
            return None
        return f"{self._connect.scheme}://{url_host(self.host)}:{self._connect.port}"

    @property
    def ui_port(self) -> int | None:
        """The port serving only the status page (--ui-port), None when not served."""
        return self._page_server.port if self._page_server is not None else None

    @property
    def metrics_port(self) -> int | None:
        """The port serving only GET /metrics (--metrics-port), None when not served."""
        return self._metrics_server.port if self._metrics_server is not None else None

    @property
    def ready(self) -> bool:
        """Serving what it knows: started, its config source answering, its first probe round done (readiness
        endpoints answer 503 before)."""
        return self._server is not None and self.problem is None and self.prober.rounds > 0

    # What the head's gauges read (gym_rpc.server.observability.head_metrics.ObservedHead).
    @property
    def observed_servers(self) -> Mapping[str, ServerEntry]:
        return self.config.servers

    def _report_or_none(self, name: str) -> StatusReport | None:
        """The prober's report of `name`, None for a server it does not know (yet: a reload in progress)."""
        try:
            return self.prober.report(name)
        except KeyError:
            return None

    @property
    def observed_prober(self) -> StatusProber:
        return self.prober

    @property
    def observed_watchers(self) -> int:
        return self._servicer.watches if self._servicer is not None else 0

    @property
    def observed_registrations(self) -> int:
        return len(self.registry)

    @property
    def observed_instance_series(self) -> int:
        return self.options.instance_series

    def observed_in_flight(self, server_name: str) -> Mapping[str, int]:
        return self.registry.in_flight(server_name)

    def served(self, config: GlobalConfig) -> GlobalConfig:
        """`config` as this server serves it: its head_server block says where this server listens."""
        return config.with_head_server(self.host, self.port)

    async def start(self) -> None:
        self.source.check(self._own_config)
        self.security = security = ServerSecurity.from_config(self._own_config)
        own = self._own_config.head_settings
        http_port = self.options.http_port if self.options.http_port is not None else own.http_port
        connect_port = self.options.connect_port if self.options.connect_port is not None else own.connect_port
        telemetry_block = self.config.document.get(TELEMETRY_KEY)  # NeMo Gym's switches (gym_rpc.telemetry)
        setup_tracing(
            self.config.observability_enabled, service_name=self._service_name, telemetry_block=telemetry_block
        )
        setup_metrics(service_name=self._service_name, prometheus=True, telemetry_block=telemetry_block)
        self.registry.limits = RegistrationLimits(own.registration)
        self.registrations_off = registration_refusal(self.host, security, self.options.open_registrations)
        if self.registrations_off is not None:
            logger.warning("%s", self.registrations_off)
        self._servicer = servicer = ControlPlaneServicer(
            self,
            registrations_off=self.registrations_off,
            max_concurrent_watches=self.options.max_concurrent_watches,
            max_watches_per_peer=self.options.max_watches_per_peer,
            address_policy=AddressPolicy(own.registration.allowed_networks),
            watch_stall_seconds=self.options.watch_stall_seconds,
            peers=self.peers,
        )
        relay = self._relay_wanted()
        per_connection = DESCRIPTORS_PER_CONNECTION if relay else 1
        max_connections = grpc_connection_bound(self.options.max_connections, per_connection)
        server = build_control_server(
            servicer,
            self._health,
            reflection_enabled=self.options.reflection,
            interceptors=self.source.interceptors(),
            security=security,
            options=server_options(
                max_connections=max_connections,
                handshake_timeout_seconds=self.options.handshake_timeout_seconds,
                connection_idle_seconds=self.options.connection_idle_seconds,
            ),
        )
        port = self.options.port if self.options.port is not None else self._own_config.head_server.port
        refuse_busy_port(self.host, port, "--port or head_server.port")
        if relay:
            self.relay = GrpcRelay(
                self.peers,
                max_connections=max_connections,
                max_per_address=self.options.max_connections_per_address,
            )
            try:
                self.port = self.relay.listen(self.host.strip("[]"), port)
            except OSError as exc:
                self.relay = None
                raise GymRpcError(f"cannot listen on {url_host(self.host)}:{port}: {exc.strerror or exc}") from exc
            upstream_port = security.add_port(server, UPSTREAM_HOST, 0)
        else:
            self.port = security.add_port(server, self.host, port)
        health_server = None
        if security.health_port is not None:  # bound before anything starts: a busy port starts nothing
            refuse_busy_port(self.host, security.health_port, "head_server.health_port")
            health_server = build_health_server(self._health)
            self.health_port = ServerSecurity().add_port(health_server, self.host, security.health_port)
        await self._restore_registrations()  # before the prober starts: its first round probes them too
        await self.prober.start()  # before the first call can arrive: handlers read its reports
        await self.engine_loads.start()
        self.registry.start_expiry(self.prober)
        await server.start()
        self._server = server
        if self.relay is not None:
            self.relay.start(upstream_port)
        if health_server is not None:
            await health_server.start()
            self._health_server = health_server
        self.config = self.served(self.config)
        self.prober.set_config_version(self.config.version)
        await self._set_serving(self.problem is None)
        try:
            await self.source.start(self)
            if http_port is not None or self.options.ui_port is not None:
                self.status_page = self._status_page(security)
                await self.status_page.start()
            if http_port is not None:
                http_head = HttpHead(self, self.status_page)
                await http_head.start(self.host, http_port)
                self._http_head = http_head
            if connect_port is not None:  # the same servicer and security as the gRPC port, over Connect
                connect = ConnectServer(
                    servicer, security, shutdown_grace_seconds=self.options.shutdown_grace_seconds
                )
                await connect.start(self.host, connect_port)
                self._connect = connect
            if self.options.metrics_port is not None:
                metrics_server = MetricsServer()
                await metrics_server.start(self.host, self.options.metrics_port)
                self._metrics_server = metrics_server
            if self.options.ui_port is not None and self.status_page is not None:
                page_server = PageServer(self.status_page)
                await page_server.start(self.host, self.options.ui_port)
                self._page_server = page_server
        except BaseException:
            await self.stop()  # a head that cannot serve all it was asked to serves nothing
            raise
        head_metrics.observe(self)

    def _relay_wanted(self) -> bool:
        """Whether the gRPC port is served through the per-address relay (HeadOptions.connection_relay)."""
        wanted = self.options.connection_relay
        if wanted is False or (wanted is None and bound_to_loopback(self.host)):
            return False  # on loopback every caller is one client: the total bound is the per-address one
        if relay_source_available():
            return True
        if wanted:
            raise GymRpcError(
                "HeadOptions.connection_relay needs 127.77.0.1 on the loopback interface (Linux has all of "
                "127.0.0.0/8 there; elsewhere add that alias), or connection_relay=None"
            )
        logger.warning(
            "gRPC connections are bounded in total only: the per-address bound needs 127.77.0.1 on the loopback "
            "interface (add that alias to bound them per client address)"
        )
        return False

    def _status_page(self, security: ServerSecurity) -> StatusPage:
        """The page at /ui/ (the HTTP head's port, --ui-port): guarded by the head's token, bounded as its watches
        are, showing the engines' load the head reads."""
        return StatusPage(
            self,
            token=security.token,
            stall_seconds=self.options.watch_stall_seconds,
            engine_loads=self.engine_loads.loads,
            head_info=lambda: {
                "address": self.address,
                "pid": self.pid,
                "started": round(self.start_time, 3),
                "probe_interval": self.options.probe_interval_seconds,
            },
        )

    async def stop(self) -> None:
        """Report NOT_SERVING, stop the source, then finish in-flight calls within the grace period."""
        head_metrics.forget(self)
        await self._health.enter_graceful_shutdown()
        for reload in (self._next_reload, self._running_reload):  # one waiting for a file to hold still, say
            await cancel_and_wait(reload)
        await self.source.stop()
        if self.status_page is not None:
            await self.status_page.stop()  # first: the HTTP ports wait for the page streams they still serve
        extra_ports: tuple[_Stoppable | None, ...] = (
            self._connect,
            self._metrics_server,
            self._http_head,
            self._page_server,
        )
        for extra in extra_ports:
            if extra is not None:
                await extra.stop()
        self._connect = self._metrics_server = self._http_head = self._page_server = None
        if self.relay is not None:
            self.relay.close()  # no new connections; open ones finish their calls within the grace
        if self._server is not None:
            await self._server.stop(self.options.shutdown_grace_seconds)
            self._server = None
        if self.relay is not None:
            await self.relay.stop()
            self.relay = None
        await self.registry.stop_expiry()
        await self.engine_loads.stop()
        if self._registrations_file is not None:
            await self._registrations_file.stop()
            self._registrations_file = None
        await self.prober.stop()  # after the last call: in-flight handlers still read and probe through it
        if self._health_server is not None:
            await self._health_server.stop(None)
            self._health_server = None

    @property
    def registrations_path(self) -> Path | None:
        """Where registrations are kept across restarts (None: not kept: no config file, or turned off)."""
        path = self.config_path
        return registrations_file.beside(path) if path is not None and self.options.keep_registrations else None

    async def _restore_registrations(self) -> None:
        """Take back what the head before this one kept, and keep what changes from now on."""
        path = self.registrations_path
        if path is None:
            return
        restored = self.registry.restore(registrations_file.read(path))
        if restored:
            logger.info("took back %d registrations kept in %s (each with a fresh lease)", restored, path)
            await self.registry.update_prober(self.prober)
        self._registrations_file = registrations_file.RegistrationsFile(path, self.registry.entries)
        self.registry.on_change = self._registrations_file.changed
        self._registrations_file.start()

    async def reload(self) -> bool:
        """Load the config from the source now (SIGHUP, ReloadGlobalConfig); True when it changed. A bad config
        keeps the old one.

        Reloads coalesce: at most one runs at a time, and every caller arriving meanwhile shares the one that runs
        next (so each caller's reload starts after it asked, and a thousand callers cost two reloads)."""
        if self._next_reload is None:
            self._next_reload = asyncio.create_task(
                self._reload_after(self._running_reload), name="gym_rpc reload"
            )
            self._next_reload.add_done_callback(_retrieve_outcome)
        return await asyncio.shield(self._next_reload)

    async def _reload_after(self, previous: asyncio.Task[bool] | None) -> bool:
        if previous is not None:
            await asyncio.wait((previous,))  # its outcome is its own callers'
        self._running_reload, self._next_reload = asyncio.current_task(), None
        try:
            return await self._reload_now()
        finally:
            self._running_reload = None

    async def _reload_now(self) -> bool:
        version = self.config.version
        try:
            changed = await self.source.reload(self)
        except ConfigError as exc:
            events.config_refused(self.source.name, version, exc)
            raise
        if not changed:
            events.config_unchanged(self.source.name, version)
        return changed

    async def apply_config(self, config: GlobalConfig) -> bool:
        """Serve `config` from now on (the prober follows it); False when it is what is served already."""
        config, old = self.served(config), self.config
        if config.version == old.version:
            return False
        self.config = config
        await self.registry.update_prober(self.prober)
        self.prober.set_config_version(config.version)
        added = [name for name in config.servers if name not in old.servers]
        removed = [name for name in old.servers if name not in config.servers]
        replicas = {
            name: (
                [i.instance_id for i in entry.instances if i not in before],
                [i.instance_id for i in before if i not in entry.instances],
            )
            for name, entry in config.servers.items()
            if name in old.servers and (before := old.servers[name].instances) != entry.instances
        }
        events.config_reloaded(self.source.name, old.version, config.version, added, removed, replicas)
        return True

    async def set_problem(self, problem: str | None) -> None:
        """Refuse ControlPlaneService calls (the source's gate) and report NOT_SERVING while `problem` is set."""
        if problem == self.problem:
            return
        if problem is None:
            logger.warning("config source is back: serving config version %s", self.config.version)
        else:
            logger.warning("%s; refusing RPCs until it answers", problem)
        self.problem = problem
        await self._set_serving(problem is None)

    async def _set_serving(self, serving: bool) -> None:
        await self._health.set("", _SERVING if serving else _NOT_SERVING)
        await self._health.set(SERVICE_NAME, _SERVING if serving else _NOT_SERVING)

    async def _follow_health(self, report: StatusReport | None, name: str) -> None:
        await mirror_status_in_health(self._health, report, name)


def _retrieve_outcome(task: asyncio.Task[bool]) -> None:
    """A shared reload whose callers all went away still had its outcome logged: nothing left to report."""
    if not task.cancelled():
        task.exception()


OPEN_REGISTRATIONS_FLAG = "--open-registrations"


def registration_refusal(host: str, security: ServerSecurity, open_registrations: bool) -> str | None:
    """Why a head refuses registrations: it is reachable beyond this machine (bound to a wildcard or another
    address than loopback) and nothing tells who may add instances clients will send work to (no token), unless
    the operator opened them on purpose. None when it takes them (loopback stays zero-config)."""
    if security.token or open_registrations or bound_to_loopback(host):
        return None
    return (
        f"registrations are off: this head listens on {url_host(host)} without a token, so anyone who reaches "
        f"the port could add, drain or remove the instances clients send work to; set a token "
        f"(head_server.auth_token or GYM_RPC_TOKEN), or start it with {OPEN_REGISTRATIONS_FLAG} to accept them "
        f"from anyone who reaches the port"
    )


def refuse_busy_port(host: str, port: int, setting: str) -> None:
    """Raise a one-line GymRpcError when another process listens on host:port.

    gRPC finds out too, but prints a C-core log line before its own error; binding a plain socket first (with
    SO_REUSEADDR, as gRPC does) gives the one line without it. A port taken in between still fails in add_port.
    """
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return  # an unresolvable host: gRPC reports it
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise GymRpcError(
                        f"cannot listen on {url_host(host)}:{port}: the port is in use by another process; "
                        f"stop it or choose another port ({setting})"
                    ) from None
                return


def build_control_server(
    servicer: ControlPlaneServicer,
    health_servicer: HealthServicer,
    *,
    reflection_enabled: bool,
    interceptors: Sequence[grpc.aio.ServerInterceptor[Any, Any]] = (),
    security: ServerSecurity | None = None,
    options: Sequence[tuple[str, int]] | None = None,
) -> grpc.aio.Server:
    """A grpc.aio server with the control plane, standard health and (optionally) reflection; not bound yet.

    Shared by the head and the bridge, so both serve the same services the same way: the resource bounds of
    `options` (by default `server_options` with the default bounds), and token authentication (from `security`, by
    default GYM_RPC_TOKEN) before any other interceptor but tracing's. Bind it with `security.add_port` to serve
    TLS when configured.
    """
    security = security if security is not None else ServerSecurity.from_environment()
    # Tracing outermost (no interceptor when off: gym_rpc.telemetry), then metrics, so refused calls are traced and
    # counted too. Innermost, undecodable requests become INVALID_ARGUMENT; the token check above it never decodes
    # one.
    measured = [] if metrics_disabled() else [head_metrics.RpcMetricsInterceptor()]
    traced_and_guarded = [
        *server_interceptors(),
        *measured,
        *security.interceptors(),
        *interceptors,
        DecodeGuardInterceptor(),
    ]
    if options is None:
        options = server_options(max_connections=grpc_connection_bound())
    server = grpc.aio.server(interceptors=traced_and_guarded, options=options)
    add_control_plane_service(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection_enabled:
        names = [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)
    return server


async def mirror_status_in_health(health_servicer: HealthServicer, report: StatusReport | None, name: str) -> None:
    """Mirror a server's probe result under its name in the standard health service: SERVING while an instance
    that is not draining answers, UNKNOWN until one is probed, NOT_SERVING otherwise."""
    if report is None:
        serving = _SERVICE_UNKNOWN
    else:
        serves_now = serves(report)
        serving = _UNKNOWN if serves_now is None else _SERVING if serves_now else _NOT_SERVING
    await health_servicer.set(name, serving)


class _Stoppable(Protocol):
    async def stop(self) -> None: ...


class Servable(Protocol):
    """What `run_head` drives: the head server, or the bridge in front of a NeMo Gym head."""

    @property
    def config(self) -> GlobalConfig: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def reload(self) -> bool: ...


ServableT = TypeVar("ServableT", bound=Servable)


async def run_head(head: ServableT, on_started: Callable[[ServableT], None]) -> None:
    """Serve until SIGTERM or SIGINT; SIGHUP reloads the config (the file, or the bridge's upstream)."""
    raise_fd_soft_limit()  # a head serves many connections: use what the hard limit allows
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    reloads: set[asyncio.Task[None]] = set()

    def reload_in_background() -> None:
        async def reload() -> None:
            try:
                await head.reload()  # logs its outcome (gym_rpc.server.fleet.events)
            except ConfigError:
                pass  # logged by the reload itself; the old config stays
            except Exception:
                logger.exception("SIGHUP: reload failed, old config kept")

        task = loop.create_task(reload())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    with contextlib.suppress(AttributeError):  # no SIGHUP on some platforms
        loop.add_signal_handler(signal.SIGHUP, reload_in_background)
    # Announce only once the handlers are in place: a signal sent right after the banner must stop cleanly.
    await head.start()
    on_started(head)
    try:
        await stop.wait()
    finally:
        await head.stop()
