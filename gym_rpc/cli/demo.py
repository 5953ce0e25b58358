"""`gym-rpc demo`: a whole rollout system on loopback in one process, run end to end.

A head on the embedded default config's shape, a demo model server (`POST /v1/responses`) and a demo resources
server (`POST /verify`) on free ports; then N rollouts through ServerClient with rollout ids bound, each calling
the model and then verifying; then the status table and the throughput. Everything it starts, it stops: at once,
or with `serve` after Ctrl-C, the head and servers kept up meanwhile for a newcomer to call.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gym_rpc.cli._render import format_status_table
from gym_rpc.client import ControlClient, ServerClient, close_aio_channels, rollout_context
from gym_rpc.config import BaseServerConfig, GlobalConfig, default_config_text, parse_config_text
from gym_rpc.integrations import TraceContextPathMiddleware
from gym_rpc.server import HeadOptions, HeadServer

LOOPBACK = "127.0.0.1"
MODEL_SERVER = "policy_model"
RESOURCES_SERVER = "example_resources"


@dataclass
class DemoStats:
    """What the demo servers saw: how many calls arrived carrying which rollout ids."""

    model_calls: int = 0
    verify_calls: int = 0
    rollout_ids_seen: set[str] = field(default_factory=set)


async def _alive(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def model_app(stats: DemoStats) -> web.Application:
    """A model server answering `/v1/responses` with a fixed assistant message."""

    async def responses(request: web.Request) -> web.Response:
        body = await request.json()
        stats.model_calls += 1
        if rollout_id := request.get("rollout_id"):
            stats.rollout_ids_seen.add(rollout_id)
        text = f"echo: {body.get('input', '')}"
        return web.json_response(
            {"object": "response", "output": [{"type": "message", "role": "assistant", "content": text}]}
        )

    app = TraceContextPathMiddleware.install(web.Application())
    app.router.add_get("/", _alive)
    app.router.add_post("/v1/responses", responses)
    return app


def resources_app(stats: DemoStats) -> web.Application:
    """A resources server whose `/verify` rewards answers that echo the prompt."""

    async def verify(request: web.Request) -> web.Response:
        body = await request.json()
        stats.verify_calls += 1
        reward = 1.0 if str(body.get("response", "")).startswith("echo:") else 0.0
        return web.json_response({"reward": reward})

    app = TraceContextPathMiddleware.install(web.Application())
    app.router.add_get("/", _alive)
    app.router.add_post("/verify", verify)
    return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, LOOPBACK, 0)
    await site.start()
    return runner, int(runner.addresses[0][1])


def demo_config(model_port: int, resources_port: int) -> GlobalConfig:
    """The embedded default config pointed at the demo servers, minus its agent (the demo is the agent)."""
    document: dict[str, Any] = parse_config_text(default_config_text())
    document.pop("simple_agent", None)
    document[MODEL_SERVER]["responses_api_models"]["openai_model"].update(host=LOOPBACK, port=model_port)
    document[RESOURCES_SERVER]["resources_servers"]["example_tools"].update(host=LOOPBACK, port=resources_port)
    document["head_server"] = {"host": LOOPBACK, "port": 0}
    document["observability_enabled"] = True
    return GlobalConfig.from_document(document)


async def one_rollout(client: ServerClient, index: int) -> float:
    """One rollout: ask the model, verify its answer. Returns the seconds it took."""
    started = time.perf_counter()
    with rollout_context(f"demo-{index}"):
        response = await client.post(MODEL_SERVER, "/v1/responses", json={"input": f"task {index}"})
        answer = (await response.json())["output"][0]["content"]
        verdict = await client.post(RESOURCES_SERVER, "/verify", json={"response": answer})
        if (await verdict.json())["reward"] != 1.0:
            raise RuntimeError(f"rollout {index}: unexpected reward")
    return time.perf_counter() - started


class ProgressBar:
    """A one-line progress bar on stderr (redrawn in place on a terminal, every 10% otherwise)."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width, self.done = total, width, 0
        self._tty = sys.stderr.isatty()
        self._last_decile = -1

    def advance(self) -> None:
        self.done += 1
        decile = self.done * 10 // self.total
        if not self._tty and decile == self._last_decile and self.done != self.total:
            return
        self._last_decile = decile
        filled = self.width * self.done // self.total
        line = f"rollouts [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total}"
        print(("\r" if self._tty else "") + line, end="" if self._tty else "\n", file=sys.stderr, flush=True)
        if self._tty and self.done == self.total:
            print(file=sys.stderr)


async def run_demo(rollouts: int, concurrency: int, *, serve: bool = False) -> int:
    stats = DemoStats()
    model_runner, model_port = await _serve(model_app(stats))
    resources_runner, resources_port = await _serve(resources_app(stats))
    head = HeadServer(demo_config(model_port, resources_port), HeadOptions(probe_interval_seconds=0.5))
    client: ServerClient | None = None
    try:
        await head.start()
        print(f"head on {head.address}; model server on :{model_port}; resources server on :{resources_port}")
        head_config = BaseServerConfig(host=LOOPBACK, port=head.port)
        client = await asyncio.to_thread(ServerClient.load_from_global_config, head_config)
        latencies = await _run_rollouts(client, rollouts, concurrency)
        await _print_status(head.address)
        _print_throughput(latencies, stats, rollouts)
        if serve:
            await _serve_until_interrupted(head.address)
        return 0 if len(stats.rollout_ids_seen) == rollouts else 1
    finally:
        if client is not None:
            await client.aclose()
        await close_aio_channels()
        await head.stop()
        await model_runner.cleanup()
        await resources_runner.cleanup()


async def _serve_until_interrupted(address: str) -> None:
    """Keep everything up until Ctrl-C (which ends the command with 130, everything stopped)."""
    print()
    print(f"serving until Ctrl-C; in another shell: export GYM_RPC_HEAD={address}")
    print("  gym-rpc status                  # the servers and their statuses")
    print("  gym-rpc config                  # the config the head serves")
    print(
        "  python -c 'import asyncio; from gym_rpc.client.server_client import ServerClient; "
        f"c = ServerClient.load_from_global_config(); "
        f'print(asyncio.run(c.post("{MODEL_SERVER}", "/v1/responses", json={{"input": "hi"}})).status)\''
    )
    sys.stdout.flush()
    await asyncio.Event().wait()


async def _run_rollouts(client: ServerClient, rollouts: int, concurrency: int) -> list[float]:
    bar = ProgressBar(rollouts)
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def guarded(index: int) -> None:
        async with gate:
            latencies.append(await one_rollout(client, index))
        bar.advance()

    started = time.perf_counter()
    await asyncio.gather(*(guarded(i) for i in range(rollouts)))
    latencies.append(time.perf_counter() - started)  # the last entry is the wall time
    return latencies


async def _print_status(address: str) -> None:
    control = ControlClient(address)
    instances = await control.list_server_instances()
    snapshot = await control.list_server_statuses()
    print()
    print(format_status_table(snapshot.reports, instances))


def _print_throughput(latencies: list[float], stats: DemoStats, rollouts: int) -> None:
    wall = latencies.pop()
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    print()
    print(
        f"{rollouts} rollouts in {wall:.2f}s: {rollouts / wall:.0f} rollouts/s, "
        f"{(stats.model_calls + stats.verify_calls) / wall:.0f} requests/s; "
        f"rollout latency p50 {statistics.median(ordered) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"
    )
    print(
        f"model calls {stats.model_calls}, verify calls {stats.verify_calls}, "
        f"distinct rollout ids seen by the model server {len(stats.rollout_ids_seen)}"
    )
