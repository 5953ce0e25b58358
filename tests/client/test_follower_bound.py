"""The instance follower is bounded (issue 43, point 8): a head pushing a flood of big changes costs the worker's
process at most a tenth of a core, and the worker's calls go on. The head is a real gRPC server in a process of
its own (bench/flood_head.py) writing 2,000-instance changes as fast as it can; the worker is a real ServerClient
in this process, calling a real aiohttp server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gym_rpc.client import ServerClient
from gym_rpc.client._follower import DEFAULT_BURST_SECONDS, DEFAULT_SHARE, close_instance_followers
from gym_rpc.config import BaseServerConfig
from tests.support import REPO_ROOT
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK

pytestmark = pytest.mark.process

INSTANCES = 2000
FLOOD_SECONDS = 8.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@contextmanager
def flood_head(tmp_path: Path, doc: dict, instances: int) -> Iterator[int]:
    path = tmp_path / "flood.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.flood_head", str(path), str(instances)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("READY "), line
        yield int(json.loads(line[len("READY ") :])["port"])
    finally:
        process.kill()
        process.wait(10)


def thread_cpu_seconds(thread: threading.Thread) -> float:
    """utime + stime of one thread of this process, from /proc."""
    stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / CLOCK_TICKS


def follower_thread(port: int) -> threading.Thread:
    name = f"gym-rpc instances of {LOOPBACK}:{port}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for thread in threading.enumerate():
            if thread.name == name:
                return thread
        time.sleep(0.01)
    raise AssertionError(f"no thread {name!r}")


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads a thread's CPU time from /proc")
async def test_a_flooding_head_costs_the_worker_at_most_a_tenth_of_a_core(tmp_path, http_server):
    model = await http_server()
    doc = document(
        {"policy_model": server_entry(model), "flooded": server_entry(9, "resources_servers")},
    )
    with flood_head(tmp_path, doc, INSTANCES) as port:
        doc["head_server"]["port"] = port
        client = ServerClient.load_from_global_config(BaseServerConfig(host=LOOPBACK, port=port))
        try:
            assert (await client.post("policy_model", "/v1/responses", json={})).status == 200  # follows now
            thread = follower_thread(port)
            cpu, started = thread_cpu_seconds(thread), time.monotonic()
            calls = 0
            while time.monotonic() - started < FLOOD_SECONDS:
                response = await client.post("policy_model", "/v1/responses", json={})
                assert response.status == 200
                calls += 1
                await asyncio.sleep(0)
            share = (thread_cpu_seconds(thread) - cpu) / (time.monotonic() - started)
        finally:
            close_instance_followers()
            await client.aclose()
    # A tenth of a core; on top, the burst it may spend at once after a quiet spell, /proc's tick granularity, and
    # the piece of work in hand when the window closed: the budget pauses after each event (a snapshot of 2,000
    # instances after a resume), so the last one's CPU is not yet paid back. Beside a bench, CI read 0.1175 against
    # a bound without it of 0.115.
    one_event_seconds = 0.05
    assert (
        share <= DEFAULT_SHARE + (DEFAULT_BURST_SECONDS + one_event_seconds + 2 / CLOCK_TICKS) / FLOOD_SECONDS
    ), share
    assert calls > 0
