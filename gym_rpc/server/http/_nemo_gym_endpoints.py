"""NeMo Gym's HTTP control endpoints, served from the head's state so unmodified NeMo Gym clients keep working.

The wire format is NeMo Gym's FastAPI head's, byte for byte where it matters:

* `GET /global_config_dict_yaml` answers the config rendered as YAML, as a JSON *string literal*
  (`Content-Type: application/json`); NeMo Gym's client does `OmegaConf.create(json.loads(body))`.
* `GET /server_instances` answers a JSON list of NeMo Gym's `ServerInstanceDisplayConfig` objects.
* `GET /` and `GET /livez` answer `{"status": "ok"}` (alive); `GET /readyz`, `/healthz` and `/health` answer 503
  `{"status": "starting"}` until the head is ready (config loaded, first probe round done, warm-up over), then 200
  `{"status": "ok"}`, as NeMo Gym 0.7.0's head does: tools such as NeMo Evaluator poll them.

Secret-looking keys are redacted exactly as in GetGlobalConfig: this endpoint has no authentication.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import yaml
from aiohttp import web

from gym_rpc.config import HEAD_SERVER_KEY, GlobalConfig, redact_secrets
from gym_rpc.server.http._status_page import StatusPage
from gym_rpc.server.observability import METRICS_PATH, AppServer, metrics_handler
from gym_rpc.server.service import HeadState

logger = logging.getLogger("gym_rpc.server._http_head")  # its name from before the move

HTTP_PORT_KEY = "http_port"
LIVENESS_PATHS = ("/", "/livez")
READINESS_PATHS = ("/readyz", "/healthz", "/health")
_JSON = "application/json"


def config_yaml_body(config: GlobalConfig) -> bytes:
    """The body of `GET /global_config_dict_yaml`: the redacted config as YAML, inside a JSON string literal."""
    text = yaml.safe_dump(
        redact_secrets(config.document), sort_keys=False, allow_unicode=True, default_flow_style=False
    )
    return json.dumps(text, ensure_ascii=False).encode()


def server_instances(head: HeadState) -> list[dict[str, Any]]:
    """One NeMo Gym `ServerInstanceDisplayConfig` per server: `process_name` (and `config_path`) is the top-level
    key, `name` the implementation. The head launched none of them, so `pid` is unknown and `start_time` is the
    head's own (NeMo Gym stamps the time it launched them)."""
    now = time.time()
    instances = []
    for entry in head.config.servers.values():
        report = head.prober.report(entry.name)
        instances.append(
            {
                "config_path": entry.name,
                "dir_path": None,
                "entrypoint": entry.config.get("entrypoint"),
                "host": entry.host,
                "name": entry.impl_name,
                "pid": None,
                "port": entry.port,
                "process_name": entry.name,
                "server_type": entry.server_type,
                "start_time": head.start_time,
                "status": report.status,
                "uptime_seconds": max(0.0, now - head.start_time),
                "url": entry.url,
            }
        )
    return instances


class HttpHead(AppServer):
    """An aiohttp server answering NeMo Gym's head endpoints from a head's current state."""

    what = "NeMo Gym's HTTP head"
    setting = f"{HEAD_SERVER_KEY}.{HTTP_PORT_KEY} (or --http-port)"

    def __init__(self, head: HeadState, page: StatusPage | None = None) -> None:
        super().__init__()
        self._head = head
        self._page = (
            page  # the status page at /ui/ (gym_rpc.server.http._status_page; the head starts and stops it)
        )
        self._yaml_body: tuple[str, bytes] | None = None  # (version, body): rendered once per config version

    def app(self) -> web.Application:
        app = web.Application()
        for path in LIVENESS_PATHS:
            app.router.add_get(path, self._liveness)
        for path in READINESS_PATHS:
            app.router.add_get(path, self._readiness)
        app.router.add_get("/global_config_dict_yaml", self._global_config_dict_yaml)
        app.router.add_get("/server_instances", self._server_instances)
        app.router.add_get(METRICS_PATH, metrics_handler)
        if self._page is not None:
            self._page.add_routes(app)
        return app

    async def _liveness(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readiness(self, request: web.Request) -> web.Response:
        if not self._head.ready:
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ok"})

    async def _global_config_dict_yaml(self, request: web.Request) -> web.Response:
        config = self._head.config
        if self._yaml_body is None or self._yaml_body[0] != config.version:
            self._yaml_body = (config.version, config_yaml_body(config))
        return web.Response(body=self._yaml_body[1], content_type=_JSON)

    async def _server_instances(self, request: web.Request) -> web.Response:
        return web.json_response(server_instances(self._head))
