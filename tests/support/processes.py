"""Server processes that register with a head under test as instances of `policy` (aiohttp's and uvicorn's
integrations), started by the `replica` fixture."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gym_rpc.server._head import HeadServer
from tests.support import REPO_ROOT
from tests.support.documents import document, server_entry
from tests.support.heads import wait_for_report
from tests.support.loopback import closed_port

AIOHTTP_SERVER = """
import asyncio, sys
from aiohttp import web
from gym_rpc.integrations import register_aiohttp_app

async def answer(request):
    await asyncio.sleep(float(request.query.get("seconds", "0")))
    return web.Response(text="done")

head, port, grace = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
app = web.Application()
app.router.add_route("*", "/{tail:.*}", answer)
register_aiohttp_app(
    app, "policy", port, head=head, listen_host="127.0.0.1", refresh_seconds=0.3, lease_seconds=3.0,
    drain_grace_seconds=grace,
)
web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, shutdown_timeout=15)
"""


class ReplicaProcess:
    """A server process registering `policy` at its own port; killed at the end if it has not exited."""

    def __init__(self, process: asyncio.subprocess.Process, port: int) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def call(self, seconds: float) -> asyncio.Task[tuple[int, float]]:
        """A call that takes `seconds` on the server: (HTTP status, when it finished)."""

        async def call() -> tuple[int, float]:
            async with (
                aiohttp.ClientSession() as session,
                session.get(
                    f"{self.url}/work?seconds={seconds}", timeout=aiohttp.ClientTimeout(total=30)
                ) as answer,
            ):
                await answer.read()
                return answer.status, time.monotonic()

        return asyncio.create_task(call())


@pytest.fixture
async def replica(head_factory, http_server) -> AsyncIterator:
    """Factory: a head serving `policy` (its config instance a live in-process server), then a server process
    (`script`) registered as a second instance and up. Yields (head, process)."""
    started: list[ReplicaProcess] = []

    async def start(script: str, grace: float) -> tuple[HeadServer, ReplicaProcess]:
        head = await head_factory(document({"policy": server_entry(await http_server())}))
        port = closed_port()
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            script,
            head.address,
            str(port),
            str(grace),
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        started.append(ReplicaProcess(process, port))
        await wait_for_report(
            head,
            lambda r: [(i.status, i.origin) for i in r.instances][1:] == [("success", "registered")],
            "the server process registered and up",
            timeout=60,
        )
        return head, started[-1]

    yield start
    for replica_process in started:
        if replica_process.process.returncode is None:
            replica_process.process.kill()
        await asyncio.wait_for(replica_process.process.wait(), 10)
