"""What the per-address relay on the gRPC port costs the control plane (issue 43, point 9b;
gym_rpc.server.security._grpc_relay): two heads in processes of their own, one serving grpc directly and one
behind the relay (`HeadOptions.connection_relay`), measured in turns in the same run.

* unary: `GetServerStatus` from the head's cache, `concurrency` calls at once over one channel: calls/s seen by
  the client, and the head's CPU per call (user + system, from /proc);
* fan-out: `watchers` status watches over `channels` connections; a change is a relabel of one registered
  instance (one watch message each, pushes not held back); the time from the change until every watcher has it,
  and the head's CPU per change.

Each row is the median over rounds of the per-round quotient (relay over direct), so both heads meet the same
moment of a shared machine's load. `python -m bench.relay_cost` prints the rows; `python -m bench --only relay`
runs them inside the whole table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import grpc

from bench.stats import Row, fmt_ratio, ratio_row
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.v1 import control_plane_pb2_grpc as pb_grpc

AREA = "control plane"
LOOPBACK = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parent.parent
READY = "READY "
INSTANCE_PORT = 9  # discard: nothing answers there, and the instance's probe result never changes


@dataclass(frozen=True)
class RelayPlan:
    rounds: int = 8
    calls: int = 3000
    concurrency: int = 16
    watchers: int = 256
    channels: int = 8
    changes: int = 12


QUICK_RELAY = RelayPlan(rounds=1, calls=50, concurrency=4, watchers=4, channels=2, changes=1)


def head_cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class SideHead:
    """A head in a process of its own (`python -m bench.relay_cost head --relay on|off`); `ready()` waits for it
    (both sides start at once)."""

    def __init__(self, relay: bool) -> None:
        self.relay = relay
        self.port = 0
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.relay_cost", "head", "--relay", "on" if relay else "off"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )

    def ready(self) -> SideHead:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith(READY):
            self.stop()
            raise RuntimeError(f"the {'relayed' if self.relay else 'direct'} bench head did not start: {line!r}")
        self.port = int(json.loads(line[len(READY) :])["port"])
        return self

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


def _channel(port: int, index: int) -> grpc.aio.Channel:
    """A channel of its own connection (`index` makes its options, so its subchannel, distinct)."""
    return grpc.aio.insecure_channel(f"{LOOPBACK}:{port}", options=[("gym_rpc.bench.connection", index)])


async def unary_round(head: SideHead, plan: RelayPlan) -> tuple[float, float]:
    """(calls/s, head CPU seconds per call) of `plan.calls` GetServerStatus calls, `plan.concurrency` at once."""
    async with _channel(head.port, 0) as channel:
        stub = pb_grpc.ControlPlaneServiceStub(channel)
        request = pb.GetServerStatusRequest(server_name="policy")
        await stub.GetServerStatus(request, timeout=10)  # connected before the clock starts
        left = plan.calls

        async def caller() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await stub.GetServerStatus(request, timeout=10)

        cpu, started = head_cpu_seconds(head.process.pid), time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(plan.concurrency)))
        elapsed, cpu = time.perf_counter() - started, head_cpu_seconds(head.process.pid) - cpu
    return plan.calls / elapsed, cpu / plan.calls


async def fanout_round(head: SideHead, plan: RelayPlan, round_index: int) -> tuple[float, float]:
    """(median seconds until every watcher has a change, head CPU seconds per change)."""
    channels = [_channel(head.port, index) for index in range(plan.channels)]
    control = pb_grpc.ControlPlaneServiceStub(channels[0])
    expected = [""]
    arrived = [0]
    all_arrived = asyncio.Event()
    streams: list[Any] = []

    async def watch(stub: pb_grpc.ControlPlaneServiceStub, ready: asyncio.Event) -> None:
        call: Any = stub.WatchServerStatuses(pb.WatchServerStatusesRequest())  # an aio stream
        streams.append(call)
        async for message in call:
            if message.type == pb.WATCH_EVENT_TYPE_SNAPSHOT:
                ready.set()
            for report in message.reports:
                if any(i.labels.get("n") == expected[0] for i in report.instances) and message.type != (
                    pb.WATCH_EVENT_TYPE_SNAPSHOT
                ):
                    arrived[0] += 1
                    if arrived[0] == plan.watchers:
                        all_arrived.set()

    readies = [asyncio.Event() for _ in range(plan.watchers)]
    tasks = [
        asyncio.create_task(watch(pb_grpc.ControlPlaneServiceStub(channels[i % plan.channels]), readies[i]))
        for i in range(plan.watchers)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*(ready.wait() for ready in readies)), 60)
        times, cpu = [], head_cpu_seconds(head.process.pid)
        for change in range(plan.changes):
            expected[0], arrived[0] = f"{round_index}-{change}", 0
            all_arrived.clear()
            request = pb.RegisterServerInstanceRequest(
                server_name="policy", pid=4242, listen_host=LOOPBACK, listen_port=INSTANCE_PORT
            )
            request.labels["n"] = expected[0]
            started = time.perf_counter()
            await control.RegisterServerInstance(request, timeout=10)
            await asyncio.wait_for(all_arrived.wait(), 60)
            times.append(time.perf_counter() - started)
        cpu = head_cpu_seconds(head.process.pid) - cpu
    finally:
        for call in streams:
            call.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in channels:
            await channel.close(None)
    return median(times), cpu / plan.changes


async def measure(plan: RelayPlan) -> dict[str, float]:
    """Medians over rounds of the per-round quotients relay/direct (sides taken in turn, ABBA) of calls/s and
    fan-out time; the head CPU quotients over all rounds (CPU is counted in clock ticks)."""
    direct, relayed = SideHead(relay=False), SideHead(relay=True)
    try:
        direct.ready(), relayed.ready()
    except BaseException:
        direct.stop()
        relayed.stop()
        raise
    calls: list[float] = []
    fanouts: list[float] = []
    direct_calls: list[float] = []
    direct_fanouts: list[float] = []
    cpu = {"direct_calls": 0.0, "relay_calls": 0.0, "direct_changes": 0.0, "relay_changes": 0.0}
    try:
        for index in range(plan.rounds):
            order = (direct, relayed) if index % 2 == 0 else (relayed, direct)
            unary = {head.port: await unary_round(head, plan) for head in order}
            fanout = {head.port: await fanout_round(head, plan, index) for head in order}
            d, r = direct.port, relayed.port
            calls.append(unary[r][0] / unary[d][0])
            fanouts.append(fanout[r][0] / fanout[d][0])
            direct_calls.append(unary[d][0])
            direct_fanouts.append(fanout[d][0])
            cpu["direct_calls"] += unary[d][1]
            cpu["relay_calls"] += unary[r][1]
            cpu["direct_changes"] += fanout[d][1]
            cpu["relay_changes"] += fanout[r][1]
    finally:
        direct.stop()
        relayed.stop()
    return {
        "calls": median(calls),
        "fanout": median(fanouts),
        "direct_calls_per_s": median(direct_calls),
        "direct_fanout_ms": median(direct_fanouts) * 1e3,
        "direct_call_cpu_us": cpu["direct_calls"] / plan.rounds * 1e6,
        "relay_call_cpu_us": cpu["relay_calls"] / plan.rounds * 1e6,
        "direct_change_cpu_ms": cpu["direct_changes"] / plan.rounds * 1e3,
        "relay_change_cpu_ms": cpu["relay_changes"] / plan.rounds * 1e3,
    }


def _quotient(top: float, bottom: float) -> float:
    return top / bottom if bottom else float("nan")


def rows(plan: RelayPlan) -> list[Row]:
    m = asyncio.run(measure(plan))
    size = f"{plan.watchers} watchers on {plan.channels} connections"
    return [
        ratio_row(
            AREA,
            f"per-address relay: GetServerStatus calls/s, {plan.concurrency} at once (relay/direct, median of "
            f"{plan.rounds} rounds)",
            f"{m['calls'] * m['direct_calls_per_s']:.0f}/s",
            f"{m['direct_calls_per_s']:.0f}/s",
            m["calls"],
            None,
        ),
        ratio_row(
            AREA,
            "per-address relay: head CPU per GetServerStatus call (direct/relay)",
            f"{m['relay_call_cpu_us']:.0f} us",
            f"{m['direct_call_cpu_us']:.0f} us",
            _quotient(m["direct_call_cpu_us"], m["relay_call_cpu_us"]),
            None,
        ),
        ratio_row(
            AREA,
            f"per-address relay: watch fan-out, a change to all {size} (direct/relay)",
            f"{m['fanout'] * m['direct_fanout_ms']:.1f} ms",
            f"{m['direct_fanout_ms']:.1f} ms",
            _quotient(1, m["fanout"]),
            None,
        ),
        ratio_row(
            AREA,
            f"per-address relay: head CPU per change sent to {size} (direct/relay)",
            f"{m['relay_change_cpu_ms']:.1f} ms",
            f"{m['direct_change_cpu_ms']:.1f} ms",
            _quotient(m["direct_change_cpu_ms"], m["relay_change_cpu_ms"]),
            None,
        ),
    ]


# --- the side heads ------------------------------------------------------------------------------------------


async def serve_head(relay: bool) -> None:
    from gym_rpc.config import GlobalConfig
    from gym_rpc.server._head import HeadOptions, HeadServer

    document = {"policy": {"responses_api_models": {"x": {"host": LOOPBACK, "port": INSTANCE_PORT}}}}
    options = HeadOptions(
        port=0,
        probe_interval_seconds=60.0,  # the cache answers GetServerStatus; probes cost neither side
        reflection=False,
        push_quiet_seconds=0.0,
        push_max_delay_seconds=0.0,
        connection_relay=relay,
        keep_registrations=False,
    )
    head = HeadServer(GlobalConfig.from_document(document), options)
    await head.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()
    print(READY + json.dumps({"port": head.port}), flush=True)
    await stop.wait()
    await head.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.relay_cost", description=__doc__)
    parser.add_argument("kind", nargs="?", choices=["rows", "head"], default="rows")
    parser.add_argument("--relay", choices=["on", "off"], default="off")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.kind == "head":
        asyncio.run(serve_head(args.relay == "on"))
        return 0
    for row in rows(QUICK_RELAY if args.quick else RelayPlan()):
        print(f"{row.measure}: {row.ours} vs {row.baseline}, {fmt_ratio(row.ratio)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
