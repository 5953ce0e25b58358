"""A head speaking NeMo Gym's HTTP wire format (aiohttp, encoded as NeMo Gym's FastAPI head encodes it), and
`gym-rpc bridge` heads in front of it: the `nemo_head` and `bridge_factory` fixtures."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from omegaconf import OmegaConf

from gym_rpc.client.control._channel import close_aio_channels
from gym_rpc.config import HEAD_SERVER_KEY
from gym_rpc.server._bridge import BridgeHead, BridgeOptions
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port

NemoHeadFactory = Callable[..., Awaitable["NemoGymHead"]]


BridgeFactory = Callable[..., Awaitable[BridgeHead]]


UPSTREAM_PID = 4242


UPSTREAM_START = 1_700_000_000.0


class NemoGymHead:
    """NeMo Gym's FastAPI head on the wire: what its handlers return, encoded as FastAPI encodes it."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def instances(self) -> list[dict[str, Any]]:
        """NeMo Gym's ServerInstanceDisplayConfig dump per launched server (process_name = top-level key)."""
        rows = []
        for process_name, node in self.doc.items():
            if process_name == HEAD_SERVER_KEY or not isinstance(node, dict):
                continue
            server_type, impls = next(iter(node.items()))
            if not isinstance(impls, dict):
                continue  # a global key such as `checkpoint: {enabled: true}`
            name, entry = next(iter(impls.items()))
            rows.append(
                {
                    "process_name": process_name,
                    "server_type": server_type,
                    "name": name,
                    "dir_path": f"/opt/gym/{server_type}/{name}",
                    "entrypoint": entry.get("entrypoint", "app.py"),
                    "host": entry["host"],
                    "port": entry["port"],
                    "url": f"http://{entry['host']}:{entry['port']}",
                    "pid": UPSTREAM_PID,
                    "config_path": process_name,
                    "start_time": UPSTREAM_START,
                }
            )
        return rows

    async def _config(self, request: web.Request) -> web.Response:
        # FastAPI returns the handler's str (OmegaConf.to_yaml) JSON-encoded: a string literal.
        text = OmegaConf.to_yaml(OmegaConf.create(self.doc))
        return web.Response(text=json.dumps(text, ensure_ascii=False), content_type="application/json")

    async def _instances(self, request: web.Request) -> web.Response:
        return web.json_response(self.instances())

    async def _liveness(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def start(self, port: int = 0) -> NemoGymHead:
        app = web.Application()
        app.router.add_get("/", self._liveness)
        app.router.add_get("/global_config_dict_yaml", self._config)
        app.router.add_get("/server_instances", self._instances)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, LOOPBACK, port or self.port).start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@pytest.fixture
async def nemo_head() -> AsyncIterator[NemoHeadFactory]:
    heads: list[NemoGymHead] = []

    async def start(doc: dict[str, Any], port: int = 0) -> NemoGymHead:
        # A held port (not port 0): a head stopped and started again gets its port back, nothing else can take it.
        head = await NemoGymHead(doc).start(port or closed_port())
        heads.append(head)
        return head

    yield start
    for head in heads:
        await head.stop()


@pytest.fixture
async def bridge_factory() -> AsyncIterator[BridgeFactory]:
    bridges: list[BridgeHead] = []

    async def start(upstream_url: str, **options: Any) -> BridgeHead:
        settings = {
            "port": 0,
            "refresh_interval_seconds": 0.1,
            "fetch_timeout_seconds": 1.0,
            "probe_interval_seconds": 0.1,
            "probe_timeout_seconds": 0.5,
            **options,
        }
        bridge = BridgeHead(BridgeOptions(upstream_url=upstream_url, host=LOOPBACK, **settings))
        await bridge.start()
        bridges.append(bridge)
        return bridge

    yield start
    await close_aio_channels()
    for bridge in bridges:
        await bridge.stop()


def upstream_document(model_port: int, agent_port: int, **global_keys: Any) -> dict[str, Any]:
    """A NeMo Gym-shaped config whose head_server is the NeMo Gym head itself (its HTTP port)."""
    doc = document(
        {
            "policy_model": server_entry(model_port, entrypoint="app.py", api_key="sk-live-123"),
            "simple_agent": server_entry(
                agent_port,
                "responses_api_agents",
                entrypoint="app.py",
                model_server={"type": "responses_api_models", "name": "policy_model"},
                assistant_message_header="<|assistant|>",
            ),
        },
        checkpoint={"enabled": True},
        observability_enabled=True,
        **global_keys,
    )
    doc[HEAD_SERVER_KEY] = {"host": LOOPBACK, "port": 11000}
    return doc
