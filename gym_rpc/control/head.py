"""The head server: the control-plane service, standard health, reflection, and the background prober."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]
from grpc_reflection.v1alpha import reflection

from gym_rpc.config import GlobalConfig, load_config_file, url_host
from gym_rpc.control.prober import StatusProber
from gym_rpc.control.servicer import ControlPlaneServicer
from gym_rpc.status import StatusReport
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.v1 import control_plane_pb2_grpc as pb_grpc

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


class HeadServer:
    """A grpc.aio server serving one global config. Start with `start()`, end with `stop()`."""

    def __init__(
        self, config: GlobalConfig, options: HeadOptions = HeadOptions(), config_path: Path | None = None
    ):
        self.config = config
        self.options = options
        self.config_path = config_path
        self.pid = os.getpid()
        self.start_time = time.time()
        self.port = 0
        self._health = health_aio.HealthServicer()
        self.prober = StatusProber(
            config.servers,
            interval_seconds=options.probe_interval_seconds,
            probe_timeout_seconds=options.probe_timeout_seconds,
            history_size=options.watch_history_size,
            on_change=self._follow_health,
        )
        self._server: grpc.aio.Server | None = None
        self._reload_lock = asyncio.Lock()

    @property
    def host(self) -> str:
        return self.options.host if self.options.host is not None else self.config.head_server.host

    @property
    def address(self) -> str:
        """host:port the head listens on (IPv6 bracketed)."""
        return f"{url_host(self.host)}:{self.port}"

    async def start(self) -> None:
        server = grpc.aio.server()
        pb_grpc.add_ControlPlaneServiceServicer_to_server(ControlPlaneServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if self.options.reflection:
            names = [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME]
            reflection.enable_server_reflection(names, server)
        port = self.options.port if self.options.port is not None else self.config.head_server.port
        self.port = server.add_insecure_port(f"{url_host(self.host)}:{port}")
        await server.start()
        self._server = server
        self.config = self.config.with_head_server(self.host, self.port)
        await self._health.set("", _SERVING)
        await self._health.set(SERVICE_NAME, _SERVING)
        await self.prober.start()

    async def stop(self) -> None:
        """Report NOT_SERVING, then finish in-flight calls within the grace period."""
        await self._health.enter_graceful_shutdown()
        await self.prober.stop()
        if self._server is not None:
            await self._server.stop(self.options.shutdown_grace_seconds)
            self._server = None

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def reload(self) -> bool:
        """Re-read the config file; True when its content changed. A bad file keeps the old config."""
        if self.config_path is None:
            return False
        async with self._reload_lock:
            loaded = await asyncio.to_thread(load_config_file, self.config_path)
            config = loaded.with_head_server(self.host, self.port)
            if config.version == self.config.version:
                return False
            self.config = config
            await self.prober.set_servers(config.servers)
            logger.info("config reloaded from %s: version %s", self.config_path, config.version)
            return True

    async def _follow_health(self, report: StatusReport | None, name: str) -> None:
        """Mirror each server's probe result under its name in the standard health service."""
        if report is None:
            serving = _SERVICE_UNKNOWN
        elif report.status is None:
            serving = _UNKNOWN
        else:
            serving = _SERVING if report.status == "success" else _NOT_SERVING
        await self._health.set(name, serving)


async def run_head(head: HeadServer, on_started: Callable[[HeadServer], None]) -> None:
    """Serve until SIGTERM or SIGINT; SIGHUP reloads the config file."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    reloads: set[asyncio.Task[None]] = set()

    def reload_in_background() -> None:
        async def reload() -> None:
            try:
                changed = await head.reload()
                logger.warning(
                    "SIGHUP: config %s (version %s)", "reloaded" if changed else "unchanged", head.config.version
                )
            except Exception as exc:
                logger.error("SIGHUP: reload refused, old config kept: %s", exc)

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
