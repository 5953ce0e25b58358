"""Quiet under bad input (issue 43, point 7), against a real `gym-rpc head`: 4,500 malformed requests (a bad
Content-Length, a broken chunk, bytes that are no HTTP) to NeMo Gym's HTTP head port, the metrics port and the
Connect port, from one client, each answered 400, log a line per port per window (no traceback, no ERROR) and are
all counted in gym_head_bad_requests_total; the head serves on."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from pathlib import Path

import yaml

from gym_rpc.server.observability._quiet_http_log import BAD_REQUEST_WINDOW_SECONDS
from tests.support.cli import running_head
from tests.support.documents import server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.metrics import HTTP_HEAD_PATTERN, METRICS_PATTERN, announced, scrape, value

MALFORMED = (
    b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: x\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GARBAGE\r\n\r\n",
)
PER_PORT = 1500
# Each of ours is counted once, and a few more may come from elsewhere: the ports are numbers that other processes
# of this shared machine may still dial (soak run 3 of 2026-12-06, two whole suites at once: 1,501 on the HTTP head
# port). Each request counted twice would make 3,000; 54,000 sent to one head at load 14 were counted exactly.
STRAYS = 3


def _status_of(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as response:
        return int(response.status)


async def _send(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        writer.write(payload)
        await writer.drain()
        return await reader.read(64)
    finally:
        writer.close()


async def test_malformed_requests_are_counted_and_logged_once_per_window(tmp_path: Path) -> None:
    path = tmp_path / "gym.yaml"
    doc = {
        "head_server": {"host": LOOPBACK, "port": 0, "http_port": 0, "connect_port": 0},
        "policy": server_entry(closed_port()),
    }
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    with running_head(path, "--metrics-port", "0") as head:
        http = announced(head, HTTP_HEAD_PATTERN)
        metrics = announced(head, METRICS_PATTERN)
        connect = re.search(r"Connect on (http://\S+?)(?:[;\s]|$)", head.banner)
        assert connect, head.banner
        ports = [
            int(http.rsplit(":", 1)[1]),
            int(metrics.rsplit(":", 1)[1].split("/", 1)[0]),
            int(connect.group(1).rsplit(":", 1)[1]),
        ]
        started = time.monotonic()
        for port in ports:
            for start in range(0, PER_PORT, 100):
                answers = await asyncio.gather(
                    *(_send(port, MALFORMED[i % len(MALFORMED)]) for i in range(start, start + 100))
                )
                assert all(answer.startswith(b"HTTP/1.") and b" 400 " in answer for answer in answers), answers[0]
        windows = 1 + int((time.monotonic() - started) // BAD_REQUEST_WINDOW_SECONDS)  # 1 unless very loaded
        samples = await asyncio.to_thread(scrape, metrics)
        for name in ("http", "metrics", "connect"):
            counted = value(samples, "gym_head_bad_requests_total", gym_port=name)
            assert counted is not None and PER_PORT <= counted <= PER_PORT + STRAYS, (name, counted)
        assert await asyncio.to_thread(_status_of, f"{http}/") == 200  # the head serves on
        head.process.terminate()
        head.process.wait(timeout=30)
        log = head.stderr_text
    lines = [line for line in log.splitlines() if "malformed request" in line or "connect port: " in line]
    for name in ("http port", "metrics port", "connect port"):  # a line per port per window with bad requests
        assert 1 <= sum(name in line for line in lines) <= windows + 1, lines
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert len(log) < 20_000  # 3,000 of aiohttp's tracebacks were 1.67 MB
