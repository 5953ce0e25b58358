"""A client that stops reading blocks nothing but itself (issue 26, points 1 and 6), against a real `gym-rpc head`.

The attacker is a raw HTTP/2 client (tests/support/stalled_clients.py) that opens `grpc.health.v1.Health/Watch` and
`WatchServerStatuses` streams with a receive window of 0 and never grants any: each first write of the head to them
waits for good. With those open the prober keeps probing on time, calls answer, a reload works and SIGTERM stops
the head; past `--watch-stall` such a stream is dropped and its slot freed; health watches are capped per client
(every loopback address one client) and in total; readers that vanish mid-write log a line per interval at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.v1 import control_plane_pb2 as pb
from tests.support.cli import HeadProcess, running_head, threaded_http_server
from tests.support.documents import document, server_entry
from tests.support.loopback import closed_port
from tests.support.stalled_clients import StalledHttp2Client

HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
STATUS_WATCH = "/gym_rpc.v1.ControlPlaneService/WatchServerStatuses"
CONTROL_SERVICE = "gym_rpc.v1.ControlPlaneService"
SIGTERM_BOUND_SECONDS = 15.0  # the grace period is 0.5 s; generous for a loaded machine, finite unlike main's hang


def health_request(service: str) -> bytes:
    request: Any = health_pb2.HealthCheckRequest(service=service)  # grpc_health ships no type stubs
    return bytes(request.SerializeToString())


def status_watch_request(heartbeat_seconds: float = 0.05) -> bytes:
    request = pb.WatchServerStatusesRequest()
    request.heartbeat_interval.FromMilliseconds(round(heartbeat_seconds * 1000))
    return request.SerializeToString()


@contextlib.contextmanager
def stalled_client(head: HeadProcess, source: str = "127.0.0.1") -> Iterator[StalledHttp2Client]:
    host, port = head.address.rsplit(":", 1)
    client = StalledHttp2Client(host, int(port), source=source)
    try:
        yield client
    finally:
        client.close()


def write_config(path: Path, servers: dict[str, dict]) -> Path:
    path.write_text(yaml.safe_dump(document(servers)), encoding="utf-8")
    return path


async def wait_for_status(client: ControlClient, name: str, status: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        listed = {r.server_name: r.status for r in (await client.list_server_statuses(timeout=5)).reports}
        if listed.get(name) == status:
            return
        assert time.monotonic() < deadline, f"{name} is {listed.get(name)}, not {status}, after {timeout}s"
        await asyncio.sleep(0.1)


async def probe_times(client: ControlClient, name: str, seconds: float) -> set[float]:
    """The distinct probe times of `name` seen in the prober's cache over `seconds`."""
    seen: set[float] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for report in (await client.list_server_statuses(timeout=5)).reports:
            if report.server_name == name:
                seen.add(report.checked_at)
        await asyncio.sleep(0.05)
    return seen


async def test_readers_that_stop_reading_block_nothing_but_themselves(tmp_path: Path) -> None:
    with threaded_http_server() as server_a, threaded_http_server() as server_b:
        servers = {
            "a": server_entry(server_a.port),
            "b": server_entry(server_b.port),
            "w": server_entry(closed_port(), host="0.0.0.0"),
        }
        config = write_config(tmp_path / "gym.yaml", servers)
        # Stalled streams are kept for the whole test (no drop yet): what they could block, they would.
        with running_head(config, "--watch-stall", "600") as head:
            client = ControlClient(head.address)
            await wait_for_status(client, "b", "success")
            with stalled_client(head) as attacker:
                for service in ("", "a", "b", CONTROL_SERVICE):
                    attacker.open_stream(HEALTH_WATCH, health_request(service))
                for _ in range(4):
                    attacker.open_stream(STATUS_WATCH, status_watch_request())
                await asyncio.sleep(1.0)  # each stream's first write is now waiting on the window
                server_a.stop()  # a's health changes: the prober tells the watchers of "a"

                await wait_for_status(client, "a", "connection_error")
                # Every server is still probed on time: b, every 0.1 s (about 30 probes in 3 s when quiet).
                assert len(await probe_times(client, "b", seconds=3.0)) >= 5
                assert (await client.get_server_status("b", max_age_seconds=0, timeout=5)).status == "success"
                url = await client.register_server_instance(
                    "w", listen_port=8001, listen_host="0.0.0.0", pid=4242, timeout=5
                )
                assert url == "http://127.0.0.1:8001"
                write_config(config, {**servers, "c": server_entry(closed_port())})
                _, changed = await client.reload_global_config(timeout=10)
                assert changed
                await wait_for_status(client, "c", "connection_error")

                started = time.monotonic()
                head.process.terminate()
                assert await asyncio.to_thread(head.wait, SIGTERM_BOUND_SECONDS) == 0
                assert time.monotonic() - started < SIGTERM_BOUND_SECONDS
            assert "Traceback" not in head.stderr_text


@pytest.mark.parametrize("method", [HEALTH_WATCH, STATUS_WATCH])
async def test_a_stalled_watch_is_dropped_and_its_slot_freed(tmp_path: Path, method: str) -> None:
    config = write_config(tmp_path / "gym.yaml", {})
    request = health_request("") if method == HEALTH_WATCH else status_watch_request()
    # One watch per client: the stalled one holds the only slot until it is dropped.
    with running_head(config, "--watch-stall", "1", "--max-watches", "1") as head:
        with stalled_client(head) as attacker:
            stream = attacker.open_stream(method, request)
            await asyncio.sleep(0.3)
            refused = await watch_once(head, method)
            assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED
            deadline = time.monotonic() + 20
            while await watch_once(head, method) != grpc.StatusCode.OK:  # the slot comes back once dropped
                assert time.monotonic() < deadline, "the stalled watch was never dropped"
                await asyncio.sleep(0.2)
            # A reader that comes back to life gets what was queued and the reason: UNAVAILABLE, so it resumes.
            attacker.grant_window(stream)
            trailers = await asyncio.to_thread(attacker.trailers_of, stream, 10.0)
            assert trailers.get("grpc-status") == str(grpc.StatusCode.UNAVAILABLE.value[0])
            assert "reconnect and resume" in trailers.get("grpc-message", "")
        dropped = [line for line in head.stderr_text.splitlines() if "dropped a stream" in line]
        assert len(dropped) == 1 and "Traceback" not in head.stderr_text


async def watch_once(head: HeadProcess, method: str) -> grpc.StatusCode:
    """OK when a watch of `method` opens and sends its first message; the error code otherwise."""
    async with grpc.aio.insecure_channel(head.address) as channel:
        if method == HEALTH_WATCH:
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
        else:
            call = channel.unary_stream(method, None, None)(status_watch_request(), timeout=5)
        try:
            await call.read()
        except grpc.aio.AioRpcError as error:
            return error.code()
        call.cancel()
        return grpc.StatusCode.OK


async def test_health_watches_are_capped_per_client_and_every_loopback_address_is_one(tmp_path: Path) -> None:
    config = write_config(tmp_path / "gym.yaml", {})
    with running_head(config, "--watch-stall", "600", "--max-watches-per-address", "128") as head:
        # 128 per client address: spread over 127.0.0.1, 127.0.0.2 and 127.0.0.3, they are still one client.
        clients = [stalled_client(head, source) for source in ("127.0.0.1", "127.0.0.2", "127.0.0.3")]
        with contextlib.ExitStack() as stack:
            attackers = [stack.enter_context(c) for c in clients]
            for i in range(128):
                attackers[i % 3].open_stream(HEALTH_WATCH, health_request(""))
            await asyncio.sleep(1.0)
            async with grpc.aio.insecure_channel(head.address) as channel:
                call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call.read()
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "every loopback address counts as one client" in (caught.value.details() or "")
            # Check, unlimited and unblocked, still answers.
            async with grpc.aio.insecure_channel(head.address) as channel:
                answer = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_readers_that_vanish_mid_write_log_a_line_per_interval(tmp_path: Path) -> None:
    config = write_config(tmp_path / "gym.yaml", {})
    with running_head(config, "--watch-stall", "600") as head:
        started = time.monotonic()
        for _ in range(40):  # each: a watch stuck in its first write, then the connection torn down under it
            with stalled_client(head) as attacker:
                attacker.open_stream(STATUS_WATCH, status_watch_request())
                attacker.open_stream(HEALTH_WATCH, health_request(""))
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        elapsed = time.monotonic() - started
        # A line per 10 s interval per kind of event, at most; no traceback, nothing at ERROR.
        assert "Traceback" not in head.stderr_text and " ERROR " not in head.stderr_text
        assert len(head.stderr_text.splitlines()) <= 2 * (1 + elapsed // 10), head.stderr_text
        async with grpc.aio.insecure_channel(head.address) as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
