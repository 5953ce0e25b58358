"""An OpenAI-compatible engine as the tests need one: a real aiohttp app that answers the routes a vLLM or SGLang
server has (`POST /v1/responses`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`, `GET /metrics`) and
404 to any other path, as a real engine does to `/ng-rollout/<id>/v1/responses`. It records what reached it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gym_rpc.server import HeadServer
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK

MODEL_NAME = "fake-model"


@dataclass
class Received:
    """One request an engine answered (or refused): its raw path and headers."""

    method: str
    path: str
    headers: dict[str, str]


@dataclass
class FakeEngine:
    """One engine instance. `metrics` holds the gauges `/metrics` shows (Prometheus text, as vLLM or SGLang
    name them); `requests` what reached the engine, `/health` and `/metrics` scrapes left out."""

    name: str
    metrics: dict[str, float] = field(default_factory=dict)
    requests: list[Received] = field(default_factory=list)
    scrapes: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/responses", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        return app

    def _note(self, request: web.Request) -> None:
        self.requests.append(Received(request.method, request.raw_path, dict(request.headers)))

    async def _completion(self, request: web.Request) -> web.Response:
        self._note(request)
        await request.read()
        return web.json_response({"id": "resp-1", "object": "response", "engine": self.name})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        lines = []
        for name, value in self.metrics.items():
            lines.append(f"# TYPE {name} gauge")
            lines.append(f'{name}{{model_name="{MODEL_NAME}"}} {value}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _not_found(self, request: web.Request) -> web.Response:
        self._note(request)
        return web.json_response({"detail": "Not Found"}, status=404)

    def paths(self) -> list[str]:
        return [received.path for received in self.requests]

    def header_values(self, name: str) -> list[str | None]:
        lowered = name.lower()
        return [
            next((value for key, value in received.headers.items() if key.lower() == lowered), None)
            for received in self.requests
        ]


def engine_entry(port: int, affinity: Any = True, **extra: Any) -> dict[str, Any]:
    """A config entry for an engine (or a router) at `port`; affinity None leaves the key out (a Gym server)."""
    entry: dict[str, Any] = {"host": "127.0.0.1", "port": port, **extra}
    if affinity is not None:
        entry["session_affinity_header"] = affinity
    return {"responses_api_models": {"vllm": entry}}


async def engines_head(head_factory, http_server, **options: Any) -> tuple[HeadServer, list[FakeEngine]]:
    """A head serving one engine entry of two instances (vLLM's names, SGLang's) and a Gym server."""
    vllm, sglang = FakeEngine("vllm", dict(VLLM_METRICS)), FakeEngine("sglang", dict(SGLANG_METRICS))
    ports = [await http_server(vllm.app()), await http_server(sglang.app())]
    gym = await http_server()
    doc = document(
        {
            "policy": engine_entry(ports[0], replicas=[f"{LOOPBACK}:{ports[1]}"]),
            "judge": server_entry(gym, "resources_servers"),
        }
    )
    return await head_factory(doc, **options), [vllm, sglang]


VLLM_METRICS = {"vllm:num_requests_waiting": 3, "vllm:num_requests_running": 5, "vllm:kv_cache_usage_perc": 0.42}


SGLANG_METRICS = {"sglang:num_queue_reqs": 7, "sglang:num_running_reqs": 2, "sglang:token_usage": 0.9}
