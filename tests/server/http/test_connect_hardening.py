"""The Connect port does no work for a caller before it is authenticated, and no caller's request bodies can take
the event loop that serves gRPC and the prober (issue 26, point 3), against a real `gym-rpc head`.

The attack is a 4 KB gzip body that inflates to 4 MiB of JSON (about 100 ms of head CPU each to inflate and parse
before: four such clients pushed an authenticated caller's p50 from 1.4 ms to seconds), and, on a head without a
token, 64 KiB JSON bodies of small keys, the costliest body the port still reads (~17 ms each).
"""

from __future__ import annotations

import gzip
import http.client
import json
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import yaml

from gym_rpc.client.control._clients import SyncControlClient
from tests.support.cli import HeadProcess, running_head
from tests.support.documents import document
from tests.support.loopback import LOOPBACK

TOKEN = "tok-connect-hardening-3f9a1c"
METHOD = "/gym_rpc.v1.ControlPlaneService/GetServerStatus"
BOMB = gzip.compress(json.dumps({"serverName": "a" * (4 << 20)}).encode(), 9)  # 4 KB that inflate to 4 MiB
ATTACK_SECONDS = 3.0
ROUNDS = 3
ATTACKERS = 4


def many_keys(size: int = 64 * 1024) -> bytes:
    """A JSON object of small keys, `size` bytes at most: the costliest JSON per byte to parse."""
    text = "{" + ",".join(f'"k{i}":{i}' for i in range(size // 8)) + "}"
    return (text[: text.rfind(",", 0, size - 1)] + "}").encode()


def head_cpu_seconds(head: HeadProcess) -> float:
    fields = Path(f"/proc/{head.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 1/100 s


@contextmanager
def connect_head(tmp_path: Path, token: str | None) -> Iterator[tuple[HeadProcess, int]]:
    head_server: dict[str, Any] = {"host": LOOPBACK, "port": 0}
    if token is not None:
        head_server["auth_token"] = token
    config = tmp_path / "gym.yaml"
    config.write_text(yaml.safe_dump(document({}, head_server=head_server)), encoding="utf-8")
    with running_head(config, "--connect-port", "0") as head:
        match = re.search(r"Connect on http://127\.0\.0\.1:(\d+)", head.banner)
        assert match, head.banner
        yield head, int(match.group(1))


def connect_post(port: int, body: bytes, *, gzipped: bool) -> int:
    """One POST to the Connect port on a connection of its own; the HTTP status."""
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
    headers = {"Content-Type": "application/json", **({"Content-Encoding": "gzip"} if gzipped else {})}
    try:
        connection.request("POST", METHOD, body=body, headers=headers)
        answer = connection.getresponse()
        answer.read()
        return answer.status
    finally:
        connection.close()


def unauthenticated_grpc_call(address: str) -> grpc.StatusCode:
    """One GetServerStatus with a wrong token, on a connection of its own (as each Connect request above)."""
    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary(METHOD, None, None)(b"", timeout=10, metadata=(("authorization", "Bearer wrong"),))
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def cpu_per_request(head: HeadProcess, request: Callable[[], object], count: int) -> tuple[float, list[object]]:
    before = head_cpu_seconds(head)
    answers = [request() for _ in range(count)]
    return (head_cpu_seconds(head) - before) / count, answers


def test_an_unauthenticated_connect_request_costs_no_more_than_a_grpc_one(tmp_path: Path) -> None:
    with connect_head(tmp_path, TOKEN) as (head, port):
        count = 200  # ~1 ms of head CPU each: ~20 clock ticks per measure
        grpc_cost, codes = cpu_per_request(head, lambda: unauthenticated_grpc_call(head.address), count)
        assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}
        connect_cost, statuses = cpu_per_request(head, lambda: connect_post(port, BOMB, gzipped=True), count)
        assert set(statuses) == {401}  # refused from its headers: the body is never inflated
        # Inflating and parsing each bomb cost ~100x a refused gRPC call before; a refusal costs about one now.
        assert connect_cost <= 3 * grpc_cost + 0.0005, (connect_cost, grpc_cost)
    log = head.stderr_text
    assert "Traceback" not in log and log.count("missing or invalid bearer token") <= 2, log


@contextmanager
def attacking(request: Callable[[], object], answers: list[object]) -> Iterator[None]:
    """ATTACKERS threads sending `request` in a loop until the block ends (and at most ATTACK_SECONDS + 10 s)."""
    stop = threading.Event()
    deadline = time.monotonic() + ATTACK_SECONDS + 10

    def loop() -> None:
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                answers.append(request())
            except OSError as exc:
                answers.append(type(exc).__name__)

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(ATTACKERS)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.3)
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=20)


def p50_of_calls(client: SyncControlClient, seconds: float) -> float:
    latencies = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        client.list_server_statuses(timeout=30)
        latencies.append(time.perf_counter() - started)
    return statistics.median(latencies)


def test_request_bodies_cannot_take_the_loop_of_a_head_without_a_token(tmp_path: Path) -> None:
    """Anyone may call a head without a token: its bodies are bounded (a bomb stops inflating at 64 KiB) and
    their decoding is budgeted, so a flood of them slows gRPC callers no more than a flood of gRPC calls does."""
    with connect_head(tmp_path, None) as (head, port):
        assert connect_post(port, BOMB, gzipped=True) == 429  # RESOURCE_EXHAUSTED: too large once inflated
        client = SyncControlClient(head.address, timeout_seconds=30.0)
        p50_of_calls(client, 0.5)  # warm
        body = many_keys()
        under_grpc_flood: list[float] = []
        under_connect_flood: list[float] = []
        connect_flood: list[object] = []
        for _ in range(ROUNDS):  # the floods alternate, so load from outside the test falls on both alike
            with attacking(lambda: unauthenticated_grpc_call(head.address), []):
                under_grpc_flood.append(p50_of_calls(client, ATTACK_SECONDS / ROUNDS))
            with attacking(lambda: connect_post(port, body, gzipped=False), connect_flood):
                under_connect_flood.append(p50_of_calls(client, ATTACK_SECONDS / ROUNDS))
        assert 429 in connect_flood, set(connect_flood)  # the budget refused some before reading them
        p50_under_grpc_flood = statistics.median(under_grpc_flood)
        p50_under_connect_flood = statistics.median(under_connect_flood)
        assert p50_under_connect_flood <= 4 * p50_under_grpc_flood + 0.02, (under_connect_flood, under_grpc_flood)
    assert "Traceback" not in head.stderr_text
