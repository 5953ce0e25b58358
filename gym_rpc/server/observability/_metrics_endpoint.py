"""`GET /metrics`: the process's metrics in the Prometheus text format, on the head's HTTP port or its own.

A head with `http_port` serves it there beside NeMo Gym's endpoints; `gym-rpc head --metrics-port P` serves it
alone (for a head without an HTTP port, or to keep scrapes off it). Like the HTTP head it has no authentication:
bind it where only your scraper reaches it.
"""

from __future__ import annotations

from aiohttp import web

from gym_rpc.metrics import METRICS, PROMETHEUS_CONTENT_TYPE, prometheus_text
from gym_rpc.server.observability._quiet_http_log import QuietRequestLog
from gym_rpc.server.security import BoundedSite, bound_to_loopback, loopback_host_only

METRICS_PATH = "/metrics"


async def metrics_handler(request: web.Request) -> web.Response:
    """The Prometheus exposition, or 404 when this process exports no Prometheus metrics (OTEL_SDK_DISABLED,
    OTEL_METRICS_EXPORTER=none, or an application MeterProvider without a Prometheus reader)."""
    if not METRICS.prometheus:
        return web.Response(
            status=404, text="metrics are off in this process (OTEL_SDK_DISABLED or exporter none)\n"
        )
    return web.Response(body=prometheus_text(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


class AppServer:
    """An aiohttp app alone on one port (the HTTP head, the metrics port), with bounded connections
    (gym_rpc.server.security._connection_limits): start, a one-line error naming the setting to change when the
    port is taken, stop."""

    what = "an HTTP app"  # what the error says could not be served
    port_name = "http"  # what the log and gym.head.bad_requests call the port
    setting = "port"  # what the error says to choose another of

    def __init__(self) -> None:
        self._site: BoundedSite | None = None
        self.port = 0

    def app(self) -> web.Application:
        raise NotImplementedError

    async def start(self, host: str, port: int) -> None:
        app = self.app()
        if bound_to_loopback(host):  # DNS rebinding: only loopback names (gym_rpc.server.security._host_check)
            app.middlewares.insert(0, loopback_host_only)
        site = BoundedSite(app, QuietRequestLog(self.port_name))
        self.port = await site.start(host, port, what=self.what, setting=self.setting)
        self._site = site

    async def stop(self) -> None:
        if self._site is not None:
            await self._site.stop()
            self._site = None


class MetricsServer(AppServer):
    """An aiohttp server answering only `GET /metrics`."""

    what = "/metrics"
    setting = "--metrics-port"
    port_name = "metrics"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(METRICS_PATH, metrics_handler)
        return app
