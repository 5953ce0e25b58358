"""`gym-rpc bridge`: the gRPC control plane in front of an unmodified NeMo Gym HTTP head.

The bridge is the head's server (`HeadServer`) with another config source: it fetches the config
(`GET /global_config_dict_yaml`) and the instances (`GET /server_instances`) from the upstream on an interval, and
everything else (prober, servicer, health, token, TLS, health port, watch bounds) is the head's. While the
upstream cannot be reached (or before its first answer) every ControlPlaneService call is refused with
UNAVAILABLE naming the upstream URL; the bridge recovers on the first good fetch.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import grpc

from gym_rpc._tasks import run_every, stop_poller
from gym_rpc.config import (
    DEFAULT_HEAD_HOST,
    DEFAULT_HEAD_PORT,
    HEAD_SERVER_KEY,
    GlobalConfig,
    checked_seconds,
    parse_config_text,
    parse_host_port,
)
from gym_rpc.errors import ConfigError, UpstreamError
from gym_rpc.server._head import HeadOptions, HeadServer
from gym_rpc.server._sources import ConfigTarget
from gym_rpc.server.security import Handler, HandlerInterceptor, ServerInterceptor, aborting_handler
from gym_rpc.wire import SERVICE_NAME, ReportedProcess

logger = logging.getLogger(__name__)

CONFIG_PATH = "/global_config_dict_yaml"
INSTANCES_PATH = "/server_instances"
_METHOD_PREFIX = f"/{SERVICE_NAME}/"
# The most of an upstream answer read (as the client's largest accepted answer): a larger one is refused as it
# comes, never held whole.
MAX_UPSTREAM_ANSWER_BYTES = 64 * 1024 * 1024
_READ_CHUNK_BYTES = 256 * 1024


@dataclass(frozen=True, kw_only=True)
class BridgeOptions(HeadOptions):
    """The head's serving options, plus where the upstream is and how often the bridge looks."""

    upstream_url: str
    host: str | None = DEFAULT_HEAD_HOST
    port: int | None = DEFAULT_HEAD_PORT  # 0: a free port
    refresh_interval_seconds: float = 1.0
    fetch_timeout_seconds: float = 2.0  # bounds each upstream request
    # The bridge's own head_server settings, the keys of the head's block: auth_token, tls and the ports
    # (HeadServerSettings).
    head_server: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Refuse what would spin (a 0 interval) or never end (nan, inf); the head's checks for the rest."""
        checked_seconds(self.refresh_interval_seconds, "the refresh interval (--refresh-interval)")
        checked_seconds(self.fetch_timeout_seconds, "the fetch timeout (--fetch-timeout)")
        super().__post_init__()


@dataclass(frozen=True)
class UpstreamSnapshot:
    document: dict[str, Any]
    processes: dict[str, ReportedProcess] = field(default_factory=dict)


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
            body = await _bounded_body(response, url)
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


async def _bounded_body(response: aiohttp.ClientResponse, url: str) -> bytes:
    """The answer's body, refused (UpstreamError) past MAX_UPSTREAM_ANSWER_BYTES, from its length when it says."""
    too_long = UpstreamError(f"GET {url} answered more than {MAX_UPSTREAM_ANSWER_BYTES} bytes")
    if (response.content_length or 0) > MAX_UPSTREAM_ANSWER_BYTES:
        raise too_long
    body = bytearray()
    async for chunk in response.content.iter_chunked(_READ_CHUNK_BYTES):
        body += chunk
        if len(body) > MAX_UPSTREAM_ANSWER_BYTES:
            raise too_long
    return bytes(body)


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


def _processes(payload: Any) -> dict[str, ReportedProcess]:
    """pid and start time per server name (NeMo Gym's `process_name`, the config's top-level key)."""
    processes: dict[str, ReportedProcess] = {}
    if not isinstance(payload, list):
        return processes
    for item in payload:
        if not isinstance(item, Mapping):
            continue
        name = item.get("process_name") or item.get("config_path")
        pid, start_time = item.get("pid"), item.get("start_time")
        if isinstance(name, str) and isinstance(pid, int) and not isinstance(pid, bool):
            started = float(start_time) if isinstance(start_time, int | float) else 0.0
            processes[name] = ReportedProcess(pid=pid, start_time=started)
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


class UpstreamSource:
    """The bridge's config source: an upstream NeMo Gym head, fetched on an interval and on reload.

    While it cannot be reached (or before its first answer), `UpstreamGate` refuses every ControlPlaneService call
    with UNAVAILABLE naming it, and health says NOT_SERVING; the first good fetch recovers both.
    """

    def __init__(
        self, upstream_url: str, *, refresh_interval_seconds: float, fetch_timeout_seconds: float
    ) -> None:
        self.upstream_url = normalize_upstream_url(upstream_url)
        self.refresh_interval_seconds = refresh_interval_seconds
        self.fetch_timeout_seconds = fetch_timeout_seconds
        self.processes: dict[str, ReportedProcess] = {}
        self.name: Path | str = self.upstream_url  # what logs call this source
        self._head: ConfigTarget | None = None
        self._session: aiohttp.ClientSession | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._fetched = False

    def interceptors(self) -> Sequence[ServerInterceptor]:
        return [UpstreamGate(lambda: self._head.problem if self._head is not None else self._not_fetched())]

    def _not_fetched(self) -> str:
        return f"no config fetched yet from the NeMo Gym head at {self.upstream_url}"

    def check(self, config: GlobalConfig) -> None:
        return None  # the bridge's own head_server block is checked as the server reads it

    async def start(self, head: ConfigTarget) -> None:
        self._head = head
        await head.set_problem(self._not_fetched())
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.fetch_timeout_seconds), trust_env=False
        )
        await self.refresh()  # one bounded attempt, so a reachable upstream is served from the first call
        self._refresher = asyncio.create_task(self._refresh_forever(), name="gym_rpc bridge refresher")

    async def stop(self) -> None:
        """Stop refreshing; the server stops serving after this."""
        await stop_poller(self._refresher, self._session)
        self._refresher = None
        self._session = None

    async def reload(self, head: ConfigTarget) -> bool:
        """Fetch from the upstream now (ReloadGlobalConfig, SIGHUP); True when the config changed."""
        version = head.config.version
        if not await self.refresh():
            raise ConfigError(head.problem or f"the NeMo Gym head at {self.upstream_url} did not answer")
        return head.config.version != version

    async def refresh(self) -> bool:
        """One fetch from the upstream; False (and RPCs refused) when it failed."""
        assert self._session is not None and self._head is not None, "bridge not started"
        head = self._head
        async with self._lock:
            try:
                snapshot = await fetch_upstream(self._session, self.upstream_url)
                config = GlobalConfig.from_document(snapshot.document)
            except (UpstreamError, ConfigError) as exc:
                state = "unavailable" if self._fetched else "unavailable (no config fetched yet)"
                await head.set_problem(f"the NeMo Gym head at {self.upstream_url} is {state}: {exc}")
                return False
            self._fetched = True
            await head.apply_config(config)
            self.processes = snapshot.processes
            await head.set_problem(None)
            return True

    async def _refresh_forever(self) -> None:
        """Refresh every interval until stop() cancels it; each fetch is bounded by the session timeout."""
        await run_every(self.refresh_interval_seconds, self.refresh, "bridge refresh", logger, now=False)


class BridgeHead(HeadServer):
    """`gym-rpc bridge`: the control-plane server fed by an upstream NeMo Gym head instead of a file, with every
    serving feature of the head (token, TLS, health port, HTTP head, watch bounds) from `options.head_server`."""

    def __init__(self, options: BridgeOptions) -> None:
        self.upstream = UpstreamSource(
            options.upstream_url,
            refresh_interval_seconds=options.refresh_interval_seconds,
            fetch_timeout_seconds=options.fetch_timeout_seconds,
        )
        own = {**options.head_server, "host": options.host, "port": options.port}
        own_config = GlobalConfig.from_document({HEAD_SERVER_KEY: own})
        super().__init__(own_config, options, source=self.upstream, service_name="gym-rpc-bridge")
        self.problem = self.upstream._not_fetched()

    @property
    def upstream_url(self) -> str:
        return self.upstream.upstream_url


class UpstreamGate(HandlerInterceptor):
    """Refuses every ControlPlaneService call with UNAVAILABLE while `reason()` names a problem.

    One place for the rule, so the servicer's handlers need no bridge-specific branches; health and reflection
    stay open (health reports NOT_SERVING meanwhile).
    """

    def __init__(self, reason: Callable[[], str | None]) -> None:
        self._reason = reason

    def handle(self, handler: Handler, details: grpc.HandlerCallDetails) -> Handler:
        if not details.method.startswith(_METHOD_PREFIX):
            return handler
        problem = self._reason()
        if problem is None:
            return handler
        return aborting_handler(handler, grpc.StatusCode.UNAVAILABLE, problem)
