"""`python -m bench.scale` (what `make bench-scale` runs): how one head's costs grow with servers, watchers and
pollers, written to bench/SCALE.md. Everything on loopback, bounded, in a few minutes.

* servers N: one head (its own process) per N over N listeners of one servers process; ListServerStatuses
  latency, head RSS, head CPU while idle (nothing but the background prober) at the default probe interval;
  and at the largest N, GetGlobalConfig with the caller's (unchanged) version against the whole document.
* watchers W: W status watches on one head; a listener is stopped and started again, and each watcher's time
  from the head recording the change to hearing of it (fan-out), and from the kill to hearing of it (including
  the probe interval that detection takes) is recorded; head RSS per watcher.
* pollers P: P concurrent status pollers of one server in a closed loop, through the head (GetServerStatus
  with the head's freshness window) against the same P pollers probing the server directly with a fresh
  connection per poll (what NeMo Gym's poll_for_status does); status calls per second and the probes the
  server actually received.

`--quick` runs tiny sizes (the smoke test uses it) and writes no file unless `--out` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import AsyncGenerator, Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp
import grpc

from bench.scale_procs import Child
from bench.stats import median, percentile
from gym_rpc.client import SyncControlClient
from gym_rpc.client.control._channel import close_aio_channels
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.v1 import control_plane_pb2_grpc as pb_grpc

SCALE_PATH = Path(__file__).resolve().parent / "SCALE.md"
LOOPBACK = "127.0.0.1"
STREAMS_PER_CHANNEL = 100  # the head allows 128 concurrent streams per connection
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ScalePlan:
    servers: tuple[int, ...] = (10, 100, 1000)
    watchers: tuple[int, ...] = (1, 100, 1000)
    pollers: tuple[int, ...] = (1, 100, 1000)
    probe_interval: float = 2.0  # the head's default
    idle_seconds: float = 10.0  # five probe rounds (the head's CPU is read in 10 ms ticks)
    list_calls: int = 40
    config_pairs: int = 40
    watch_rounds: int = 3  # each round: one death and one recovery
    poll_seconds: float = 3.0
    storm_watchers: tuple[int, ...] = (500, 1000, 2000)
    watcher_processes: int = 4  # the storm's watchers come from this many processes
    storm_instances: int = 100  # registered instances the storm relabels
    storm_changes: int = 500  # registrations that each change one instance, sent as fast as the head takes them
    storm_rounds: int = 3
    follower_instances: int = 2000  # each change of the flooding head relabels this many instances
    follower_seconds: float = 3.0
    follower_rounds: int = 3
    fleet_watchers: tuple[int, ...] = (1000,)  # `--only fleet`: memory and CPU per watcher at these W
    fleet_per_process: int = 250  # watches per watcher process
    fleet_pushes: int = 20  # relabels, each pushed on its own (spaced past the head's 50 ms quiet)
    fleet_spacing: float = 0.2
    fleet_instances: int = 10
    # `--only fleet-storms`: storms of `fleet_storm_changes` registrations offered within `fleet_storm_seconds`
    fleet_storm_watchers: tuple[int, ...] = (1000,)
    fleet_storm_changes: int = 1000
    fleet_storm_seconds: float = 1.0
    fleet_storm_rounds: int = 3
    fleet_storm_registrars: int = 2  # registering processes, each sending its share of the storm on time
    fleet_storm_connections: int = 8  # connections per registering process (the head takes 128 streams on one)
    # `--only fleet-storms`: the same storms with the W watchers behind this many watch relays (gym-rpc relay, one
    # per simulated node), W / relays each; 0: no relayed row
    fleet_storm_relays: int = 40


FULL = ScalePlan()
QUICK = ScalePlan(
    servers=(3, 6),
    watchers=(1, 4),
    pollers=(1, 4),
    probe_interval=0.5,
    idle_seconds=1.0,
    list_calls=5,
    config_pairs=5,
    watch_rounds=1,
    poll_seconds=0.5,
    storm_watchers=(4, 8),
    watcher_processes=2,
    storm_instances=5,
    storm_changes=20,
    storm_rounds=1,
    follower_instances=50,
    follower_seconds=0.5,
    follower_rounds=1,
    fleet_watchers=(8,),
    fleet_per_process=4,
    fleet_pushes=3,
    fleet_storm_watchers=(8,),
    fleet_storm_changes=20,
    fleet_storm_seconds=0.2,
    fleet_storm_rounds=1,
    fleet_storm_relays=2,
)


# --- /proc readings ----------------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# --- heads -------------------------------------------------------------------------------------------------------


def config_document(ports: list[int]) -> dict[str, Any]:
    servers = {
        f"server_{i:04d}": {
            "resources_servers": {"bench": {"host": LOOPBACK, "port": port, "api_key": "sk-bench"}}
        }
        for i, port in enumerate(ports)
    }
    # The storms register as fast as the head takes them, from one address: no rate limit of the head's in the way.
    registration = {"registrations_per_second": 1e9, "registration_burst": 1_000_000}
    return {"head_server": {"host": LOOPBACK, "port": 0, "registration": registration}, **servers}


@contextmanager
def running_head(ports: list[int], plan: ScalePlan, **options: Any) -> Iterator[Child]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(config_document(ports)), encoding="utf-8")
        head_options = {"port": 0, "probe_interval_seconds": plan.probe_interval, **options}
        head = Child("head", str(path), json.dumps(head_options))
        try:
            yield head
        finally:
            head.stop()


def wait_until_probed(address: str, timeout: float) -> None:
    client = SyncControlClient(address, timeout_seconds=10)
    deadline = time.monotonic() + timeout
    while not all(r.status is not None for r in client.list_server_statuses().reports):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the head at {address} did not probe every server within {timeout}s")
        time.sleep(0.1)


_connections = itertools.count()


def channels(address: str, streams: int, per_channel: int = STREAMS_PER_CHANNEL) -> list[grpc.aio.Channel]:
    """Enough connections for `streams` concurrent streams. Each channel gets an argument no other has: gRPC
    shares one connection between channels with equal arguments, and the head queues streams past 128 on one."""
    count = max(1, math.ceil(streams / per_channel))
    return [
        grpc.aio.insecure_channel(
            address, options=[("grpc.enable_http_proxy", 0), ("bench.connection", next(_connections))]
        )
        for _ in range(count)
    ]


# --- servers -----------------------------------------------------------------------------------------------------


@dataclass
class ServersRow:
    servers: int
    list_p50_ms: float
    rss_mib: float
    idle_cpu_percent: float


@dataclass
class ConfigRow:
    servers: int
    full_p50_ms: float
    unchanged_p50_ms: float
    full_bytes: int
    unchanged_bytes: int


def measure_servers(ports: list[int], plan: ScalePlan) -> tuple[list[ServersRow], ConfigRow]:
    rows: list[ServersRow] = []
    config_row: ConfigRow | None = None
    for n in plan.servers:
        with running_head(ports[:n], plan) as head:
            address = head.info["address"]
            wait_until_probed(address, 60)
            latencies = list_latencies(address, plan.list_calls)
            started_cpu, started = cpu_seconds(head.pid), time.monotonic()
            time.sleep(plan.idle_seconds)
            idle = (cpu_seconds(head.pid) - started_cpu) / (time.monotonic() - started) * 100
            rows.append(ServersRow(n, median(latencies) * 1e3, rss_mib(head.pid), idle))
            print(f"  servers N={n}: {rows[-1]}", file=sys.stderr)
            if n == max(plan.servers):
                config_row = measure_config(address, n, plan)
    assert config_row is not None
    return rows, config_row


def list_latencies(address: str, calls: int) -> list[float]:
    """ListServerStatuses as the head answers it (protobuf on the wire, no client-side conversion)."""
    latencies = []
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = pb_grpc.ControlPlaneServiceStub(channel)
        for _ in range(calls):
            started = time.perf_counter()
            stub.ListServerStatuses(pb.ListServerStatusesRequest(), timeout=10)
            latencies.append(time.perf_counter() - started)
    return latencies


def measure_config(address: str, n: int, plan: ScalePlan) -> ConfigRow:
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        return _config_row(pb_grpc.ControlPlaneServiceStub(channel), n, plan)


def _config_row(stub: pb_grpc.ControlPlaneServiceStub, n: int, plan: ScalePlan) -> ConfigRow:
    full = stub.GetGlobalConfig(pb.GetGlobalConfigRequest(), timeout=10)
    unchanged_request = pb.GetGlobalConfigRequest(known_version=full.version)
    unchanged = stub.GetGlobalConfig(unchanged_request, timeout=10)
    assert unchanged.unchanged and not unchanged.config_json
    full_times, unchanged_times = [], []
    for _ in range(plan.config_pairs):  # interleaved, so noise hits both alike
        started = time.perf_counter()
        stub.GetGlobalConfig(pb.GetGlobalConfigRequest(), timeout=10)
        full_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        stub.GetGlobalConfig(unchanged_request, timeout=10)
        unchanged_times.append(time.perf_counter() - started)
    row = ConfigRow(
        n, median(full_times) * 1e3, median(unchanged_times) * 1e3, full.ByteSize(), unchanged.ByteSize()
    )
    print(f"  config N={n}: {row}", file=sys.stderr)
    return row


# --- watchers ----------------------------------------------------------------------------------------------------


@dataclass
class WatchRow:
    watchers: int
    fanout_ms: list[float] = field(default_factory=list)  # change recorded -> each watcher heard it
    last_fanout_ms: list[float] = field(default_factory=list)  # per change: the last watcher
    death_to_last_ms: list[float] = field(default_factory=list)  # per death: kill -> the last watcher heard it
    rss_mib: float = math.nan
    head_cpu_us: float = math.nan  # head CPU per change per watcher, above its idle rate
    client_cpu_us: float = math.nan  # the watchers' process CPU per change per watcher, above its idle rate


def cpu_both(head_pid: int) -> tuple[float, float]:
    """CPU seconds so far of the head and of this process (every thread: gRPC's pollers included)."""
    return cpu_seconds(head_pid), time.process_time()


async def idle_cpu_rates(head_pid: int, seconds: float) -> tuple[float, float]:
    """CPU seconds per second the head and this process use while nothing changes (probes, heartbeats)."""
    before, started = cpu_both(head_pid), time.monotonic()
    await asyncio.sleep(seconds)
    after, elapsed = cpu_both(head_pid), time.monotonic() - started
    return (after[0] - before[0]) / elapsed, (after[1] - before[1]) / elapsed


class Watchers:
    """W status watches; each records when it hears `server_0000` reach a status."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.heard: dict[str, list[tuple[float, float]]] = {}  # status -> [(received, checked_at)]
        self.tasks: list[asyncio.Task[None]] = []
        self.channels: list[grpc.aio.Channel] = []
        self.ready = 0
        self.errors: list[str] = []

    async def add(self, count: int) -> None:
        new = channels(self.address, count)
        self.channels += new
        for i in range(count):
            self.tasks.append(asyncio.create_task(self._watch(new[i % len(new)])))
        deadline = time.monotonic() + 120
        while self.ready < len(self.tasks):
            if time.monotonic() > deadline or self.errors:
                raise RuntimeError(f"only {self.ready} of {len(self.tasks)} watches started: {self.errors[:3]}")
            await asyncio.sleep(0.05)

    async def _watch(self, channel: grpc.aio.Channel) -> None:
        stub = pb_grpc.ControlPlaneServiceStub(channel)
        request = pb.WatchServerStatusesRequest()
        request.heartbeat_interval.FromSeconds(60)
        stream = cast(AsyncGenerator[pb.WatchServerStatusesResponse, None], stub.WatchServerStatuses(request))
        try:
            await self._follow(stream)
        except grpc.aio.AioRpcError as error:
            self.errors.append(f"{error.code().name}: {error.details()}")

    async def _follow(self, stream: AsyncGenerator[pb.WatchServerStatusesResponse, None]) -> None:
        first = True
        async for message in stream:
            received = time.time()
            if first:
                self.ready += 1
                first = False
                continue
            for report in message.reports:
                if report.server_name == "server_0000":
                    status = pb.ServerStatus.Name(report.status)
                    checked_at = report.checked_at.ToNanoseconds() / 1e9
                    self.heard.setdefault(status, []).append((received, checked_at))

    async def wait_heard(self, status: str, count: int, timeout: float) -> list[tuple[float, float]]:
        deadline = time.monotonic() + timeout
        while len(self.heard.get(status, [])) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(self.heard.get(status, []))} of {count} watchers heard {status}")
            await asyncio.sleep(0.01)
        return self.heard.pop(status)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for channel in self.channels:
            await channel.close(None)


async def measure_watchers(servers: Child, ports: list[int], plan: ScalePlan) -> list[WatchRow]:
    rows: list[WatchRow] = []
    most = max(plan.watchers) + 10  # every watcher comes from one address: lift the per-peer cap too
    with running_head(ports[:10], plan, max_concurrent_watches=most, max_watches_per_peer=most) as head:
        address = head.info["address"]
        await asyncio.to_thread(wait_until_probed, address, 60)
        watchers = Watchers(address)
        try:
            for w in plan.watchers:
                await watchers.add(w - len(watchers.tasks))
                row = WatchRow(w, rss_mib=rss_mib(head.pid))
                idle = await idle_cpu_rates(head.pid, plan.idle_seconds / 2)
                cpu_before, started = cpu_both(head.pid), time.monotonic()
                for _ in range(plan.watch_rounds):
                    for command, status in (
                        ("stop 0", "SERVER_STATUS_CONNECTION_ERROR"),
                        ("start 0", "SERVER_STATUS_SUCCESS"),
                    ):
                        acted_at = time.time()
                        await asyncio.to_thread(servers.ask, command)
                        heard = await watchers.wait_heard(status, w, timeout=plan.probe_interval * 3 + 30)
                        fanouts = [(received - checked_at) * 1e3 for received, checked_at in heard]
                        row.fanout_ms += fanouts
                        row.last_fanout_ms.append(max(fanouts))
                        if command.startswith("stop"):
                            row.death_to_last_ms.append((max(r for r, _ in heard) - acted_at) * 1e3)
                cpu_after, elapsed = cpu_both(head.pid), time.monotonic() - started
                changes = 2 * plan.watch_rounds
                row.head_cpu_us, row.client_cpu_us = (
                    (cpu_after[i] - cpu_before[i] - idle[i] * elapsed) / changes / w * 1e6 for i in (0, 1)
                )
                rows.append(row)
                print(
                    f"  watchers W={w}: fan-out p50 {median(row.fanout_ms):.1f} ms, "
                    f"p99 {percentile(row.fanout_ms, 0.99):.1f} ms, last {median(row.last_fanout_ms):.1f} ms",
                    file=sys.stderr,
                )
        finally:
            await watchers.close()
    return rows


# --- pollers -----------------------------------------------------------------------------------------------------


@dataclass
class PollRow:
    pollers: int
    head_calls_per_second: float
    head_probes_per_second: float
    direct_calls_per_second: float
    direct_probes_per_second: float
    window_seconds: float
    head_refused: int = 0  # calls the head refused (UNAVAILABLE), not counted as calls

    @property
    def head_probes_per_window(self) -> float:
        return self.head_probes_per_second * self.window_seconds


async def _closed_loop(pollers: int, seconds: float, call: Any) -> int:
    """`pollers` tasks calling `call()` back to back for `seconds`; the number of calls that completed."""
    done = 0
    stop_at = time.monotonic() + seconds

    async def poller(index: int) -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            await call(index)
            done += 1

    await asyncio.gather(*(poller(i) for i in range(pollers)))
    return done


async def _head_poll(address: str, pollers: int, request: pb.GetServerStatusRequest) -> Any:
    """One status call through the head; poller i always uses connection i % n, so no connection carries more
    concurrent calls than the head's 128 streams (connected first, so the head's limits are known)."""
    # Half the head's stream limit per connection: calls back to back briefly overlap ended streams the head has
    # not reaped yet, and a stream past the limit is refused (RST_STREAM REFUSED_STREAM).
    connections = channels(address, pollers, per_channel=50)
    for channel in connections:
        await asyncio.wait_for(channel.channel_ready(), 30)
    stubs = [pb_grpc.ControlPlaneServiceStub(c) for c in connections]

    async def via_head(index: int) -> None:
        try:
            await stubs[index % len(stubs)].GetServerStatus(request, timeout=30)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            REFUSED[0] += 1  # counted, and this poll is not: the loop asks again

    return via_head


REFUSED = [0]  # head calls refused with UNAVAILABLE during the pollers' runs


async def measure_pollers(servers: Child, ports: list[int], plan: ScalePlan) -> list[PollRow]:
    rows: list[PollRow] = []
    target, url = "server_0000", f"http://{LOOPBACK}:{ports[0]}/"
    with running_head(ports[:10], plan) as head:
        address = head.info["address"]
        await asyncio.to_thread(wait_until_probed, address, 60)
        window = plan.probe_interval / 2  # the head's default freshness window
        for p in plan.pollers:
            via_head = await _head_poll(address, p, pb.GetServerStatusRequest(server_name=target))

            before = (await asyncio.to_thread(servers.ask, "counts"))[0]
            started = time.monotonic()
            refused_before = REFUSED[0]
            head_calls = await _closed_loop(p, plan.poll_seconds, via_head) - (REFUSED[0] - refused_before)
            head_elapsed = time.monotonic() - started
            head_probes = (await asyncio.to_thread(servers.ask, "counts"))[0] - before

            # NeMo Gym's poll_for_status: a plain GET of the server per poll, a fresh connection each time.
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:

                async def direct(index: int) -> None:
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as response:
                        await response.read()

                before = (await asyncio.to_thread(servers.ask, "counts"))[0]
                started = time.monotonic()
                direct_calls = await _closed_loop(p, plan.poll_seconds, direct)
                direct_elapsed = time.monotonic() - started
                direct_probes = (await asyncio.to_thread(servers.ask, "counts"))[0] - before
            rows.append(
                PollRow(
                    p,
                    head_calls / head_elapsed,
                    head_probes / head_elapsed,
                    direct_calls / direct_elapsed,
                    direct_probes / direct_elapsed,
                    window,
                    REFUSED[0] - refused_before,
                )
            )
            print(f"  pollers P={p}: {rows[-1]}", file=sys.stderr)
            await close_aio_channels()
    return rows


# --- change storms ----------------------------------------------------------------------------------------------


@dataclass
class StormRow:
    watchers: int
    coalesced: bool
    storm_seconds: list[float] = field(default_factory=list)  # per round: first registration sent -> last answered
    last_after_ms: list[float] = field(default_factory=list)  # per round: storm's end -> the last watcher current
    messages: list[float] = field(default_factory=list)  # per round: the median watcher's messages
    head_cpu_us: float = math.nan  # head CPU per watcher per message, above its idle rate
    rss_kib_per_watcher: float = math.nan
    missing: int = 0  # watchers never current within the bound


async def _storm(address: str, ports: list[int], plan: ScalePlan, base: int) -> tuple[float, float]:
    """`plan.storm_changes` registrations, 8 in flight at a time, each relabelling instance k % storm_instances
    with step base + k; (started, ended) in time.time()."""
    from gym_rpc.client import ControlClient

    client = ControlClient(address, timeout_seconds=30)
    instances = ports[10 : 10 + plan.storm_instances]
    queue = iter(range(plan.storm_changes))

    async def sender() -> None:
        for k in queue:
            await client.register_instance(
                "server_0000",
                listen_port=instances[k % len(instances)],
                listen_host=LOOPBACK,
                pid=100000 + k % len(instances),
                labels={"step": str(base + k)},
            )

    started = time.time()
    await asyncio.gather(*(sender() for _ in range(8)))
    return started, time.time()


async def measure_storms(ports: list[int], plan: ScalePlan) -> list[StormRow]:
    rows: list[StormRow] = []
    runs = [(w, True) for w in plan.storm_watchers] + [(plan.storm_watchers[0], False)]
    for w, coalesced in runs:
        options: dict[str, Any] = {"max_concurrent_watches": w + 100, "max_watches_per_peer": w + 100}
        if not coalesced:
            options["push_quiet_seconds"] = 0.0  # every change pushed on its own: the head before coalescing
        with running_head(ports[:10], plan, **options) as head:
            address = head.info["address"]
            await asyncio.to_thread(wait_until_probed, address, 60)
            await _storm(address, ports, plan, 0)  # the instances registered, before the watchers come
            await asyncio.sleep(1.0)
            row = StormRow(w, coalesced)
            rss_before = rss_mib(head.pid)
            share = w // plan.watcher_processes
            counts = [share + (1 if i < w % plan.watcher_processes else 0) for i in range(plan.watcher_processes)]
            children = await asyncio.gather(
                *(asyncio.to_thread(Child, "watchers", address, str(n), ready_timeout=600) for n in counts if n)
            )
            try:
                await asyncio.sleep(2.0)
                row.rss_kib_per_watcher = (rss_mib(head.pid) - rss_before) * 1024 / w
                idle, _ = await idle_cpu_rates(head.pid, plan.idle_seconds / 2)
                cpu_before, started = cpu_seconds(head.pid), time.monotonic()
                total_messages = 0.0
                for round_index in range(plan.storm_rounds):
                    base = (round_index + 1) * plan.storm_changes
                    target = base + plan.storm_changes - 1
                    for child in children:
                        await asyncio.to_thread(child.ask, f"target {target}")
                    storm_started, storm_ended = await _storm(address, ports, plan, base)
                    answers = [await asyncio.to_thread(child.ask, "wait 120", 150) for child in children]
                    print(f"    round {round_index}: {[a['missing'] for a in answers]} missing", file=sys.stderr)
                    row.missing += sum(a["missing"] for a in answers)
                    lasts = [a["last"] for a in answers if a["last"] is not None]
                    row.storm_seconds.append(storm_ended - storm_started)
                    row.last_after_ms.append((max(lasts) - storm_ended) * 1e3)
                    per_watcher = [m for a in answers for m in a["messages"]]
                    row.messages.append(median(per_watcher))
                    total_messages += sum(per_watcher)
                cpu = cpu_seconds(head.pid) - cpu_before - idle * (time.monotonic() - started)
                row.head_cpu_us = cpu / max(total_messages, 1) * 1e6
            finally:
                for child in children:
                    child.stop()
            rows.append(row)
            print(f"  storm W={w} coalesced={coalesced}: {row}", file=sys.stderr)
    return rows


# --- watchers at fleet size: memory and CPU per watcher ---------------------------------------------------------


@dataclass
class FleetRow:
    watchers: int
    server: str  # "gym_rpc head" or "bare grpc.aio"
    connect_seconds: float = math.nan  # from the first watcher process started to the last one's streams all open
    rss_kib_per_watcher: float = math.nan  # the server's RSS growth while the watchers connected, per watcher
    cpu_us_per_message: float = math.nan  # server CPU per watcher per push: above idle, the changes' own cost off
    alone_ms_per_change: float = math.nan  # the head's CPU per change with no watcher (the cost taken off)
    messages: int = 0
    missing: int = 0  # watchers that never had the last push


async def _relabels(client: Any, instances: list[int], plan: ScalePlan, base: int) -> None:
    """`plan.fleet_pushes` registrations one after another, `fleet_spacing` apart (each pushed on its own), each
    relabelling instance k % len(instances) with step base + k."""
    for k in range(plan.fleet_pushes):
        await client.register_instance(
            "server_0000",
            listen_port=instances[k % len(instances)],
            listen_host=LOOPBACK,
            pid=200000 + k % len(instances),
            labels={"step": str(base + k)},
        )
        await asyncio.sleep(plan.fleet_spacing)


WATCHER_PROCESSES_AT_ONCE = 4


async def _connect_watchers(address: str, w: int, plan: ScalePlan, *mode: str) -> tuple[list[Child], float]:
    counts = [plan.fleet_per_process] * (w // plan.fleet_per_process)
    if w % plan.fleet_per_process:
        counts.append(w % plan.fleet_per_process)
    # A few processes at a time: started all at once (six or more here), every stream of some came back
    # CANCELLED before its first message, against a bare grpc.aio server too.
    started, children = time.monotonic(), []
    for first in range(0, len(counts), WATCHER_PROCESSES_AT_ONCE):
        batch = counts[first : first + WATCHER_PROCESSES_AT_ONCE]
        children += await asyncio.gather(
            *(asyncio.to_thread(Child, "watchers", address, str(n), *mode, ready_timeout=1800) for n in batch)
        )
    return children, time.monotonic() - started


async def _pushed_to_all(children: list[Child], target: int, push: Awaitable[None]) -> tuple[int, int]:
    for child in children:
        await asyncio.to_thread(child.ask, f"target {target}")
    await push
    answers = [await asyncio.to_thread(child.ask, "wait 300", 400) for child in children]
    return sum(sum(a["messages"]) for a in answers), sum(a["missing"] for a in answers)


async def _bare_pushes(bare: Child, plan: ScalePlan) -> None:
    for _ in range(plan.fleet_pushes):
        await asyncio.to_thread(bare.ask, "push")
        await asyncio.sleep(plan.fleet_spacing)


async def measure_fleet(ports: list[int], plan: ScalePlan) -> list[FleetRow]:
    """Per W: the head's RSS per watcher, and its CPU per watcher per push with what the same changes cost it
    with no watcher taken off; then the same on a bare grpc.aio server (the floor under any Python gRPC head)."""
    from gym_rpc.client import ControlClient

    rows: list[FleetRow] = []
    instances = ports[10 : 10 + plan.fleet_instances]
    for w in plan.fleet_watchers:
        caps = {"max_concurrent_watches": w + 100, "max_watches_per_peer": w + 100}
        with running_head(ports[:10], plan, **caps) as head:
            address = head.info["address"]
            await asyncio.to_thread(wait_until_probed, address, 60)
            client = ControlClient(address, timeout_seconds=30)
            await _relabels(client, instances, plan, 0)  # the instances registered, before anything is measured
            row = FleetRow(w, "gym_rpc head")
            idle, _ = await idle_cpu_rates(head.pid, plan.idle_seconds / 2)
            cpu, started = cpu_seconds(head.pid), time.monotonic()
            await _relabels(client, instances, plan, plan.fleet_pushes)
            alone = cpu_seconds(head.pid) - cpu - idle * (time.monotonic() - started)
            row.alone_ms_per_change = alone / plan.fleet_pushes * 1e3
            rss_before = rss_mib(head.pid)
            children, row.connect_seconds = await _connect_watchers(address, w, plan)
            try:
                await asyncio.sleep(2.0)
                row.rss_kib_per_watcher = (rss_mib(head.pid) - rss_before) * 1024 / w
                idle, _ = await idle_cpu_rates(head.pid, plan.idle_seconds / 2)
                cpu, started = cpu_seconds(head.pid), time.monotonic()
                base = 2 * plan.fleet_pushes
                row.messages, row.missing = await _pushed_to_all(
                    children, base + plan.fleet_pushes - 1, _relabels(client, instances, plan, base)
                )
                spent = cpu_seconds(head.pid) - cpu - idle * (time.monotonic() - started) - alone
                row.cpu_us_per_message = spent / max(row.messages, 1) * 1e6
            finally:
                for child in children:
                    child.stop()
            rows.append(row)
            print(f"  fleet W={w}: {row}", file=sys.stderr)
        bare = Child("bare")
        try:
            row = FleetRow(w, "bare grpc.aio")
            rss_before = rss_mib(bare.pid)
            children, row.connect_seconds = await _connect_watchers(bare.info["address"], w, plan)
            try:
                await asyncio.sleep(2.0)
                row.rss_kib_per_watcher = (rss_mib(bare.pid) - rss_before) * 1024 / w
                idle, _ = await idle_cpu_rates(bare.pid, plan.idle_seconds / 2)
                cpu, started = cpu_seconds(bare.pid), time.monotonic()
                row.messages, row.missing = await _pushed_to_all(
                    children, plan.fleet_pushes, _bare_pushes(bare, plan)
                )
                spent = cpu_seconds(bare.pid) - cpu - idle * (time.monotonic() - started)
                row.cpu_us_per_message = spent / max(row.messages, 1) * 1e6
            finally:
                for child in children:
                    child.stop()
            rows.append(row)
            print(f"  fleet W={w}: {row}", file=sys.stderr)
        finally:
            bare.stop()
    return rows


def _fleet_lines(rows: list[FleetRow], plan: ScalePlan, took: float) -> list[str]:
    lines = [
        FLEET_START,
        "## Watchers at fleet size: the head's memory and CPU per watcher",
        "",
        f"W status watches from {plan.fleet_per_process} per process (a connection per 100 streams), the head in "
        f"a process of its own. RSS: the head's growth while the watchers connected, per watcher. CPU: "
        f"{plan.fleet_pushes} relabels of {plan.fleet_instances} registered instances, {plan.fleet_spacing:g} s "
        "apart (each pushed on its own), the head's CPU above its idle rate, less what the same relabels cost it "
        "with no watcher (measured just before), per message the watchers received. The bare grpc.aio row is "
        "the floor under any Python gRPC head: a server with no interceptor, no slot and no stall bound whose "
        "streams each wait on one shared future and write a pre-serialised message.",
        "",
        "| W | server | connecting took | RSS per watcher | CPU per watcher per push | head CPU per change, no "
        "watcher | messages | never current |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        alone = "" if math.isnan(row.alone_ms_per_change) else f"{row.alone_ms_per_change:.2f} ms"
        lines.append(
            f"| {row.watchers} | {row.server} | {row.connect_seconds:.1f} s | {row.rss_kib_per_watcher:.1f} KiB | "
            f"{_above_idle(row.cpu_us_per_message)} | {alone} | {row.messages} | {row.missing} |"
        )
    lines += ["", "| goal | figure | met |", "| --- | --- | --- |"]
    for row in rows:
        if row.server != "gym_rpc head":
            continue
        floor = [r for r in rows if r.watchers == row.watchers and r != row]
        beside = f" (bare gRPC: {floor[0].rss_kib_per_watcher:.1f} KiB)" if floor else ""
        kib = 20 * 1000 / 1024  # 20 KB
        lines.append(
            f"| head RSS <= 20 KB ({kib:.1f} KiB) per watcher at W = {row.watchers} | "
            f"{row.rss_kib_per_watcher:.1f} KiB{beside} | {'yes' if row.rss_kib_per_watcher <= kib else 'NO'} |"
        )
        beside = f" (bare gRPC: {_above_idle(floor[0].cpu_us_per_message)})" if floor else ""
        lines.append(
            f"| head CPU <= 10 µs per watcher per push at W = {row.watchers} | "
            f"{_above_idle(row.cpu_us_per_message)}{beside} | {'yes' if row.cpu_us_per_message <= 10 else 'NO'} |"
        )
    lines += [
        "",
        f"(This section: `python -m bench.scale --only fleet` in {took:.0f} s, load average {load_average()} at "
        "the end.)",
        FLEET_END,
    ]
    return lines


# --- a storm at fleet size: 1,000 changes within a second, W watchers ------------------------------------------


@dataclass
class FleetStormRow:
    watchers: int
    server: str  # "gym_rpc head" or "bare grpc.aio"
    rss_kib_per_watcher: float = math.nan  # the server's RSS growth while the watchers connected, per watcher
    connect_seconds: float = math.nan
    offered_seconds: list[float] = field(default_factory=list)  # per storm: first change sent -> last sent
    storm_seconds: list[float] = field(default_factory=list)  # per storm: first change sent -> last answered
    last_after_ms: list[float] = field(default_factory=list)  # per storm: last answered -> last watcher current
    messages: list[float] = field(default_factory=list)  # per storm: the median watcher's messages
    cpu_us: list[float] = field(default_factory=list)  # per storm: CPU per watcher per message (coalesced push)
    registration_p50_ms: list[float] = field(default_factory=list)
    registration_max_ms: list[float] = field(default_factory=list)
    alone_ms_per_storm: float = math.nan  # the head's CPU for the same storm with no watcher (taken off)
    missing: int = 0  # watchers never current within the bound
    failed: int = 0  # registrations that failed
    unchecked: int = 0  # storms whose checking watchers did not hold the last change's label
    relays: int = 0  # watch relays the watchers follow (0: the head's own watchers)
    relay_cpu_us: list[float] = field(default_factory=list)  # per storm: the relays' CPU per watcher per message
    relay_rss_kib_per_watcher: float = math.nan  # the relays' RSS growth while their watchers connected
    gross_cpu_us: list[float] = field(default_factory=list)  # per storm: cpu_us without the storm's own cost off


async def _registrars(address: str, ports: list[int], plan: ScalePlan) -> list[Child]:
    instances = json.dumps(ports[10 : 10 + plan.storm_instances])
    return list(
        await asyncio.gather(
            *(
                asyncio.to_thread(Child, "registrar", address, str(plan.fleet_storm_connections), instances)
                for _ in range(plan.fleet_storm_registrars)
            )
        )
    )


async def _registrar_storm(registrars: list[Child], plan: ScalePlan, base: int) -> dict[str, Any]:
    """One storm: `fleet_storm_changes` relabels offered evenly over `fleet_storm_seconds` (open loop), shared
    among the registering processes, which start together half a second from now."""
    at = time.time() + 0.5
    count, seconds = plan.fleet_storm_changes, plan.fleet_storm_seconds
    answers = await asyncio.gather(
        *(
            asyncio.to_thread(
                child.ask, f"storm {base} {count} {seconds} {at} {i} {len(registrars)}", 300 + seconds
            )
            for i, child in enumerate(registrars)
        )
    )
    sent = [t for a in answers for t in a["sent"]]
    answered = [t for a in answers for t in a["answered"]]
    latencies = [
        (done - began) * 1e3 for a in answers for began, done in zip(a["sent"], a["answered"], strict=True)
    ]
    failed = sum(a["failed"] for a in answers)
    if failed:
        print(f"    {failed} registrations failed: {[a['errors'] for a in answers]}", file=sys.stderr)
    return {
        "first_sent": min(sent),
        "last_sent": max(sent),
        "last_answered": max(answered),
        "p50_ms": median(latencies),
        "max_ms": max(latencies),
        "failed": failed,
    }


def _head_revision(address: str, step: int) -> tuple[int, bool]:
    """The head's revision now (ListServerStatuses), and whether its server_0000 carries `step`'s label."""
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        answer = pb_grpc.ControlPlaneServiceStub(channel).ListServerStatuses(
            pb.ListServerStatusesRequest(), timeout=60
        )
    steps = {
        instance.labels.get("step")
        for report in answer.reports
        if report.server_name == "server_0000"
        for instance in report.instances
    }
    return answer.revision, str(step) in steps


async def _reached(children: list[Child], revision: int) -> list[dict[str, Any]]:
    return list(
        await asyncio.gather(*(asyncio.to_thread(child.ask, f"reach {revision} 120", 180) for child in children))
    )


def _note_reached(row: FleetStormRow, answers: list[dict[str, Any]], since: float, target_step: int) -> int:
    """Add a storm's delivery to the row: the last watcher's time after `since`, messages; the messages in all."""
    lasts = [a["last"] for a in answers if a["last"] is not None]
    row.missing += sum(a["missing"] for a in answers)
    row.unchecked += int(any(a["best_step"] < target_step for a in answers))
    row.last_after_ms.append((max(lasts) - since) * 1e3 if lasts else math.nan)
    per_watcher = [m for a in answers for m in a["messages"]]
    row.messages.append(median(per_watcher))
    return sum(per_watcher)


async def measure_fleet_storms(ports: list[int], plan: ScalePlan) -> list[FleetStormRow]:
    """Per W: storms of `fleet_storm_changes` registrations offered within `fleet_storm_seconds` to a head with W
    watchers: time from the storm's last answer to the last watcher holding it, the head's CPU per watcher per
    coalesced push (the same storm's cost with no watcher taken off), its RSS per watcher; then a bare grpc.aio
    server pushing as many messages over the same time, the floor under any Python gRPC head."""
    rows: list[FleetStormRow] = []
    settle = _settle(plan)
    for w in plan.fleet_storm_watchers:
        row = FleetStormRow(w, "gym_rpc head")
        caps = {"max_concurrent_watches": w + 100, "max_watches_per_peer": w + 100}
        with running_head(ports[:10], plan, **caps) as head:
            address = head.info["address"]
            await asyncio.to_thread(wait_until_probed, address, 60)
            registrars = await _registrars(address, ports, plan)
            try:
                await _registrar_storm(registrars, plan, 0)  # the instances registered before anything is measured
                await asyncio.sleep(settle)
                idle, _ = await idle_cpu_rates(head.pid, plan.idle_seconds / 2)
                alone = []
                for base in (plan.fleet_storm_changes, 2 * plan.fleet_storm_changes):
                    cpu, started = cpu_seconds(head.pid), time.monotonic()
                    await _registrar_storm(registrars, plan, base)
                    await asyncio.sleep(settle)  # the pushes' timers done
                    alone.append(cpu_seconds(head.pid) - cpu - idle * (time.monotonic() - started))
                row.alone_ms_per_storm = median(alone) * 1e3
                rss_before = rss_mib(head.pid)
                children, row.connect_seconds = await _connect_watchers(address, w, plan, "revisions")
                try:
                    await asyncio.sleep(settle)
                    row.rss_kib_per_watcher = (rss_mib(head.pid) - rss_before) * 1024 / w
                    idle, _ = await idle_cpu_rates(head.pid, plan.idle_seconds / 2)
                    for round_index in range(plan.fleet_storm_rounds):
                        base = (round_index + 3) * plan.fleet_storm_changes
                        for child in children:
                            await asyncio.to_thread(child.ask, "mark")
                        cpu, started = cpu_seconds(head.pid), time.monotonic()
                        storm = await _registrar_storm(registrars, plan, base)
                        target_step = base + plan.fleet_storm_changes - 1
                        revision, holds = await asyncio.to_thread(_head_revision, address, target_step)
                        row.unchecked += int(not holds)
                        answers = await _reached(children, revision)
                        spent = cpu_seconds(head.pid) - cpu - idle * (time.monotonic() - started) - median(alone)
                        total = _note_reached(row, answers, storm["last_answered"], target_step)
                        row.cpu_us.append(spent / max(total, 1) * 1e6)
                        row.offered_seconds.append(storm["last_sent"] - storm["first_sent"])
                        row.storm_seconds.append(storm["last_answered"] - storm["first_sent"])
                        row.registration_p50_ms.append(storm["p50_ms"])
                        row.registration_max_ms.append(storm["max_ms"])
                        row.failed += storm["failed"]
                        print(
                            f"    W={w} storm {round_index}: answered in {row.storm_seconds[-1]:.2f} s, last "
                            f"watcher +{row.last_after_ms[-1]:.0f} ms, {row.messages[-1]:.0f} messages each, "
                            f"{row.cpu_us[-1]:.0f} µs per watcher per message (load {load_average()})",
                            file=sys.stderr,
                        )
                        await asyncio.sleep(settle)
                finally:
                    for child in children:
                        child.stop()
            finally:
                for registrar in registrars:
                    registrar.stop()
        rows.append(row)
        print(f"  fleet storm W={w}: {row}", file=sys.stderr)
        rows.append(await _bare_storms(w, row, plan))
        if plan.fleet_storm_relays:
            rows.append(await _relayed_storms(ports, w, plan))
    return rows


# The relays and their watchers stand in for other nodes: on this one machine they run at this niceness, so they
# take only the cores the head and the registering processes leave (on one machine at normal priority, 40 relays
# writing to 10,000 watchers took the head's CPU, stretched each storm to 20-35 s and cancelled 900 of its 1,000
# registrations).
OTHER_NODES = 19


async def _start_relays(address: str, count: int) -> list[Child]:
    relays: list[Child] = []
    for first in range(0, count, WATCHER_PROCESSES_AT_ONCE):
        batch = range(first, min(count, first + WATCHER_PROCESSES_AT_ONCE))
        relays += await asyncio.gather(
            *(asyncio.to_thread(Child, "relay", address, ready_timeout=600, nice=OTHER_NODES) for _ in batch)
        )
    return relays


async def _connect_relayed_watchers(
    relays: list[Child], w: int, plan: ScalePlan
) -> tuple[list[tuple[int, Child]], float]:
    """W watchers spread evenly over the relays, in processes of at most `fleet_per_process` watches each, a few
    processes at a time; each process with the index of the relay it watches."""
    counts: list[tuple[int, int]] = []
    for index in range(len(relays)):
        share = w // len(relays) + (1 if index < w % len(relays) else 0)
        while share > 0:
            counts.append((index, min(share, plan.fleet_per_process)))
            share -= plan.fleet_per_process
    started, children = time.monotonic(), []
    for first in range(0, len(counts), WATCHER_PROCESSES_AT_ONCE):
        batch = counts[first : first + WATCHER_PROCESSES_AT_ONCE]
        made = await asyncio.gather(
            *(
                asyncio.to_thread(
                    Child,
                    "watchers",
                    relays[index].info["address"],
                    str(n),
                    "revisions",
                    ready_timeout=1800,
                    nice=OTHER_NODES,
                )
                for index, n in batch
            )
        )
        children += [(index, child) for (index, _), child in zip(batch, made, strict=True)]
    return children, time.monotonic() - started


def _cpu_of(children: list[Child]) -> float:
    return sum(cpu_seconds(child.pid) for child in children)


async def _relayed_storms(ports: list[int], w: int, plan: ScalePlan) -> FleetStormRow:
    """The same storms with the W watchers behind `fleet_storm_relays` watch relays (one per simulated node),
    each relay a process following the head once: the head's RSS per watcher and CPU per watcher per coalesced
    push (the same storm with no watcher taken off), the relays' own, and the time from the storm's end to the
    last watcher holding it (each relay says which of its own revisions carries the head's)."""
    relay_count = min(plan.fleet_storm_relays, w)
    row = FleetStormRow(w, f"gym_rpc head, {relay_count} relays", relays=relay_count)
    settle = _settle(plan)
    with running_head(ports[:10], plan) as head:  # the default watch caps: R streams, not W
        address = head.info["address"]
        await asyncio.to_thread(wait_until_probed, address, 60)
        registrars = await _registrars(address, ports, plan)
        relays: list[Child] = []
        children: list[tuple[int, Child]] = []
        try:
            await _registrar_storm(registrars, plan, 0)  # the instances registered before anything is measured
            await asyncio.sleep(settle)
            idle, _ = await idle_cpu_rates(head.pid, plan.idle_seconds / 2)
            alone = []
            for base in (plan.fleet_storm_changes, 2 * plan.fleet_storm_changes):
                cpu, started = cpu_seconds(head.pid), time.monotonic()
                await _registrar_storm(registrars, plan, base)
                await asyncio.sleep(settle)
                alone.append(cpu_seconds(head.pid) - cpu - idle * (time.monotonic() - started))
            row.alone_ms_per_storm = median(alone) * 1e3
            rss_before = rss_mib(head.pid)
            relays = await _start_relays(address, relay_count)
            relays_before = sum(rss_mib(relay.pid) for relay in relays)
            children, row.connect_seconds = await _connect_relayed_watchers(relays, w, plan)
            await asyncio.sleep(settle)
            row.rss_kib_per_watcher = (rss_mib(head.pid) - rss_before) * 1024 / w
            row.relay_rss_kib_per_watcher = (sum(rss_mib(r.pid) for r in relays) - relays_before) * 1024 / w
            idle, _ = await idle_cpu_rates(head.pid, plan.idle_seconds / 2)
            relays_cpu, relays_started = _cpu_of(relays), time.monotonic()
            await asyncio.sleep(plan.idle_seconds / 2)
            relays_idle = (_cpu_of(relays) - relays_cpu) / (time.monotonic() - relays_started)
            for round_index in range(plan.fleet_storm_rounds):
                base = (round_index + 3) * plan.fleet_storm_changes
                for _, child in children:
                    await asyncio.to_thread(child.ask, "mark")
                cpu, relay_cpu, started = cpu_seconds(head.pid), _cpu_of(relays), time.monotonic()
                storm = await _registrar_storm(registrars, plan, base)
                target_step = base + plan.fleet_storm_changes - 1
                revision, holds = await asyncio.to_thread(_head_revision, address, target_step)
                row.unchecked += int(not holds)
                locals_ = await asyncio.gather(
                    *(asyncio.to_thread(relay.ask, f"local {revision} 120", 180) for relay in relays)
                )
                answers = list(
                    await asyncio.gather(
                        *(
                            asyncio.to_thread(child.ask, f"reach {locals_[index]['revision']} 120", 180)
                            for index, child in children
                        )
                    )
                )
                elapsed = time.monotonic() - started
                spent = cpu_seconds(head.pid) - cpu - idle * elapsed - median(alone)
                relays_spent = _cpu_of(relays) - relay_cpu - relays_idle * elapsed
                row.missing += sum(1 for local in locals_ if not local["reached"])
                total = _note_reached(row, answers, storm["last_answered"], target_step)
                row.cpu_us.append(spent / max(total, 1) * 1e6)
                row.gross_cpu_us.append((spent + median(alone)) / max(total, 1) * 1e6)
                row.relay_cpu_us.append(relays_spent / max(total, 1) * 1e6)
                row.offered_seconds.append(storm["last_sent"] - storm["first_sent"])
                row.storm_seconds.append(storm["last_answered"] - storm["first_sent"])
                row.registration_p50_ms.append(storm["p50_ms"])
                row.registration_max_ms.append(storm["max_ms"])
                row.failed += storm["failed"]
                print(
                    f"    W={w} via {relay_count} relays, storm {round_index}: answered in "
                    f"{row.storm_seconds[-1]:.2f} s, last watcher +{row.last_after_ms[-1]:.0f} ms, "
                    f"{row.messages[-1]:.0f} messages each, head {row.cpu_us[-1]:.1f} µs and relays "
                    f"{row.relay_cpu_us[-1]:.0f} µs per watcher per message (load {load_average()})",
                    file=sys.stderr,
                )
                await asyncio.sleep(settle)
        finally:
            for _, child in children:
                child.stop()
            for relay in relays:
                relay.stop()
            for registrar in registrars:
                registrar.stop()
    print(f"  fleet storm W={w} via relays: {row}", file=sys.stderr)
    return row


def _settle(plan: ScalePlan) -> float:
    """How long to let a head settle between a storm and the next measurement (its push timers run out, the
    watchers' processes connect): 2 s, a fifth of that in a quick run."""
    return min(2.0, plan.idle_seconds / 5)


async def _bare_storms(w: int, head_row: FleetStormRow, plan: ScalePlan) -> FleetStormRow:
    """The bare server with W watchers: per storm, as many pushes as the head's median watcher got, spread over
    the head's median storm time (the last one at its end); the last watcher after the last push."""
    row = FleetStormRow(w, "bare grpc.aio")
    settle = _settle(plan)
    pushes = max(1, round(median(head_row.messages)))
    spread = median(head_row.storm_seconds)
    bare = Child("bare")
    try:
        rss_before = rss_mib(bare.pid)
        children, row.connect_seconds = await _connect_watchers(bare.info["address"], w, plan, "revisions")
        try:
            await asyncio.sleep(settle)
            row.rss_kib_per_watcher = (rss_mib(bare.pid) - rss_before) * 1024 / w
            idle, _ = await idle_cpu_rates(bare.pid, plan.idle_seconds / 2)
            revision = 0
            for _ in range(plan.fleet_storm_rounds):
                for child in children:
                    await asyncio.to_thread(child.ask, "mark")
                cpu, started = cpu_seconds(bare.pid), time.monotonic()
                first = time.time()
                for index in range(pushes):
                    await asyncio.sleep(max(0.0, first + spread * (index + 1) / pushes - time.time()))
                    revision = (await asyncio.to_thread(bare.ask, "push"))["revision"]
                last_push = time.time()
                answers = await _reached(children, revision)
                spent = cpu_seconds(bare.pid) - cpu - idle * (time.monotonic() - started)
                total = _note_reached(row, answers, last_push, revision)
                row.cpu_us.append(spent / max(total, 1) * 1e6)
                row.storm_seconds.append(last_push - first)
                await asyncio.sleep(settle)
        finally:
            for child in children:
                child.stop()
    finally:
        bare.stop()
    print(f"  fleet storm W={w}: {row}", file=sys.stderr)
    return row


FLEET_STORMS_START = "<!-- fleet storms: python -m bench.scale --only fleet-storms -->"
FLEET_STORMS_END = "<!-- end of fleet storms -->"
FLEET_STORMS_TITLE = "## A storm of 1,000 changes within a second, at fleet size"


def _spread(values: list[float], unit: str, digits: int = 0) -> str:
    """The median, and each value when there are several."""
    shown = f"{median(values):.{digits}f}" + (f" {unit}" if unit else "")
    if len(values) > 1:
        shown += " (" + ", ".join(f"{v:.{digits}f}" for v in values) + ")"
    return shown


def _fleet_storm_lines(
    rows: list[FleetStormRow], plan: ScalePlan, took: float, load: tuple[str, str]
) -> list[str]:
    connections = plan.fleet_storm_registrars * plan.fleet_storm_connections
    lines = [
        FLEET_STORMS_START,
        FLEET_STORMS_TITLE,
        "",
        f"The issue's storm: {plan.fleet_storm_changes} instance changes offered within "
        f"{plan.fleet_storm_seconds:g} s to a head (its own process) with W status watchers. Each change is a "
        f"registration relabelling one of {plan.storm_instances} registered instances of one server, sent at its "
        "time whether or not the earlier ones were answered (open loop, as a fleet's registering servers send "
        f"them), by {plan.fleet_storm_registrars} registering processes over {connections} connections. Watchers: "
        f"{plan.fleet_per_process} per process (a connection per 100 streams), processes started "
        f"{WATCHER_PROCESSES_AT_ONCE} at a time; each watcher notes when each message came and its revision, and "
        "one per process also checks the last change's label. The storm ends when its last registration is "
        "answered; the last watcher is current when it has the head's revision of that moment. CPU per watcher "
        "per coalesced push: the head's CPU from the storm's start until every watcher was current, above its "
        "idle rate, less the same storm's cost with no watcher (measured before they connected), per message the "
        "watchers received. RSS: the head's growth while the watchers connected, per watcher. The bare grpc.aio "
        "row is the floor under any Python gRPC head (no interceptor, slot or stall bound; one pre-serialised "
        "message per push, shared): per storm it pushes as many messages as the head's median watcher got, spread"
        " over the head's median storm time, and its last watcher is timed from its last push. The relayed row "
        f"(`--relays`, {plan.fleet_storm_relays} here) is a head of its own with the same W watchers behind "
        "that many watch relays (`gym-rpc relay`, each a process of its own following the head once, as one per "
        "node would), W / relays watchers per relay: the head's CPU and RSS per watcher are the head's own "
        "divided by all W watchers' messages and by W, the relays' own (their CPU above idle over the same "
        "storm, their RSS growth while their watchers connected) in the last two columns; a watcher is current "
        "when it holds its relay's revision carrying the head's of the storm's end. Medians over the "
        "storms, each storm in brackets.",
        "",
        "| W | server | storms | changes offered within | storm answered within | registration p50 / max | last "
        "watcher current after the storm | messages per watcher per storm | CPU per watcher per push | RSS per "
        "watcher | head CPU per storm, no watcher | never current | failed | relays' CPU per watcher per push | "
        "relays' RSS per watcher |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        head = row.server != "bare grpc.aio"
        digits = 1 if row.relays else 0
        relayed = (
            f" {_spread(row.relay_cpu_us, 'µs')} | {row.relay_rss_kib_per_watcher:.1f} KiB |"
            if row.relays
            else "  |  |"
        )
        offered = _spread(row.offered_seconds, "s", 2) if head else ""
        registration = (
            f"{median(row.registration_p50_ms):.0f} / {max(row.registration_max_ms):.0f} ms" if head else ""
        )
        alone = f"{row.alone_ms_per_storm:.0f} ms" if head else ""
        lines.append(
            f"| {row.watchers} | {row.server} | {len(row.last_after_ms)} | {offered} | "
            f"{_spread(row.storm_seconds, 's', 2)} | {registration} | {_spread(row.last_after_ms, 'ms')} | "
            f"{_spread(row.messages, '')} | {_spread(row.cpu_us, 'µs', digits)} | "
            f"{row.rss_kib_per_watcher:.1f} KiB | {alone} | {row.missing} | {row.failed if head else ''} |"
            + relayed
        )
    kib = 20 * 1000 / 1024  # 20 KB
    lines += ["", "| goal | figure | bare grpc.aio, same W | met |", "| --- | --- | --- | --- |"]
    for row in rows:
        if row.server == "bare grpc.aio":
            continue
        bare = next((r for r in rows if r.watchers == row.watchers and r.server == "bare grpc.aio"), None)
        last, cpu = median(row.last_after_ms), median(row.cpu_us)
        current = last <= 1000 and row.missing == 0 and row.failed == 0 and row.unchecked == 0
        if row.relays:
            where = f"W = {row.watchers}, through {row.relays} relays"
            own_cpu, own_rss = median(row.relay_cpu_us), row.relay_rss_kib_per_watcher
            lines += [
                f"| last watcher current within 1 s of the storm's end at {where} | {last:.0f} ms | "
                f"{f'{median(bare.last_after_ms):.0f} ms' if bare else ''} | {'yes' if current else 'NO'} |",
                f"| head RSS <= 20 KB ({kib:.1f} KiB) per watcher at {where} (the relays': {own_rss:.1f} KiB) | "
                f"{row.rss_kib_per_watcher:.1f} KiB | {f'{bare.rss_kib_per_watcher:.1f} KiB' if bare else ''} | "
                f"{'yes' if row.rss_kib_per_watcher <= kib else 'NO'} |",
                f"| head CPU <= 10 µs per watcher per coalesced push at {where} (the relays': {own_cpu:.0f} µs) | "
                f"{cpu:.1f} µs | {f'{median(bare.cpu_us):.0f} µs' if bare else ''} | "
                f"{'yes' if cpu <= 10 else 'NO'} |",
            ]
            continue
        lines += [
            f"| last watcher current within 1 s of the storm's end at W = {row.watchers} | {last:.0f} ms | "
            f"{f'{median(bare.last_after_ms):.0f} ms' if bare else ''} | {'yes' if current else 'NO'} |",
            f"| head RSS <= 20 KB ({kib:.1f} KiB) per watcher at W = {row.watchers} | "
            f"{row.rss_kib_per_watcher:.1f} KiB | {f'{bare.rss_kib_per_watcher:.1f} KiB' if bare else ''} | "
            f"{'yes' if row.rss_kib_per_watcher <= kib else 'NO'} |",
            f"| head CPU <= 10 µs per watcher per coalesced push at W = {row.watchers} | {cpu:.0f} µs | "
            f"{f'{median(bare.cpu_us):.0f} µs' if bare else ''} | {'yes' if cpu <= 10 else 'NO'} |",
        ]
    unchecked = sum(r.unchecked for r in rows)
    gross = [
        f"W = {r.watchers} through {r.relays} relays: {_spread(r.gross_cpu_us, 'µs', 1)}" for r in rows if r.relays
    ]
    lines += [
        "",
        "The CPU per push is the storm's cost above the same storm with no watcher, over a few messages per "
        "watcher: the registrations' own cost (the no-watcher column, which moves with the machine's load) "
        "weighs on it most at small W. The fleet-size watchers' section (pushes 0.2 s apart, no registrations in "
        "between) measures it more directly."
        + (
            " Through relays the head's cost of the pushes is within the noise of that no-watcher cost (a figure "
            "near 0, either sign); without taking it off, an upper bound (the whole storm's CPU above idle per "
            f"watcher per push): {'; '.join(gross)}. The relays and their watchers run at nice {OTHER_NODES}, "
            "standing in for other nodes' cores."
            if gross
            else ""
        ),
        "",
        f"(This section: `python -m bench.scale --only fleet-storms` in {took:.0f} s, load average {load[0]} at "
        f"the start and {load[1]} at the end; storms whose head or checking watchers lacked the last change's "
        f"label: {unchecked}.)",
        FLEET_STORMS_END,
    ]
    return lines


async def run_fleet_storms(plan: ScalePlan, out: Path | None) -> str:
    """Only the storms at fleet size (`--only fleet-storms`), spliced into the report at `out` between markers."""
    load_start, started = load_average(), time.monotonic()
    servers = Child("servers", str(10 + plan.storm_instances))
    try:
        rows = await measure_fleet_storms(servers.info["ports"], plan)
    finally:
        servers.stop()
        await close_aio_channels()
    lines = _fleet_storm_lines(rows, plan, time.monotonic() - started, (load_start, load_average()))
    return await _splice(out, "\n".join(lines), FLEET_STORMS_START, FLEET_STORMS_END)


async def _splice(out: Path | None, section: str, start: str, end: str) -> str:
    """Write `section` (which begins with `start` and ends with `end`) into the report at `out` in place of the
    text between those markers, or at its end; the other sections stay as their last run wrote them."""
    if out is None:
        return section
    text = await asyncio.to_thread(_read_if_there, out)
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    await asyncio.to_thread(out.write_text, text, encoding="utf-8")
    return section


# --- the follower under a flood ----------------------------------------------------------------------------------


@dataclass
class FollowerRow:
    quiet: list[float] = field(default_factory=list)  # calls/s, the head silent after its snapshot
    flooded: list[float] = field(default_factory=list)  # calls/s, the head flooding
    # calls per CPU second of the worker's process (all its threads): what the flood costs the worker itself,
    # apart from the CPU the flooding head takes from it on this one machine
    quiet_per_cpu: list[float] = field(default_factory=list)
    flooded_per_cpu: list[float] = field(default_factory=list)


def measure_follower(ports: list[int], plan: ScalePlan) -> FollowerRow:
    row = FollowerRow()
    document = {
        "head_server": {"host": LOOPBACK, "port": 0},
        "policy_model": {"responses_api_models": {"bench": {"host": LOOPBACK, "port": ports[0]}}},
        "flooded": {"resources_servers": {"bench": {"host": LOOPBACK, "port": 9}}},
    }
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "flood.json"
        path.write_text(json.dumps(document), encoding="utf-8")
        for _ in range(plan.follower_rounds):
            for mode, rates, per_cpu in (
                ("quiet", row.quiet, row.quiet_per_cpu),
                ("flood", row.flooded, row.flooded_per_cpu),
            ):
                head = Child("flood", str(path), str(plan.follower_instances), mode)
                try:
                    worker = Child("worker", f"{LOOPBACK}:{head.info['port']}")
                    try:
                        time.sleep(0.5)  # the flood is on
                        answer = worker.ask(f"run {plan.follower_seconds}", timeout=plan.follower_seconds + 60)
                        rates.append(answer["calls_per_second"])
                        per_cpu.append(answer["calls_per_cpu_second"])
                    finally:
                        worker.stop()
                finally:
                    head.stop()
    print(f"  follower: {row}", file=sys.stderr)
    return row


# --- report ------------------------------------------------------------------------------------------------------


def _above_idle(micros: float) -> str:
    """A CPU figure above the idle rate; at or below it (tick granularity, noise) it is ~0."""
    return f"{micros:.0f} µs" if micros > 0 else "~0"


def _growth(values: list[float], sizes: tuple[int, ...]) -> str:
    """How a per-unit cost moves from the smallest size to the largest: flat (linear totals) or not."""
    if len(values) < 2 or not values[0] or math.isnan(values[0]):
        return "n/a"
    ratio = values[-1] / values[0]
    return f"x {ratio:.2f} from {sizes[0]} to {sizes[-1]}"


def render(
    servers: list[ServersRow],
    config: ConfigRow,
    watchers: list[WatchRow],
    pollers: list[PollRow],
    plan: ScalePlan,
    load: tuple[str, str],
    seconds: float,
    storms: list[StormRow] | None = None,
    follower: FollowerRow | None = None,
    fleet: list[str] | None = None,
) -> str:
    lines = [
        "# Scale: one head's costs as servers, watchers and pollers grow",
        "",
        f"Written by `make bench-scale` (`python -m bench.scale`) in {seconds:.0f} s. All loopback, on this "
        f"shared 2-core machine: load average {load[0]} at the start and {load[1]} at the end (other helpers' "
        "test runs load the CPU, so figures are medians and ratios, and absolute times are noisy). The head "
        "runs in its own process (CPU and RSS read from /proc); the N Gym servers are N listeners of one other "
        "process; watchers and pollers run in the bench process.",
        "",
        f"## Servers N (default probe interval {plan.probe_interval:g} s)",
        "",
        "ListServerStatuses is timed as protobuf on the wire; gym_rpc's Python client then converts each report "
        "(a few µs per server) on top.",
        "",
        "| N | ListServerStatuses p50 | head RSS | head idle CPU (% of a core) | idle CPU per server "
        "| ms per server per call |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for server_row in servers:
        lines.append(
            f"| {server_row.servers} | {server_row.list_p50_ms:.2f} ms | {server_row.rss_mib:.1f} MiB "
            f"| {server_row.idle_cpu_percent:.2f} % | {server_row.idle_cpu_percent / server_row.servers:.4f} % "
            f"| {server_row.list_p50_ms / server_row.servers:.4f} |"
        )
    per_server_cpu = [r.idle_cpu_percent / r.servers for r in servers]
    per_server_list = [r.list_p50_ms / r.servers for r in servers]
    rss_growth = (
        (servers[-1].rss_mib - servers[0].rss_mib) / (servers[-1].servers - servers[0].servers) * 1024
        if len(servers) > 1
        else math.nan
    )
    lines += [
        "",
        f"Growth: idle CPU per server {_growth(per_server_cpu, plan.servers)}; ListServerStatuses time per server "
        f"{_growth(per_server_list, plan.servers)} (a fixed per-call cost dominates at small N); RSS grows "
        f"{rss_growth:.1f} KiB per server.",
        "",
        f"## Config at N = {config.servers}: GetGlobalConfig with the caller's unchanged version",
        "",
        "| call | p50 | response bytes |",
        "| --- | --- | --- |",
        f"| whole document | {config.full_p50_ms:.2f} ms | {config.full_bytes} |",
        f"| `known_version` = current (answers `unchanged`) | {config.unchanged_p50_ms:.2f} ms | "
        f"{config.unchanged_bytes} |",
        "",
        f"Unchanged check: {config.full_p50_ms / config.unchanged_p50_ms:.1f}x faster, "
        f"{config.full_bytes / max(config.unchanged_bytes, 1):.0f}x fewer bytes.",
        "",
        "## Watchers W: a server dies, then comes back",
        "",
        "Fan-out = from the head recording the change (the probe's `checked_at`) to a watcher receiving it; "
        "death to last watcher also includes detection, which waits for the next probe round (up to the probe "
        f"interval, {plan.probe_interval:g} s).",
        "",
        "Per change and watcher, the CPU the head and the watchers' process (all W watches, one Python process) "
        "spent above their idle rates, read from /proc and `time.process_time()` over all changes (the head's "
        f"in 1/{CLOCK_TICKS} s ticks; at small W the fixed work per change, the bench's own included, dominates).",
        "",
        "| W | fan-out p50 | fan-out p99 | last watcher p50 (per change) | death → last watcher p50 | head RSS | "
        "fan-out p50 per watcher | head CPU per watcher | watchers' CPU per watcher |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for watch_row in watchers:
        p50 = median(watch_row.fanout_ms)
        lines.append(
            f"| {watch_row.watchers} | {p50:.1f} ms | {percentile(watch_row.fanout_ms, 0.99):.1f} ms | "
            f"{median(watch_row.last_fanout_ms):.1f} ms | {median(watch_row.death_to_last_ms):.0f} ms | "
            f"{watch_row.rss_mib:.1f} MiB | {p50 / watch_row.watchers * 1e3:.1f} µs | "
            f"{_above_idle(watch_row.head_cpu_us)} | {_above_idle(watch_row.client_cpu_us)} |"
        )
    if len(watchers) > 1:
        rss_per_watcher = (watchers[-1].rss_mib - watchers[0].rss_mib) / (
            watchers[-1].watchers - watchers[0].watchers
        )
        per_watcher = [median(r.last_fanout_ms) / r.watchers for r in watchers]
        lines += [
            "",
            f"Growth: head RSS {rss_per_watcher * 1024:.1f} KiB per watcher; time to the last watcher per watcher "
            f"{_growth(per_watcher, plan.watchers)}.",
        ]
        largest = watchers[-1]
        head_ms, client_ms = (us * largest.watchers / 1e3 for us in (largest.head_cpu_us, largest.client_cpu_us))
        lines += [
            "",
            f"What the time to the last watcher is made of at W = {largest.watchers}: the message is built and "
            "serialised once, but gRPC still sends it on each stream and wakes each watch's task, "
            f"{largest.head_cpu_us:.0f} µs of head CPU per watcher ({head_ms:.0f} ms per change), and the "
            f"watchers' one process spends {largest.client_cpu_us:.0f} µs per watcher receiving ({client_ms:.0f} "
            "ms), both on this machine's two cores shared with the other sessions' load.",
        ]
    spliced = _storm_lines(storms or [], plan) + _follower_lines(follower, plan)
    if spliced:  # between markers, so `--only storms` can measure them again alone
        lines += ["", STORMS_START, *spliced[1:], STORMS_END]
    if fleet:  # between markers too (`--only fleet`)
        lines += ["", *fleet]
    lines += [
        "",
        f"## Pollers P on one server ({plan.poll_seconds:g} s closed loop each)",
        "",
        "Through the head: GetServerStatus with no `max_age` (the head's freshness window, "
        f"{pollers[0].window_seconds:g} s). "
        "Directly: each poll a GET of the server on a fresh connection, as NeMo Gym's `poll_for_status` does.",
        "",
        "| P | via head: calls/s | via head: probes the server received per window | directly: calls/s | "
        "directly: probes per window | probes saved |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for poll_row in pollers:
        direct_per_window = poll_row.direct_probes_per_second * poll_row.window_seconds
        head_per_window = poll_row.head_probes_per_window
        saved = direct_per_window / head_per_window if head_per_window else math.inf
        lines.append(
            f"| {poll_row.pollers} | {poll_row.head_calls_per_second:.0f} | {head_per_window:.2f} | "
            f"{poll_row.direct_calls_per_second:.0f} | {direct_per_window:.0f} | {saved:.0f}x |"
        )
    lines += _goals(servers, watchers, pollers, storms or [], follower)
    refused = sum(r.head_refused for r in pollers)
    lines += [
        "",
        f"Calls the head refused during these runs (UNAVAILABLE, streams past a connection's limit): {refused}.",
        "",
    ]
    return "\n".join(lines)


def _storm_lines(storms: list[StormRow], plan: ScalePlan) -> list[str]:
    if not storms:
        return []
    lines = [
        "",
        f"## Change storms: {plan.storm_changes} instance changes as fast as the head takes them",
        "",
        f"W watchers in {plan.watcher_processes} processes of their own; {plan.storm_instances} registered "
        f"instances of one server, each registration relabelling one ({plan.storm_changes} registrations, 8 in "
        f'flight); {plan.storm_rounds} storms per row, medians shown. "Last watcher current" is from the storm\'s '
        "last registration answered to the last watcher holding its label (clocks of one machine). Head CPU is "
        "above its idle rate, per watcher per message sent; RSS is the head's growth when the watchers connected. "
        "The last row is the same head with coalescing off (`push_quiet_seconds=0`: every change pushed on its "
        "own, as before).",
        "",
        "| W | pushes | storm took | last watcher current after the storm | messages per watcher per storm | "
        "head CPU per watcher per message | head RSS per watcher | never current |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in storms:
        lines.append(
            f"| {row.watchers} | {'coalesced' if row.coalesced else 'one per change'} | "
            f"{median(row.storm_seconds):.2f} s | {median(row.last_after_ms):.0f} ms | "
            f"{median(row.messages):.0f} | {_above_idle(row.head_cpu_us)} | "
            f"{row.rss_kib_per_watcher:.1f} KiB | {row.missing} |"
        )
    off = [r for r in storms if not r.coalesced]
    on = [r for r in storms if r.coalesced and off and r.watchers == off[0].watchers]
    if off and on:
        lines += [
            "",
            f"At W = {on[0].watchers}, coalescing: "
            f"{median(off[0].messages) / max(median(on[0].messages), 1):.0f}x fewer messages per watcher; "
            "the last watcher current "
            f"{median(off[0].last_after_ms) / max(median(on[0].last_after_ms), 1):.1f}x sooner after the storm.",
        ]
    return lines


def _each(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values)


def _cpu_ratio(follower: FollowerRow) -> float:
    return median(follower.flooded_per_cpu) / median(follower.quiet_per_cpu)


def _follower_lines(follower: FollowerRow | None, plan: ScalePlan) -> list[str]:
    if follower is None or not follower.quiet:
        return []
    ratio = median(follower.flooded) / median(follower.quiet)
    return [
        "",
        "## A worker whose head floods it",
        "",
        "A rollout worker (a ServerClient in its own process, following its head's instances) calls one "
        f"server back to back for {plan.follower_seconds:g} s. Its head (bench/flood_head.py) either sends a "
        f"snapshot and then nothing, or changes of {plan.follower_instances} instances of another server as fast "
        f"as it can write them; {plan.follower_rounds} rounds of each, alternated, each with fresh processes. "
        "Calls per CPU second count every thread of the worker's process: what the flood costs the worker "
        "itself, apart from the CPU the flooding head (on the same two cores here) takes from it.",
        "",
        "| head | calls/s (median) | each round | calls per CPU second of the worker (median) | each round |",
        "| --- | --- | --- | --- | --- |",
        f"| quiet | {median(follower.quiet):.0f} | {_each(follower.quiet)} | "
        f"{median(follower.quiet_per_cpu):.0f} | {_each(follower.quiet_per_cpu)} |",
        f"| flooding | {median(follower.flooded):.0f} | {_each(follower.flooded)} | "
        f"{median(follower.flooded_per_cpu):.0f} | {_each(follower.flooded_per_cpu)} |",
        "",
        f"Flooded over quiet: calls/s {ratio:.2f}x, calls per CPU second {_cpu_ratio(follower):.2f}x.",
    ]


def _goals(
    servers: list[ServersRow],
    watchers: list[WatchRow],
    pollers: list[PollRow],
    storms: list[StormRow],
    follower: FollowerRow | None,
) -> list[str]:
    """The issue's goals, each with the figure that decides it."""
    rows: list[tuple[str, str, bool]] = []
    coalesced = [r for r in storms if r.coalesced]
    if coalesced:
        storm = coalesced[-1]
        last = median(storm.last_after_ms)
        rows.append(
            (
                f"last watcher current within 1 s of a storm's end at W = {storm.watchers}",
                f"{last:.0f} ms",
                last <= 1000 and storm.missing == 0,
            )
        )
        rss = storm.rss_kib_per_watcher
        rows.append((f"head RSS <= 20 KB per watcher at W = {storm.watchers}", f"{rss:.1f} KiB", rss <= 20))
        cpu = storm.head_cpu_us
        rows.append(
            (f"head CPU <= 10 µs per watcher per push at W = {storm.watchers}", _above_idle(cpu), cpu <= 10)
        )
    if follower is not None and follower.quiet:
        ratio = _cpu_ratio(follower)
        goal = "a flooding head costs a worker <= 10 % of its calls per CPU second"
        rows.append((goal, f"{ratio:.2f}x", ratio >= 0.9))
    if watchers:
        largest = watchers[-1]
        p99 = percentile(largest.fanout_ms, 0.99)
        rows.append((f"fan-out p99 < 100 ms at W = {largest.watchers}", f"{p99:.1f} ms", p99 < 100))
    if pollers:
        worst = max(r.head_probes_per_window for r in pollers)
        rows.append(("probes received per window <= 1, whatever P", f"at most {worst:.2f}", worst <= 1.05))
    hundred = [r for r in servers if r.servers == 100]
    if hundred:
        idle = hundred[0].idle_cpu_percent
        rows.append(("head idle CPU < 2 % of a core with 100 servers", f"{idle:.2f} %", idle < 2))
    per_server = [r.idle_cpu_percent / r.servers for r in servers]
    if per_server and per_server[0]:  # a head too idle to measure at the smallest N has no ratio
        ratio = per_server[-1] / per_server[0]
        rows.append(
            ("idle CPU per server flat (linear total) from smallest to largest N", f"x {ratio:.2f}", ratio <= 1.5)
        )
    if len(watchers) > 1:
        per_watcher = [median(r.last_fanout_ms) / r.watchers for r in watchers]
        ratio = per_watcher[-1] / per_watcher[0]
        rows.append(("time to the last watcher per watcher flat", f"x {ratio:.2f}", ratio <= 1.5))
    lines = ["", "## Goals", "", "| goal | figure | met |", "| --- | --- | --- |"]
    lines += [f"| {goal} | {figure} | {'yes' if met else 'NO'} |" for goal, figure, met in rows]
    return lines


STORMS_START = "<!-- storms and follower: python -m bench.scale --only storms -->"
STORMS_END = "<!-- end of storms and follower -->"
FLEET_START = "<!-- fleet watchers: python -m bench.scale --only fleet -->"
FLEET_END = "<!-- end of fleet watchers -->"


async def run_fleet(plan: ScalePlan, out: Path | None) -> str:
    """Only the fleet-size watchers (`--only fleet`), spliced into the report at `out` between its markers."""
    started = time.monotonic()
    servers = Child("servers", str(10 + plan.fleet_instances))
    try:
        rows = await measure_fleet(servers.info["ports"], plan)
    finally:
        servers.stop()
        await close_aio_channels()
    section = "\n".join(_fleet_lines(rows, plan, time.monotonic() - started))
    return await _splice(out, section, FLEET_START, FLEET_END)


def _read_if_there(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.exists() else ""


async def run_storms(plan: ScalePlan, out: Path | None) -> str:
    """Only the change storms and the flooded follower (`--only storms`), spliced into the report at `out` between
    its markers (the other sections stay as their last full run wrote them)."""
    load_start, started = load_average(), time.monotonic()
    servers = Child("servers", str(10 + plan.storm_instances))
    try:
        ports: list[int] = servers.info["ports"]
        storm_rows = await measure_storms(ports, plan)
        follower_row = await asyncio.to_thread(measure_follower, ports, plan)
    finally:
        servers.stop()
        await close_aio_channels()
    goals = _goals([], [], [], storm_rows, follower_row)[1:]
    section = "\n".join(
        [
            STORMS_START,
            *_storm_lines(storm_rows, plan)[1:],
            *_follower_lines(follower_row, plan),
            "",
            f"(These two sections: `python -m bench.scale --only storms` in {time.monotonic() - started:.0f} s, "
            f"load average {load_start} at the start and {load_average()} at the end.)",
            "",
            *[line.replace("## Goals", "### Goals of these two sections") for line in goals],
            STORMS_END,
        ]
    )
    return await _splice(out, section, STORMS_START, STORMS_END)


async def run(plan: ScalePlan, out: Path | None) -> str:
    load_start = load_average()
    started = time.monotonic()
    servers = Child("servers", str(max(max(plan.servers), 10 + plan.storm_instances, 10 + plan.fleet_instances)))
    try:
        ports: list[int] = servers.info["ports"]
        print("servers:", file=sys.stderr)
        server_rows, config_row = await asyncio.to_thread(measure_servers, ports, plan)
        print("watchers:", file=sys.stderr)
        watch_rows = await measure_watchers(servers, ports, plan)
        print("pollers:", file=sys.stderr)
        poll_rows = await measure_pollers(servers, ports, plan)
        print("storms:", file=sys.stderr)
        storm_rows = await measure_storms(ports, plan)
        print("follower:", file=sys.stderr)
        follower_row = await asyncio.to_thread(measure_follower, ports, plan)
        print("fleet:", file=sys.stderr)
        fleet_started = time.monotonic()
        fleet_lines = _fleet_lines(await measure_fleet(ports, plan), plan, time.monotonic() - fleet_started)
        print("fleet storms:", file=sys.stderr)
        storms_load, storms_started = load_average(), time.monotonic()
        fleet_storm_rows = await measure_fleet_storms(ports, plan)
        fleet_lines += [
            "",
            *_fleet_storm_lines(
                fleet_storm_rows, plan, time.monotonic() - storms_started, (storms_load, load_average())
            ),
        ]
    finally:
        servers.stop()
        await close_aio_channels()
    text = render(
        server_rows,
        config_row,
        watch_rows,
        poll_rows,
        plan,
        (load_start, load_average()),
        time.monotonic() - started,
        storm_rows,
        follower_row,
        fleet_lines,
    )
    if out is not None:
        await asyncio.to_thread(out.write_text, text, encoding="utf-8")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds; no file unless --out")
    parser.add_argument("--out", type=Path, help=f"where to write the report (default: {SCALE_PATH})")
    parser.add_argument(
        "--only",
        choices=["storms", "fleet", "fleet-storms"],
        help="only the change storms and the flooded follower, only the fleet-size watchers (memory and CPU "
        "per watcher), or only the storm of 1,000 changes within a second at fleet size, spliced into the report",
    )
    parser.add_argument(
        "--watchers",
        type=lambda text: tuple(int(w) for w in text.split(",")),
        help="with --only fleet or fleet-storms: the W to measure, comma-separated (default: 1000)",
    )
    parser.add_argument(
        "--per-process", type=int, help="with --only fleet or fleet-storms: watches per watcher process (250)"
    )
    parser.add_argument("--rounds", type=int, help="with --only fleet-storms: storms per W (default: 3)")
    parser.add_argument(
        "--relays",
        type=int,
        help="with --only fleet-storms: watch relays of the relayed row, one per simulated node (default: 40; "
        "0: no relayed row)",
    )
    args = parser.parse_args()
    for name in (
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "GYM_RPC_HEAD",
    ):
        os.environ.pop(name, None)
    out = args.out if args.out is not None or args.quick else SCALE_PATH
    plan = QUICK if args.quick else FULL
    if args.watchers:
        plan = dataclasses.replace(plan, fleet_watchers=args.watchers, fleet_storm_watchers=args.watchers)
    if args.per_process:
        plan = dataclasses.replace(plan, fleet_per_process=args.per_process)
    if args.rounds:
        plan = dataclasses.replace(plan, fleet_storm_rounds=args.rounds)
    if args.relays is not None:
        plan = dataclasses.replace(plan, fleet_storm_relays=args.relays)
    if args.only == "fleet":
        text = asyncio.run(run_fleet(plan, out))
    elif args.only == "fleet-storms":
        text = asyncio.run(run_fleet_storms(plan, out))
    else:
        text = asyncio.run(run_storms(plan, out) if args.only == "storms" else run(plan, out))
    print(text)


if __name__ == "__main__":
    main()
