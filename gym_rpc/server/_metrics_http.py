"""`GET /metrics`: the process's metrics in the Prometheus text format, on the head's HTTP port or its own.

A head with `http_port` serves it there beside NeMo Gym's endpoints; `gym-rpc head --metrics-port P` serves it
alone (for a head without an HTTP port, or to keep scrapes off it). Like the HTTP head it has no authentication:
bind it where only your scraper reaches it.
"""

from __future__ import annotations

from aiohttp import web

from gym_rpc.errors import GymRpcError
from gym_rpc.metrics import METRICS, PROMETHEUS_CONTENT_TYPE, prometheus_text

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
    """An aiohttp app alone on one port (the HTTP head, the metrics port): start, a one-line error naming the
    setting to change when the port is taken, stop."""

    what = "an HTTP app"  # what the error says could not be served
    setting = "another port"  # what the error says to choose instead

    def __init__(self) -> None:
        self._runner: web.AppRunner | None = None
        self.port = 0

    def app(self) -> web.Application:
        raise NotImplementedError

    async def start(self, host: str, port: int) -> None:
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host.strip("[]"), port).start()
        except OSError as exc:
            await runner.cleanup()
            raise GymRpcError(
                f"cannot serve {self.what} on {host}:{port}: {exc.strerror or exc}; choose {self.setting}"
            ) from exc
        self._runner = runner
        self.port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class MetricsServer(AppServer):
    """An aiohttp server answering only `GET /metrics`."""

    what = "/metrics"
    setting = "another --metrics-port"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(METRICS_PATH, metrics_handler)
        return app
