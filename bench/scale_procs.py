"""The processes `make bench-scale` measures, each its own interpreter (`python -m bench.scale_procs ...`).

* `servers K`: K Gym servers as K aiohttp listeners in one process, each counting the requests (probes) it
  receives. Commands on stdin, one per line, each answered with one JSON line: `stop I` closes listener I (its
  port then refuses, as a dead server's does), `start I` listens on its port again, `counts` returns every
  listener's request count.
* `watchers ADDRESS COUNT`: COUNT status watches of the head at ADDRESS, over a connection per 100 streams, each
  noting the highest `step` label any instance carried in what it received. Commands: `target STEP` (from now on,
  each watch notes when it first holds STEP, and counts its messages), `wait TIMEOUT` (until every watch holds the
  target: when the last one got there, and each watch's message count).
* `watchers ADDRESS COUNT revisions`: the same watches, each reading only its messages' revision (from the bytes,
  no full parse: at W = 10,000 the watchers' own parsing would take the head's CPU on a two-core machine), and
  the process's first watch also every `step` label, a check that the revision carries the change. Commands:
  `mark` (each watch counts its messages from now on), `reach REVISION TIMEOUT` (until every watch has received
  REVISION or later: when the last one first did, each watch's message count, the checking watch's highest step).
* `registrar ADDRESS CONNECTIONS PORTS`: registers instances of `server_0000` at the JSON list of PORTS over
  CONNECTIONS connections. `storm BASE COUNT SECONDS AT SHARE SHARES`: of the storm's COUNT changes, those with
  k % SHARES == SHARE, change k sent at wall time AT + k * SECONDS / COUNT whether or not earlier ones were
  answered (open loop: the storm arrives as a fleet makes it, not as fast as the head answers), each relabelling
  instance k % len(PORTS) with `step` BASE + k; answers when each was sent and answered.
* `flood CONFIG INSTANCES [quiet]`: bench/flood_head.py's hostile head (a flood of INSTANCES-instance changes).
* `worker HEAD`: a rollout worker: a ServerClient loaded from the head at HEAD (so it follows the head's instances)
  calling `policy_model`; `run SECONDS` calls it back to back for that long and answers the calls per second.
* `bare`: the floor under any head: a bare grpc.aio server (no interceptor, no slot, no stall bound) whose
  WatchServerStatuses streams each send one message and then one per `push` command (a pre-serialised message, a
  shared future: gRPC's own cost of a stream and of a write, nothing of gym_rpc's).
* `relay HEAD`: a node's watch relay (gym_rpc.server.watch_relay) following the head at HEAD, serving on a free
  loopback port; READY once it holds the head's snapshot. `local REVISION TIMEOUT`: once it has taken the head's
  REVISION (or a later one), its own revision then, which its watchers reach when it has pushed that.
* `head CONFIG OPTIONS`: a gym_rpc head serving the config document in the JSON file CONFIG, with HeadOptions
  from the JSON text OPTIONS, so its CPU and memory are its own (read from /proc by the bench).

Each prints one `READY {json}` line once it serves, then runs until its stdin closes or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web

LOOPBACK = "127.0.0.1"
READY_PREFIX = "READY "
REPO_ROOT = Path(__file__).resolve().parent.parent


# --- many servers in one process ---------------------------------------------------------------------------------


class Listeners:
    """K listeners of one aiohttp app; a request is counted against the port it arrived on."""

    def __init__(self) -> None:
        self.ports: list[int] = []
        self.counts: dict[int, int] = {}
        self.sites: list[web.TCPSite | None] = []
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        if sockname is not None:
            port = int(sockname[1])
            self.counts[port] = self.counts.get(port, 0) + 1
        return web.Response(text="ok")

    async def start(self, count: int) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        for _ in range(count):
            site = web.TCPSite(self.runner, LOOPBACK, 0, reuse_address=True)
            await site.start()
            server = site._server  # the asyncio server: the one place aiohttp keeps the bound port
            assert isinstance(server, asyncio.base_events.Server)
            self.ports.append(int(server.sockets[0].getsockname()[1]))
            self.sites.append(site)

    async def command(self, line: str) -> Any:
        verb, _, argument = line.strip().partition(" ")
        if verb == "counts":
            return [self.counts.get(port, 0) for port in self.ports]
        index = int(argument)
        site = self.sites[index]
        if verb == "stop" and site is not None:
            await site.stop()
            self.sites[index] = None
        elif verb == "start" and site is None:
            assert self.runner is not None
            site = web.TCPSite(self.runner, LOOPBACK, self.ports[index], reuse_address=True)
            await site.start()
            self.sites[index] = site
        return {"ok": verb}


async def serve_listeners(count: int) -> None:
    listeners = Listeners()
    await listeners.start(count)
    print(READY_PREFIX + json.dumps({"ports": listeners.ports}), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:  # the bench went away
            return
        print(json.dumps(await listeners.command(line)), flush=True)


# --- many watches in one process --------------------------------------------------------------------------------


class WatchProcess:
    """COUNT raw status watches; each remembers the highest `step` label it has received."""

    def __init__(self, address: str, count: int) -> None:
        self.address, self.count = address, count
        self.best = [-1] * count
        self.messages = [0] * count
        self.reached: list[float | None] = [None] * count
        self.target: int | None = None
        self.ready = 0
        self.errors: list[str] = []

    async def start(self) -> list[Any]:
        import grpc

        from gym_rpc.v1 import control_plane_pb2_grpc as pb_grpc

        channels, request = _watch_channels(self.address, self.count)

        async def follow(index: int) -> None:
            stub = pb_grpc.ControlPlaneServiceStub(channels[index // 100])
            try:
                first = True
                async for message in stub.WatchServerStatuses(request):
                    now = time.time()
                    if first:
                        self.ready += 1
                        first = False
                    self.messages[index] += 1
                    for report in message.reports:
                        for instance in report.instances:
                            step = instance.labels.get("step")
                            if step is not None and int(step) > self.best[index]:
                                self.best[index] = int(step)
                    target = self.target
                    if target is not None and self.reached[index] is None and self.best[index] >= target:
                        self.reached[index] = now
            except grpc.aio.AioRpcError as error:
                self.errors.append(f"{error.code().name}: {error.details()}")

        return [asyncio.create_task(follow(i)) for i in range(self.count)]

    async def command(self, line: str) -> Any:
        verb, _, argument = line.strip().partition(" ")
        if verb == "target":
            self.target = int(argument)
            self.messages = [0] * self.count
            self.reached = [t if b >= self.target else None for t, b in zip(self.reached, self.best, strict=True)]
            return {"ok": verb}
        if verb == "wait":
            deadline = time.monotonic() + float(argument)
            while any(r is None for r in self.reached) and time.monotonic() < deadline:  # noqa: ASYNC110 (polled)
                await asyncio.sleep(0.01)
            reached = [r for r in self.reached if r is not None]
            return {
                "last": max(reached) if reached else None,
                "missing": self.count - len(reached),
                "messages": self.messages,
                "errors": self.errors[:3],
            }
        raise ValueError(f"unknown command {line!r}")


def _watch_channels(address: str, count: int) -> tuple[list[Any], Any]:
    """Channels for `count` watches, 100 streams to each (distinct channel args: not shared by grpc), and the one
    WatchServerStatuses request every watch sends."""
    import grpc

    from gym_rpc.v1 import control_plane_pb2 as pb

    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.enable_http_proxy", 0), ("bench.watchers", i)])
        for i in range((count + 99) // 100)
    ]
    request = pb.WatchServerStatusesRequest()
    request.heartbeat_interval.FromSeconds(60)
    return channels, request


def revision_of(data: bytes) -> int:
    """Field 2 (`revision`, a varint) of a serialised WatchServerStatusesResponse, read without parsing the rest:
    fields are walked by their tags, the length-delimited ones (reports) skipped by their length."""
    at, end = 0, len(data)
    while at < end:
        tag, at = _varint(data, at)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, at = _varint(data, at)
            if field == 2:
                return value
        elif wire == 2:
            length, at = _varint(data, at)
            at += length
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        else:
            raise ValueError(f"wire type {wire} in a WatchServerStatusesResponse")
    return 0  # proto3 leaves a zero revision out


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


class RevisionWatchers:
    """COUNT raw status watches that note when each message came and the revision it brings them to; the first
    also parses its messages and keeps the highest `step` label, a check that a revision carries the change."""

    def __init__(self, address: str, count: int) -> None:
        self.address, self.count = address, count
        self.current = [-1] * count  # each watch's latest revision
        self.arrivals: list[list[tuple[float, int]]] = [[] for _ in range(count)]  # since `mark`: (time, revision)
        self.best_step = -1  # the checking watch's highest step label
        self.ready = 0
        self.errors: list[str] = []

    async def start(self) -> list[Any]:
        import grpc

        from gym_rpc.v1 import control_plane_pb2 as pb

        channels, request = _watch_channels(self.address, self.count)
        method = "/gym_rpc.v1.ControlPlaneService/WatchServerStatuses"
        raw = [
            channel.unary_stream(
                method,
                request_serializer=pb.WatchServerStatusesRequest.SerializeToString,
                response_deserializer=None,  # the bytes as they came
            )
            for channel in channels
        ]

        async def follow(index: int) -> None:
            current = self.current
            try:
                async for data in raw[index // 100](request):
                    revision = revision_of(data)
                    self.arrivals[index].append((time.time(), revision))  # `mark` replaces the lists
                    if current[index] < 0:
                        self.ready += 1
                    current[index] = revision
                    if index == 0:
                        self._check(pb.WatchServerStatusesResponse.FromString(data))
            except grpc.aio.AioRpcError as error:
                self.errors.append(f"{error.code().name}: {error.details()}")

        return [asyncio.create_task(follow(i)) for i in range(self.count)]

    def _check(self, message: Any) -> None:
        for report in message.reports:
            for instance in report.instances:
                step = instance.labels.get("step")
                if step is not None and int(step) > self.best_step:
                    self.best_step = int(step)

    async def command(self, line: str) -> Any:
        verb, *arguments = line.split()
        if verb == "mark":
            self.arrivals = [[] for _ in range(self.count)]
            return {"ok": verb}
        if verb == "reach":
            revision, timeout = int(arguments[0]), float(arguments[1])
            deadline = time.monotonic() + timeout
            while min(self.current) < revision and time.monotonic() < deadline:  # noqa: ASYNC110 (polled)
                await asyncio.sleep(0.01)
            firsts = [next((t for t, r in arrived if r >= revision), None) for arrived in self.arrivals]
            reached = [t for t in firsts if t is not None]
            return {
                "last": max(reached) if reached else None,
                "missing": self.count - len(reached),
                "messages": [len(arrived) for arrived in self.arrivals],
                "best_step": self.best_step,
                "errors": self.errors[:3],
            }
        raise ValueError(f"unknown command {line!r}")


async def serve_watchers(address: str, count: int, revisions: bool = False) -> None:
    watchers: WatchProcess | RevisionWatchers = (
        RevisionWatchers(address, count) if revisions else WatchProcess(address, count)
    )
    tasks = await watchers.start()
    deadline = time.monotonic() + 300
    while watchers.ready < count and not watchers.errors and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    if watchers.ready < count:
        print(f"only {watchers.ready} of {count} watches started: {watchers.errors[:3]}", flush=True)
        return
    print(READY_PREFIX + json.dumps({"watchers": count}), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            for task in tasks:
                task.cancel()
            return
        print(json.dumps(await watchers.command(line)), flush=True)


# --- a storm of registrations ------------------------------------------------------------------------------------


async def serve_registrar(address: str, connections: int, ports: list[int]) -> None:
    import grpc

    from gym_rpc.v1 import control_plane_pb2 as pb
    from gym_rpc.v1 import control_plane_pb2_grpc as pb_grpc

    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.enable_http_proxy", 0), ("bench.registrar", i)])
        for i in range(connections)
    ]
    for channel in channels:
        await asyncio.wait_for(channel.channel_ready(), 60)
    stubs = [pb_grpc.ControlPlaneServiceStub(channel) for channel in channels]

    async def change(k: int, base: int, at: float) -> tuple[float, float, str]:
        await asyncio.sleep(max(0.0, at - time.time()))
        request = pb.RegisterServerInstanceRequest(
            server_name="server_0000",
            listen_host=LOOPBACK,
            listen_port=ports[k % len(ports)],
            pid=100000 + k % len(ports),
        )
        request.labels["step"] = str(base + k)
        sent = time.time()
        try:
            await stubs[k % len(stubs)].RegisterServerInstance(request, timeout=120)
        except grpc.aio.AioRpcError as error:
            return sent, time.time(), f"{error.code().name}: {error.details()}"
        return sent, time.time(), ""

    print(READY_PREFIX + json.dumps({"connections": connections}), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            for channel in channels:
                await channel.close(None)
            return
        verb, base, count, seconds, at, share, shares = line.split()
        assert verb == "storm", line
        total, spacing, start = int(count), float(seconds) / int(count), float(at)
        mine = range(int(share), total, int(shares))
        done = await asyncio.gather(*(change(k, int(base), start + k * spacing) for k in mine))
        errors = [error for _, _, error in done if error]
        print(
            json.dumps(
                {
                    "sent": [sent for sent, _, _ in done],
                    "answered": [answered for _, answered, _ in done],
                    "errors": errors[:3],
                    "failed": len(errors),
                }
            ),
            flush=True,
        )


# --- a worker ----------------------------------------------------------------------------------------------------


async def serve_worker(head: str) -> None:
    from gym_rpc.client import ServerClient
    from gym_rpc.config import BaseServerConfig

    host, _, port = head.rpartition(":")
    client = ServerClient.load_from_global_config(BaseServerConfig(host=host, port=int(port)))
    response = await client.post("policy_model", "/v1/responses", json={})
    assert response.status == 200, response.status
    print(READY_PREFIX + json.dumps({"ok": True}), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            await client.aclose()
            return
        seconds = float(line.split()[1])
        calls, started, cpu = 0, time.monotonic(), time.process_time()
        while time.monotonic() - started < seconds:
            await client.post("policy_model", "/v1/responses", json={})
            calls += 1
        elapsed, cpu = time.monotonic() - started, time.process_time() - cpu
        # process_time: every thread of the worker (its event loop, the follower, gRPC's own threads)
        print(json.dumps({"calls_per_second": calls / elapsed, "calls_per_cpu_second": calls / cpu}), flush=True)


# --- the floor: a bare gRPC server ----------------------------------------------------------------------------


async def serve_bare() -> None:
    import grpc

    from gym_rpc.v1 import control_plane_pb2 as pb

    loop = asyncio.get_running_loop()
    pushed: dict[str, Any] = {"revision": 0, "next": loop.create_future(), "messages": {}}

    def message(revision: int) -> bytes:
        change = pb.WatchServerStatusesResponse(type=pb.WATCH_EVENT_TYPE_CHANGE, revision=revision)
        instance = change.reports.add(server_name="server_0000").instances.add(instance_id="x", url="http://x")
        instance.labels["step"] = str(revision)
        return change.SerializeToString()

    pushed["messages"][0] = message(0)

    async def watch(request: Any, context: Any) -> None:
        seen = -1
        while True:
            while seen < pushed["revision"]:  # again after each write: a push may have come during it
                seen = pushed["revision"]
                await context.write(pushed["messages"][seen])
            await asyncio.shield(pushed["next"])

    handler = grpc.unary_stream_rpc_method_handler(
        watch, request_deserializer=pb.WatchServerStatusesRequest.FromString, response_serializer=bytes
    )
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 128)])
    service = grpc.method_handlers_generic_handler(
        "gym_rpc.v1.ControlPlaneService", {"WatchServerStatuses": handler}
    )
    server.add_generic_rpc_handlers((service,))
    port = server.add_insecure_port(f"{LOOPBACK}:0")
    await server.start()
    print(READY_PREFIX + json.dumps({"address": f"{LOOPBACK}:{port}", "port": port}), flush=True)
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            await server.stop(None)
            return
        revision = pushed["revision"] + 1
        pushed["messages"][revision] = message(revision)
        pushed["revision"] = revision
        waiting, pushed["next"] = pushed["next"], loop.create_future()
        waiting.set_result(None)
        print(json.dumps({"revision": revision}), flush=True)


# --- a node's watch relay --------------------------------------------------------------------------------------


async def serve_relay(head: str) -> None:
    from gym_rpc.server.watch_relay import WatchRelay

    relay = WatchRelay(head, f"{LOOPBACK}:0")
    await relay.start()
    deadline = time.monotonic() + 300
    while not relay.mirror.synced and time.monotonic() < deadline:  # noqa: ASYNC110 (polled)
        await asyncio.sleep(0.05)
    if not relay.mirror.synced:
        print(f"the relay took no snapshot from {head} within 300 s", flush=True)
        await relay.stop()
        return
    print(READY_PREFIX + json.dumps({"address": relay.address}), flush=True)
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            verb, *arguments = line.split()
            if verb != "local":
                raise ValueError(f"unknown command {line!r}")
            revision, timeout = int(arguments[0]), float(arguments[1])
            until = time.monotonic() + timeout
            while relay.mirror.head_revision < revision and time.monotonic() < until:  # noqa: ASYNC110 (polled)
                await asyncio.sleep(0.005)
            reached = relay.mirror.head_revision >= revision
            print(json.dumps({"revision": relay.mirror.revision, "reached": reached}), flush=True)
    finally:
        await relay.stop()


# --- a head on its own -------------------------------------------------------------------------------------------


async def serve_head(document: dict[str, Any], options_json: str) -> None:
    from gym_rpc.config import GlobalConfig
    from gym_rpc.server import HeadOptions, HeadServer

    head = HeadServer(GlobalConfig.from_document(document), HeadOptions(**json.loads(options_json)))
    await head.start()
    print(READY_PREFIX + json.dumps({"address": head.address, "port": head.port}), flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    stdin_closed = loop.run_in_executor(None, sys.stdin.read)
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait((stdin_closed, waiter), return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    await head.stop()


# --- the bench's side: start, talk to, stop ----------------------------------------------------------------------


class Child:
    """A `python -m bench.scale_procs ...` child: started, waited for (bounded), talked to, stopped."""

    def __init__(self, *args: str, ready_timeout: float = 120.0, nice: int = 0) -> None:
        """`nice`: the child's niceness (a process standing in for work on another machine: it takes only the
        cores the measured processes leave)."""
        # The child's log (the head logs status changes of overloaded servers) is not the report, but says why
        # a child did not start.
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in stop(), after the child)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.scale_procs", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=REPO_ROOT,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )
        line = self._read_line(ready_timeout)
        if not line.startswith(READY_PREFIX):
            self.process.kill()  # ended before its log is read: stop() closes it
            self.process.wait(10)
            self._log.seek(0)
            log = self._log.read()[-2000:]
            self.stop()
            raise RuntimeError(
                f"{args[0]} did not start (no READY line in {ready_timeout}s; it said {line.strip()!r}); stderr "
                f"ends:\n{log}"
            )
        self.info: dict[str, Any] = json.loads(line[len(READY_PREFIX) :])

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read_line(self, timeout: float) -> str:
        result: list[str] = []
        assert self.process.stdout is not None
        stdout = self.process.stdout
        reader = threading.Thread(target=lambda: result.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        return result[0] if result else ""

    def ask(self, command: str, timeout: float = 30.0) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        line = self._read_line(timeout)
        if not line:
            raise RuntimeError(f"no answer to {command!r} within {timeout}s")
        return json.loads(line)

    def stop(self) -> None:
        """Close its stdin (it ends by itself on EOF); SIGTERM, then SIGKILL, only for a child that does not. A
        signal alone would leave it waiting on the thread that reads stdin, which no signal stops."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        for ending in (None, self.process.terminate, self.process.kill):
            if ending is not None:
                ending()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
                break
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()


def main() -> None:
    role = sys.argv[1]
    if role == "servers":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        asyncio.run(serve_listeners(int(sys.argv[2])))
    elif role == "flood":
        from bench.flood_head import serve

        document = json.loads(Path(sys.argv[2]).read_text(encoding="utf-8"))
        asyncio.run(serve(document, int(sys.argv[3]), flood=sys.argv[4:] != ["quiet"]))
    elif role == "worker":
        asyncio.run(serve_worker(sys.argv[2]))
    elif role == "watchers":
        asyncio.run(serve_watchers(sys.argv[2], int(sys.argv[3]), revisions=sys.argv[4:] == ["revisions"]))
    elif role == "registrar":
        asyncio.run(serve_registrar(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])))
    elif role == "bare":
        asyncio.run(serve_bare())
    elif role == "relay":
        asyncio.run(serve_relay(sys.argv[2]))
    elif role == "head":
        asyncio.run(serve_head(json.loads(Path(sys.argv[2]).read_text(encoding="utf-8")), sys.argv[3]))
    else:
        raise SystemExit(
            f"unknown role {role!r}: servers K | watchers ADDRESS COUNT [revisions] | registrar | flood | worker "
            "| bare | relay | head"
        )


if __name__ == "__main__":
    main()
