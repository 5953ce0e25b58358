"""gym_rpc behind a real router (issue 39 point 5): the `vllm-router` wheel from PyPI (a Rust binary; the dev extra
installs it) in front of two OpenAI-compatible engines (real aiohttp apps on loopback, answering as vLLM does:
404 to any path it does not serve). With `session_affinity_header` and `observability_enabled: true`, rollouts
get no 404 and the router's `consistent_hash` keeps every call of a rollout on one engine; without the key, the
old behaviour: the router passes `/ng-rollout/<id>/...` on and the engine answers 404.

The router binds 127.0.0.1 only (its API and its Prometheus port), its start is bounded, and it is killed at the
end of each test."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from omegaconf import OmegaConf

from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.server_client import ServerClient, rollout_context
from gym_rpc.config import BaseServerConfig
from gym_rpc.wire import TRACEPARENT_RE
from tests.support.documents import document
from tests.support.engines import FakeEngine, engine_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.tracing import Traced

pytestmark = pytest.mark.process

# A loaded 2-core machine starts it in a second or two; past this the test fails, naming the router's output.
ROUTER_START_SECONDS = 60.0
ROLLOUTS, TURNS = 24, 3


def _router_binary() -> str:
    """The `vllm-router` launcher beside this interpreter (the dev extra installs it), else on PATH. Missing where
    its wheel is published (Linux x86_64) the test fails; elsewhere it is skipped."""
    beside = Path(sys.executable).parent / "vllm-router"
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        if sys.platform != "linux" or platform.machine() != "x86_64":
            pytest.skip("vllm-router publishes wheels for Linux x86_64 only")
        pytest.fail("vllm-router is not installed: pip install vllm-router (the dev extra has it)")
    return found


@dataclass
class Router:
    url: str
    process: asyncio.subprocess.Process
    log: Path


@contextlib.asynccontextmanager
async def running_router(worker_urls: list[str], policy: str, log: Path) -> AsyncIterator[Router]:
    """`vllm-router` on a free loopback port in front of `worker_urls`, ready (its /health answers 200 and a
    model call routes), killed (and waited for) on exit, whatever happened."""
    port, metrics_port = closed_port(), closed_port()
    command = [
        _router_binary(),
        "--host", LOOPBACK,
        "--port", str(port),
        "--prometheus-host", LOOPBACK,
        "--prometheus-port", str(metrics_port),
        "--policy", policy,
        "--worker-startup-timeout-secs", "30",
        "--worker-startup-check-interval", "1",
        "--log-level", "warning",
        "--worker-urls", *worker_urls,
    ]  # fmt: skip
    with log.open("wb") as output:
        process = await asyncio.create_subprocess_exec(
            *command, stdout=output, stderr=asyncio.subprocess.STDOUT, start_new_session=True
        )
    router = Router(f"http://{LOOPBACK}:{port}", process, log)
    try:
        await _until_ready(router)
        yield router
    finally:
        await _stop(process)


async def _until_ready(router: Router) -> None:
    """Poll the router's /health until 200, at most ROUTER_START_SECONDS; its exit or the time out fails the test
    with what it printed. Asynchronous: the engines it probes at start answer from this very loop."""
    deadline = time.monotonic() + ROUTER_START_SECONDS
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() < deadline:
            if router.process.returncode is not None:
                pytest.fail(f"vllm-router exited {router.process.returncode}: {router.log.read_text()[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(router.url + "/health") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.1)
    pytest.fail(f"vllm-router not ready within {ROUTER_START_SECONDS} s: {router.log.read_text()[-2000:]}")


async def _stop(process: asyncio.subprocess.Process) -> None:
    """SIGKILL to the router's whole session (it may run threads or children), then reap it, bounded."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    await asyncio.wait_for(process.wait(), 30)


@pytest.fixture(autouse=True)
async def _close_sessions() -> AsyncIterator[None]:
    yield
    await close_http_sessions()


def client_for(router_url: str, affinity: Any) -> ServerClient:
    port = int(router_url.rsplit(":", 1)[1])
    head = BaseServerConfig(host=LOOPBACK, port=closed_port())  # no head: the router is the entry's one instance
    doc = document({"policy": engine_entry(port, affinity)}, observability_enabled=True)
    return ServerClient(head_server_config=head, global_config_dict=OmegaConf.create(doc))


async def rollout(client: ServerClient, rollout_id: str) -> list[tuple[int, str | None]]:
    """TURNS calls of one rollout, the way an agent makes them (Responses API, then Chat Completions): each
    call's status and the engine that answered it."""
    answers = []
    with rollout_context(rollout_id, span=True):
        for turn in range(TURNS):
            path = "/v1/responses" if turn % 2 == 0 else "/v1/chat/completions"
            body = {
                "model": "fake-model",
                "input": f"turn {turn}",
                "messages": [{"role": "user", "content": "hi"}],
            }
            async with await client.post("policy", path, json=body) as response:
                engine = (await response.json()).get("engine") if response.status == 200 else None
                answers.append((response.status, engine))
    return answers


async def test_rollouts_through_vllm_router_reach_one_engine_each(
    http_server, tmp_path: Path, traced: Callable[..., Traced]
) -> None:
    """Seen from both ends: each rollout's answers came from one engine, and each trace (one per rollout, its
    `gym.rollout` span) reached one engine, its context in `traceparent` through the router."""
    traced()
    engines = [FakeEngine("a"), FakeEngine("b")]
    urls = [f"http://{LOOPBACK}:{await http_server(engine.app())}" for engine in engines]
    async with running_router(urls, "consistent_hash", tmp_path / "router.log") as router:
        client = client_for(router.url, True)
        ids = [f"{task}-{index}" for task in range(ROLLOUTS // 4) for index in range(4)]
        results = await asyncio.gather(*(rollout(client, rollout_id) for rollout_id in ids))
    for rollout_id, answers in zip(ids, results, strict=True):
        assert [status for status, _ in answers] == [200] * TURNS, rollout_id
        assert len({engine for _, engine in answers}) == 1, f"rollout {rollout_id} reached {answers}"
    served = {engine for answers in results for _, engine in answers}
    assert served == {"a", "b"}  # consistent_hash spread the rollouts, each kept on its engine
    every_path = [path for engine in engines for path in engine.paths()]
    assert sorted(set(every_path)) == ["/v1/chat/completions", "/v1/responses"]  # no /ng-rollout/, no /ng-trace/
    assert len(every_path) == ROLLOUTS * TURNS
    engines_of_trace: dict[str, set[str]] = {}
    for engine in engines:
        for traceparent in engine.header_values("traceparent"):
            assert traceparent is not None and TRACEPARENT_RE.fullmatch(traceparent)
            engines_of_trace.setdefault(traceparent.split("-")[1], set()).add(engine.name)
    assert len(engines_of_trace) == ROLLOUTS  # one trace per rollout, every call of it carrying its context
    assert all(len(names) == 1 for names in engines_of_trace.values())


async def test_without_the_key_the_router_passes_the_rollout_path_on_and_the_engine_answers_404(
    http_server, tmp_path: Path
) -> None:
    """The old behaviour, through the real router: every call of a rollout is a 404."""
    engines = [FakeEngine("a"), FakeEngine("b")]
    urls = [f"http://{LOOPBACK}:{await http_server(engine.app())}" for engine in engines]
    async with running_router(urls, "consistent_hash", tmp_path / "router.log") as router:
        answers = await rollout(client_for(router.url, None), "0-1")
    assert [status for status, _ in answers] == [404] * TURNS
    every_path = [path for engine in engines for path in engine.paths()]
    assert len(every_path) == TURNS and all(path.startswith("/ng-rollout/0-1/v1/") for path in every_path)
