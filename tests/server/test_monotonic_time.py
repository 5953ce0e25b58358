"""The head's schedules run on the monotonic clock (issue 26, point 5): a `gym-rpc head` whose wall clock is
stepped an hour back keeps probing, and one stepped an hour forward keeps a renewing registration, while expiry
still drops one that stops renewing.

The head runs under libfaketime (Debian's `libfaketime`, which .ci/run installs), whose offset file is rewritten
while the head runs: its wall clock steps as an NTP correction or an operator's `date -s` would step it, and its
monotonic clock is left alone (FAKETIME_DONT_FAKE_MONOTONIC).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gym_rpc.client.control._clients import ControlClient
from tests.support.cli import HeadProcess, running_head, threaded_http_server
from tests.support.documents import document, server_entry
from tests.support.loopback import closed_port

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
HOUR = 3600.0


class FakeWallClock:
    """libfaketime's settings for a subprocess, with an offset file that `step` rewrites."""

    def __init__(self, directory: Path) -> None:
        self.file = directory / "faketime.rc"
        self.file.write_text("+0\n", encoding="ascii")
        self.env = {
            "LD_PRELOAD": str(LIBFAKETIME),
            "FAKETIME_TIMESTAMP_FILE": str(self.file),
            "FAKETIME_CACHE_DURATION": "1",  # the file is read again at most a second after it changes
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }

    def step(self, seconds: float) -> None:
        self.file.write_text(f"{seconds:+.0f}\n", encoding="ascii")


@pytest.fixture
def fake_clock(tmp_path: Path) -> Iterator[FakeWallClock]:
    if not LIBFAKETIME.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{LIBFAKETIME} is missing: .ci/run installs Debian's libfaketime")
        pytest.skip(f"needs Debian's libfaketime ({LIBFAKETIME}): apt-get install libfaketime")
    yield FakeWallClock(tmp_path)


def write_config(tmp_path: Path, servers: dict[str, dict]) -> Path:
    path = tmp_path / "gym.yaml"
    path.write_text(yaml.safe_dump(document(servers)), encoding="utf-8")
    return path


async def head_wall_clock_offset(client: ControlClient) -> float:
    """How far the head's wall clock is from ours: the head's own report is stamped with its time.time()."""
    report = await client.get_server_status("head_server", timeout=10)
    return report.checked_at - time.time()


async def wait_until_stepped(client: ControlClient, seconds: float, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while abs(await head_wall_clock_offset(client) - seconds) > 60:
        assert time.monotonic() < deadline, "the head's wall clock never stepped"
        await asyncio.sleep(0.2)


async def wait_for_status(client: ControlClient, name: str, status: str, timeout: float) -> float:
    """Seconds until `name` is listed with `status` (ListServerStatuses: the prober's cache, no probe of its own);
    fails after `timeout`."""
    started = time.monotonic()
    while True:
        listed = {r.server_name: r.status for r in (await client.list_server_statuses(timeout=10)).reports}
        if listed[name] == status:
            return time.monotonic() - started
        assert time.monotonic() - started < timeout, f"{name} still {listed[name]}, not {status}, after {timeout}s"
        await asyncio.sleep(0.1)


async def test_a_wall_clock_stepped_back_an_hour_does_not_stop_the_prober(tmp_path, fake_clock) -> None:
    with threaded_http_server() as server:
        config = write_config(tmp_path, {"policy": server_entry(server.port)})
        with running_head(config, env=fake_clock.env) as head:
            client = ControlClient(head.address)
            await wait_for_status(client, "policy", "success", timeout=20)
            fake_clock.step(-HOUR)
            await wait_until_stepped(client, -HOUR)
            server.stop()  # the server dies after the step: only a prober still probing can tell
            # Probes every 0.1 s: a second or two on a loaded machine; a prober stopped by the step never sees it.
            await wait_for_status(client, "policy", "connection_error", timeout=20)


async def renew_until(client: ControlClient, stop: asyncio.Event, port: int, seconds_between: float) -> None:
    """Register `policy` with a one-second lease every `seconds_between`, as the registration helpers renew."""
    while not stop.is_set():
        await client.register_server_instance(
            "policy", listen_port=port, listen_host="0.0.0.0", pid=4242, lease_seconds=1.0, timeout=5
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds_between)


def expiry_lines(head: HeadProcess) -> list[str]:
    return [line for line in head.stderr_text.splitlines() if "lease of pid 4242 expired" in line]


async def test_a_wall_clock_stepped_forward_an_hour_keeps_a_renewing_lease(tmp_path, fake_clock) -> None:
    config = write_config(tmp_path, {"policy": server_entry(closed_port(), host="0.0.0.0")})
    with running_head(config, env=fake_clock.env) as head:
        client = ControlClient(head.address)
        stop = asyncio.Event()
        renewing = asyncio.create_task(renew_until(client, stop, closed_port(), seconds_between=0.25))
        try:
            await asyncio.sleep(1.0)
            fake_clock.step(+HOUR)
            await wait_until_stepped(client, +HOUR)
            await asyncio.sleep(3.0)  # a dozen sweeps: each would drop the lease, were it timed by the wall clock
            assert expiry_lines(head) == []
            (row,) = [i for i in await client.list_server_instances(timeout=10) if i.name == "policy"]
            assert row.pid == 4242 and row.advertised_url
        finally:
            stop.set()
            await renewing
        # Expiry itself still works under the stepped clock: unrenewed, the lease ends about a second later.
        deadline = time.monotonic() + 20
        while not expiry_lines(head):
            assert time.monotonic() < deadline, f"the unrenewed lease never expired:\n{head.stderr_text}"
            await asyncio.sleep(0.1)
