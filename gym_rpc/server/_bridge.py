"""`gym-rpc bridge`: the gRPC control plane in front of an unmodified NeMo Gym HTTP head.

The bridge fetches the config (`GET /global_config_dict_yaml`) and the instances (`GET /server_instances`) from the
upstream on an interval, probes the servers itself with the head's StatusProber, and serves every RPC with the
head's own servicer. While the upstream cannot be reached (or before its first answer) every ControlPlaneService
call is refused with UNAVAILABLE naming the upstream URL; the bridge recovers on the first good fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
import grpc
from grpc_health.v1 import health_pb2

from gym_rpc.config import (
    DEFAULT_HEAD_HOST,
    DEFAULT_HEAD_PORT,
    HEAD_SERVER_KEY,
    GlobalConfig,
    checked_port,
    checked_seconds,
    parse_config_text,
    parse_host_port,
    url_host,
)
from gym_rpc.errors import ConfigError, UpstreamError
from gym_rpc.server import _events as events
from gym_rpc.server._head import build_control_server, mirror_status_in_health
from gym_rpc.server._health import HealthServicer
from gym_rpc.server._prober import StatusProber
from gym_rpc.server._registry import InstanceRegistry
from gym_rpc.server._security import ServerSecurity, aborting_handler
from gym_rpc.server._servicer import Context, ControlPlaneServicer
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import SERVICE_NAME, StatusReport
from gym_rpc.wire import _convert as convert

logger = logging.getLogger(__name__)

CONFIG_PATH = "/global_config_dict_yaml"
INSTANCES_PATH = "/server_instances"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_METHOD_PREFIX = f"/{SERVICE_NAME}/"


@dataclass(frozen=True)
class BridgeOptions:
    """Where the bridge listens, where its upstream is, and how often it looks."""

    upstream_url: str
    host: str = DEFAULT_HEAD_HOST
    port: int = DEFAULT_HEAD_PORT  # 0: a free port
    refresh_interval_seconds: float = 1.0
    fetch_timeout_seconds: float = 2.0  # bounds each upstream request
    probe_interval_seconds: float = 2.0
    probe_timeout_seconds: float = 1.0
    reflection: bool = True
    watch_history_size: int = 1024
    shutdown_grace_seconds: float = 0.5

    def __post_init__(self) -> None:
        """Refuse what would spin (a 0 interval), never end (nan, inf) or bind another port (70000 wraps)."""
        checked_seconds(self.refresh_interval_seconds, "the refresh interval (--refresh-interval)")
        checked_seconds(self.fetch_timeout_seconds, "the fetch timeout (--fetch-timeout)")
        checked_seconds(self.probe_interval_seconds, "the probe interval (--probe-interval)")
        checked_seconds(self.probe_timeout_seconds, "the probe timeout (--probe-timeout)")
        checked_port(self.port, "the listen port (--listen)")


@dataclass(frozen=True)
class UpstreamProcess:
    """What NeMo Gym's /server_instances says about the process serving one server."""

    pid: int
    start_time: float


@dataclass(frozen=True)
class UpstreamSnapshot:
    document: dict[str, Any]
    processes: dict[str, UpstreamProcess] = field(default_factory=dict)


def parse_listen_address(text: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 bracketed) as (host, port); port 0 asks for a free one."""
    return parse_host_port(text, "listen address")


def normalize_upstream_url(text: str) -> str:
    """http(s)://HOST:PORT without a trailing slash; a bare HOST:PORT gets http://."""
    url = text.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"upstream {text!r}: expected http://HOST:PORT of a NeMo Gym head")
    return url


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    try:
        async with session.get(url, allow_redirects=False) as response:
            if response.status != 200:
                raise UpstreamError(f"GET {url} answered HTTP {response.status}")
            body = await response.read()
    except aiohttp.ClientResponseError as exc:  # bytes that are no HTTP/1.1 response (aiohttp quotes them raw)
        raise UpstreamError(
            f"GET {url} failed: the answer is not HTTP/1.1 (a gRPC port answers HTTP/2); --upstream takes the "
            f"NeMo Gym head's HTTP address"
        ) from exc
    except (aiohttp.ClientError, TimeoutError) as exc:
        reason = "no answer in time" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
        raise UpstreamError(f"GET {url} failed: {' '.join(reason.split())}") from exc
    try:
        return json.loads(body)
    except ValueError as exc:
        raise UpstreamError(f"GET {url} answered no JSON: {exc}") from exc


def _config_document(payload: Any, source: str) -> dict[str, Any]:
    """NeMo Gym answers the YAML text as a JSON string; a JSON object is taken as the document itself."""
    if isinstance(payload, str):
        try:
            return parse_config_text(payload, source)
        except ConfigError as exc:
            raise UpstreamError(str(exc)) from exc
    if isinstance(payload, dict):
        return {str(k): v for k, v in payload.items()}
    raise UpstreamError(f"{source} answered a JSON {type(payload).__name__}, not the config's YAML text")


def _processes(payload: Any) -> dict[str, UpstreamProcess]:
    """pid and start time per server name (NeMo Gym's `process_name`, the config's top-level key)."""
    processes: dict[str, UpstreamProcess] = {}
    if not isinstance(payload, list):
        return processes
    for item in payload:
        if not isinstance(item, Mapping):
            continue
        name = item.get("process_name") or item.get("config_path")
        pid, start_time = item.get("pid"), item.get("start_time")
        if isinstance(name, str) and isinstance(pid, int) and not isinstance(pid, bool):
            started = float(start_time) if isinstance(start_time, int | float) else 0.0
            processes[name] = UpstreamProcess(pid=pid, start_time=started)
    return processes


async def fetch_upstream(session: aiohttp.ClientSession, upstream_url: str) -> UpstreamSnapshot:
    """The upstream's config and instances. The config is required; the instances only add pids and start times,
    so a head that cannot list them still serves."""
    config_url = upstream_url + CONFIG_PATH
    document = _config_document(await _get_json(session, config_url), config_url)
    try:
        processes = _processes(await _get_json(session, upstream_url + INSTANCES_PATH))
    except UpstreamError as exc:
        logger.info("upstream instances unavailable, serving without pids: %s", exc)
        processes = {}
    return UpstreamSnapshot(document, processes)


class BridgeHead:
    """The HeadState the servicer reads, kept in step with the upstream NeMo Gym head."""

    def __init__(self, options: BridgeOptions) -> None:
        self.options = options
        self.upstream_url = normalize_upstream_url(options.upstream_url)
        self.pid = os.getpid()
        self.start_time = time.time()
        self.port = 0
        self.config = GlobalConfig.from_document({HEAD_SERVER_KEY: {"host": options.host, "port": options.port}})
        self.processes: dict[str, UpstreamProcess] = {}
        self.problem: str | None = f"no config fetched yet from the NeMo Gym head at {self.upstream_url}"
        self._health = HealthServicer()
        self.prober = StatusProber(
            {},
            interval_seconds=options.probe_interval_seconds,
            probe_timeout_seconds=options.probe_timeout_seconds,
            history_size=options.watch_history_size,
            on_change=self._follow_health,
        )
        self.registry = InstanceRegistry()  # servers that registered with the bridge (RegisterServerInstance)
        self._server: grpc.aio.Server | None = None
        self._session: aiohttp.ClientSession | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._refresh_lock = asyncio.Lock()
        self._fetched = False

    @property
    def address(self) -> str:
        """host:port the bridge listens on (IPv6 bracketed)."""
        return f"{url_host(self.options.host)}:{self.port}"

    def unavailable_reason(self) -> str | None:
        """Why RPCs are refused right now (None: serving)."""
        return self.problem

    async def start(self) -> None:
        security = ServerSecurity.from_environment()  # the token of GYM_RPC_TOKEN, checked before the gate
        server = build_control_server(
            BridgeServicer(self),
            self._health,
            reflection_enabled=self.options.reflection,
            interceptors=[UpstreamGate(self.unavailable_reason)],
            security=security,
        )
        self.port = security.add_port(server, self.options.host, self.options.port)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.options.fetch_timeout_seconds), trust_env=False
        )
        await self.prober.start()  # before the first call can arrive: handlers read its reports
        self.registry.start_expiry(self.prober, lambda: self.config.servers)
        await server.start()
        self._server = server
        self.config = self.config.with_head_server(self.options.host, self.port)
        await self._health.set("", _NOT_SERVING)
        await self._health.set(SERVICE_NAME, _NOT_SERVING)
        await self.refresh()  # one bounded attempt, so a reachable upstream is served from the first call
        self._refresher = asyncio.create_task(self._refresh_forever(), name="gym_rpc bridge refresher")

    async def stop(self) -> None:
        """Report NOT_SERVING, stop refreshing and probing, then finish in-flight calls within the grace period."""
        await self._health.enter_graceful_shutdown()
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None
        if self._server is not None:
            await self._server.stop(self.options.shutdown_grace_seconds)
            self._server = None
        await self.registry.stop_expiry()
        await self.prober.stop()  # after the last call: in-flight handlers still read and probe through it
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def reload(self) -> bool:
        """Fetch from the upstream now (ReloadGlobalConfig, SIGHUP); True when the config changed."""
        version = self.config.version
        if not await self.refresh():
            error = ConfigError(self.problem or f"the NeMo Gym head at {self.upstream_url} did not answer")
            events.config_refused(self.upstream_url, version, error)
            raise error
        if self.config.version == version:
            events.config_unchanged(self.upstream_url, version)
            return False
        return True  # refresh() logged the new version

    async def refresh(self) -> bool:
        """One fetch from the upstream; False (and RPCs refused) when it failed."""
        assert self._session is not None, "bridge not started"
        async with self._refresh_lock:
            try:
                snapshot = await fetch_upstream(self._session, self.upstream_url)
                config = GlobalConfig.from_document(snapshot.document).with_head_server(
                    self.options.host, self.port
                )
            except (UpstreamError, ConfigError) as exc:
                state = "unavailable" if self._fetched else "unavailable (no config fetched yet)"
                await self._set_problem(f"the NeMo Gym head at {self.upstream_url} is {state}: {exc}")
                return False
            self._fetched = True
            if config.version != self.config.version:
                self.config = config
                await self.registry.update_prober(self.prober, lambda: self.config.servers)
                self.prober.set_config_version(config.version)
                logger.info("config from %s: version %s", self.upstream_url, config.version)
            self.processes = snapshot.processes
            await self._set_problem(None)
            return True

    async def _refresh_forever(self) -> None:
        """Refresh every interval until stop() cancels it; each fetch is bounded by the session timeout."""
        while True:
            await asyncio.sleep(self.options.refresh_interval_seconds)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # the refresher must outlive any single bad round
                logger.exception("bridge refresh failed")

    async def _set_problem(self, problem: str | None) -> None:
        if problem == self.problem:
            return
        if problem is None:
            logger.warning(
                "upstream %s is back: serving config version %s", self.upstream_url, self.config.version
            )
        else:
            logger.warning("%s; refusing RPCs until it answers", problem)
        self.problem = problem
        serving = _SERVING if problem is None else _NOT_SERVING
        await self._health.set("", serving)
        await self._health.set(SERVICE_NAME, serving)

    async def _follow_health(self, report: StatusReport | None, name: str) -> None:
        await mirror_status_in_health(self._health, report, name)


class BridgeServicer(ControlPlaneServicer):
    """The head's servicer, with the pids and start times the upstream reports for its server processes."""

    def __init__(self, bridge: BridgeHead) -> None:
        super().__init__(bridge)
        self._bridge = bridge

    async def ListServerInstances(
        self, request: pb.ListServerInstancesRequest, context: Context
    ) -> pb.ListServerInstancesResponse:
        response = await super().ListServerInstances(request, context)
        now = time.time()
        for instance in response.instances:
            process = self._bridge.processes.get(instance.name)
            if process is None or instance.name == HEAD_SERVER_KEY:
                continue
            instance.pid = process.pid
            if process.start_time > 0:
                instance.start_time.CopyFrom(convert.epoch_to_timestamp(process.start_time))
                instance.uptime.CopyFrom(convert.seconds_to_duration(max(0.0, now - process.start_time)))
        return response


if TYPE_CHECKING:  # generic only in the type stubs
    Handler = grpc.RpcMethodHandler[Any, Any]
    _ServerInterceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _ServerInterceptor = grpc.aio.ServerInterceptor


class UpstreamGate(_ServerInterceptor):
    """Refuses every ControlPlaneService call with UNAVAILABLE while `reason()` names a problem.

    One place for the rule, so the servicer's handlers need no bridge-specific branches; health and reflection
    stay open (health reports NOT_SERVING meanwhile).
    """

    def __init__(self, reason: Callable[[], str | None]) -> None:
        self._reason = reason

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(_METHOD_PREFIX):
            return handler
        problem = self._reason()
        if problem is None:
            return handler
        return aborting_handler(handler, grpc.StatusCode.UNAVAILABLE, problem)
