"""The processes the benchmarks measure against, each started as a subprocess so client and server never share an
interpreter (`python -m bench.servers data|control`). Each prints one `READY {json}` line once it listens, then
serves until SIGTERM or its stdin closes (so none outlives the bench).

* data: an aiohttp server answering `POST /v1/responses` with a small Responses-API-shaped body, `GET /` with
  `{"status": "ok"}`, and `/slow?seconds=S` after a pause (to saturate pools and hold requests in flight).
* control: two gym_rpc heads (A: N answering Gym servers; B: N-K of them plus K that accept connections and never
  answer), and a NeMo Gym-style HTTP head serving A's config as `GET /global_config_dict_yaml` (a JSON string
  holding YAML, as NeMo Gym's FastAPI head answers). The Gym servers run in a `fleet` child process and each
  head in a child of its own, as deployed: no head's event loop also serves the servers it probes, or another
  head.
* fleet: the N answering servers (`GET /` answers `{"status": "ok"}`) and the K silent ones.
* head: one gym_rpc head over the servers at `--ports` (the control process starts A and B as heads).
* replica: one instance of a replicated model server (bench/replicas.py): `POST /v1/responses` answers
  `{"instance": <its port>}` after `--delay-ms`, serving at most `--slots` calls at once (the rest queue, as on a
  server whose capacity is full); `--register HOST:PORT` registers it with that head as an instance of `--name`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

LOOPBACK = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parent.parent
READY_PREFIX = "READY "
RESPONSE_BODY = json.dumps(
    {
        "id": "resp_bench",
        "object": "response",
        "model": "policy",
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": "msg_bench",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "The answer is 42.", "annotations": []}],
            }
        ],
        "usage": {"input_tokens": 120, "output_tokens": 8, "total_tokens": 128},
    }
).encode()
OK_BODY = b'{"status": "ok"}'


# --- data server -------------------------------------------------------------------------------------------------


async def _responses(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=RESPONSE_BODY, content_type="application/json")


async def _ok(request: web.Request) -> web.Response:
    return web.Response(body=OK_BODY, content_type="application/json")


async def _slow(request: web.Request) -> web.Response:
    await request.read()
    await asyncio.sleep(min(float(request.query.get("seconds", "0.5")), 30.0))
    return web.Response(body=OK_BODY, content_type="application/json")


def data_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/responses", _responses)
    # With observability on, model calls carry the rollout prefix (the tracing-cost bench binds one), as model
    # servers accept it.
    app.router.add_post("/ng-rollout/{rollout_id}/v1/responses", _responses)
    app.router.add_route("*", "/slow", _slow)
    app.router.add_get("/", _ok)
    return app


async def serve_data() -> dict[str, Any]:
    runner = web.AppRunner(data_app(), access_log=None)
    await runner.setup()
    # A deep backlog: the memory bench opens thousands of connections at once.
    site = web.TCPSite(runner, LOOPBACK, 0, backlog=8192)
    await site.start()
    return {"port": int(runner.addresses[0][1])}


# --- control servers ---------------------------------------------------------------------------------------------


def server_entry_doc(index: int, port: int) -> tuple[str, dict[str, Any]]:
    """A NeMo Gym-like entry (models, resources servers and agents in turn), with the usual handful of keys."""
    kind = index % 3
    if kind == 0:
        name = f"policy_model_{index}"
        entry: dict[str, Any] = {
            "responses_api_models": {
                "vllm_model": {
                    "host": LOOPBACK,
                    "port": port,
                    "entrypoint": "app.py",
                    "base_url": f"http://{LOOPBACK}:{port + 1}/v1",
                    "model": "Qwen/Qwen3-8B",
                    "return_token_id_information": False,
                    "uses_reasoning_parser": True,
                }
            }
        }
    elif kind == 1:
        name = f"math_resources_{index}"
        entry = {
            "resources_servers": {
                "math_with_judge": {
                    "host": LOOPBACK,
                    "port": port,
                    "entrypoint": "app.py",
                    "domain": "math",
                    "verified": False,
                    "judge_model_server": {"type": "responses_api_models", "name": "policy_model_0"},
                }
            }
        }
    else:
        name = f"math_agent_{index}"
        entry = {
            "responses_api_agents": {
                "simple_agent": {
                    "host": LOOPBACK,
                    "port": port,
                    "entrypoint": "app.py",
                    "resources_server": {"type": "resources_servers", "name": f"math_resources_{index - 1}"},
                    "model_server": {"type": "responses_api_models", "name": "policy_model_0"},
                    "datasets": [{"name": "train", "type": "train", "jsonl_fpath": f"data/train_{index}.jsonl"}],
                }
            }
        }
    return name, entry


def config_doc(ports: list[int], names: list[str] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"head_server": {"host": LOOPBACK, "port": 0}}
    for index, port in enumerate(ports):
        name, entry = server_entry_doc(index, port)
        doc[names[index] if names else name] = entry
    doc["checkpoint"] = {"enabled": False}
    return doc


def nemo_style_head_app(doc: dict[str, Any]) -> web.Application:
    """NeMo Gym's head on the wire: the config rendered as YAML, returned as a JSON string literal.

    Rendered once at start (NeMo Gym's head keeps the rendering cheap too): the baseline pays only what its client
    does, so the comparison never flatters gym_rpc with server-side work.
    """
    from omegaconf import OmegaConf

    body = json.dumps(OmegaConf.to_yaml(OmegaConf.create(doc))).encode()

    async def global_config(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/global_config_dict_yaml", global_config)
    app.router.add_get("/", _ok)
    return app


@dataclass
class ControlOptions:
    servers: int
    silent: int
    probe_interval: float
    probe_timeout: float


async def _start_runner(app: web.Application, count: int) -> tuple[web.AppRunner, list[int]]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for _ in range(count):
        await web.TCPSite(runner, LOOPBACK, 0, backlog=1024).start()
    return runner, [int(address[1]) for address in runner.addresses]


async def _silent_ports(count: int, held: list[asyncio.StreamWriter]) -> list[int]:
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    ports = []
    for _ in range(count):
        server = await asyncio.start_server(hold, LOOPBACK, 0)
        ports.append(int(server.sockets[0].getsockname()[1]))
    return ports


async def serve_fleet(options: ControlOptions) -> dict[str, Any]:
    answering_app = web.Application()
    answering_app.router.add_get("/", _ok)
    _, ports = await _start_runner(answering_app, options.servers)
    return {"ports": ports, "silent_ports": await _silent_ports(options.silent, _HELD)}


async def serve_head(options: ControlOptions, ports: list[int]) -> dict[str, Any]:
    """One gym_rpc head over `config_doc(ports)`, probing those servers."""
    from gym_rpc.config import GlobalConfig
    from gym_rpc.server._head import HeadOptions, HeadServer

    head_options = HeadOptions(
        port=0,
        probe_interval_seconds=options.probe_interval,
        probe_timeout_seconds=options.probe_timeout,
        reflection=False,
    )
    head = HeadServer(GlobalConfig.from_document(config_doc(ports)), head_options)
    await head.start()
    _HEADS.append(head)
    return {"port": head.port, "names": list(head.config.servers), "document": head.config.document}


async def serve_control(options: ControlOptions) -> dict[str, Any]:
    """The fleet and each head in a process of its own (as deployed: a head's event loop serves no Gym server and
    no other head), and the NeMo Gym-style HTTP head (serving head A's document) here."""
    fleet = await _child("fleet", f"--servers={options.servers}", f"--silent={options.silent}")
    ports, silent_ports = fleet.info["ports"], fleet.info["silent_ports"]
    mixed_ports = ports[: options.servers - options.silent] + silent_ports
    probing = (f"--probe-interval={options.probe_interval}", f"--probe-timeout={options.probe_timeout}")
    head_a = await _child("head", "--ports=" + ",".join(map(str, ports)), *probing)
    head_b = await _child("head", "--ports=" + ",".join(map(str, mixed_ports)), *probing)
    _, (http_head_port,) = await _start_runner(nemo_style_head_app(head_a.info["document"]), 1)
    return {
        "head_a": head_a.info["port"],
        "head_b": head_b.info["port"],
        "http_head": http_head_port,
        "names_a": head_a.info["names"],
        "urls_a": [f"http://{LOOPBACK}:{port}" for port in ports],
        "urls_b": [f"http://{LOOPBACK}:{port}" for port in mixed_ports],
    }


async def _child(*args: str) -> ServerProcess:
    """A `python -m bench.servers` child of this one, stopped when this one stops (or dies: its stdin closes)."""
    child = await asyncio.to_thread(ServerProcess, *args)
    _CHILDREN.append(child)
    return child


_HELD: list[asyncio.StreamWriter] = []
_HEADS: list[Any] = []
_CHILDREN: list[ServerProcess] = []


# --- replica servers ---------------------------------------------------------------------------------------------


@dataclass
class ReplicaOptions:
    port: int
    delay_ms: float
    slots: int
    register: str
    name: str


async def serve_replica(options: ReplicaOptions) -> dict[str, Any]:
    slots = asyncio.Semaphore(options.slots)
    delay = options.delay_ms / 1000
    body: list[bytes] = []

    async def responses(request: web.Request) -> web.Response:
        await request.read()
        async with slots:
            if delay:
                await asyncio.sleep(delay)
        return web.Response(body=body[0], content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/ng-rollout/{rollout_id}/v1/responses", responses)
    app.router.add_get("/", _ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, options.port, backlog=4096, reuse_address=True).start()
    port = int(runner.addresses[0][1])
    body.append(json.dumps({"instance": port}).encode())
    if options.register:
        from gym_rpc.config import BaseServerConfig, parse_host_port
        from gym_rpc.integrations import ServerRegistration

        host, head_port = parse_host_port(options.register, "--register")
        registration = ServerRegistration(
            options.name, port, head=BaseServerConfig(host=host, port=head_port), refresh_seconds=None
        )
        if not await registration.aregister():
            raise RuntimeError(f"the head at {options.register} refused the registration of {options.name}")
    return {"port": port}


# --- process plumbing --------------------------------------------------------------------------------------------


async def _serve(kind: str, options: ControlOptions, replica: ReplicaOptions, ports: list[int]) -> None:
    if kind == "replica":
        info = await serve_replica(replica)
    elif kind == "fleet":
        info = await serve_fleet(options)
    elif kind == "head":
        info = await serve_head(options, ports)
    else:
        info = await (serve_data() if kind == "data" else serve_control(options))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # The parent holds our stdin open; when it dies, stdin closes and we stop too.
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()
    print(READY_PREFIX + json.dumps(info), flush=True)
    await stop.wait()
    for head in _HEADS:
        with contextlib.suppress(Exception):
            await head.stop()
    for child in _CHILDREN:
        child.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.servers")
    parser.add_argument("kind", choices=["data", "control", "fleet", "head", "replica"])
    parser.add_argument("--servers", type=int, default=200)
    parser.add_argument("--silent", type=int, default=2)
    parser.add_argument("--probe-interval", type=float, default=2.0)
    parser.add_argument("--probe-timeout", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--slots", type=int, default=100000)
    parser.add_argument("--register", default="", metavar="HOST:PORT")
    parser.add_argument("--name", default="policy_model")
    parser.add_argument("--ports", default="", help="head: the comma-separated ports of the servers it probes")
    args = parser.parse_args(argv)
    options = ControlOptions(args.servers, args.silent, args.probe_interval, args.probe_timeout)
    replica = ReplicaOptions(args.port, args.delay_ms, args.slots, args.register, args.name)
    ports = [int(port) for port in args.ports.split(",") if port]
    asyncio.run(_serve(args.kind, options, replica, ports))


class ServerProcess:
    """A `python -m bench.servers ...` child: started, waited for (bounded), stopped."""

    def __init__(self, *args: str, ready_timeout: float = 60.0) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.servers", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )
        self.info = self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self._read_ready_line()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not result or not result[0].startswith(READY_PREFIX):
            self.stop()
            raise RuntimeError(f"bench server {self.process.args!r} did not start within {timeout}s")
        info: dict[str, Any] = json.loads(result[0][len(READY_PREFIX) :])
        return info

    def _read_ready_line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline()

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        terminate(self.process)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _threads(pid: int) -> list[int]:
    """Every thread of a process (Linux): an affinity is set per thread."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


@contextlib.contextmanager
def pinned_apart(server_pid: int) -> Iterator[None]:
    """This process (and the processes it starts meanwhile) on one core and the data server on another, where the
    machine has two and lets us (os.sched_setaffinity): as rollout workers and model servers run, neither taking
    the other's core. Both get their cores back afterwards."""
    if not hasattr(os, "sched_setaffinity"):
        print("not pinned: no sched_setaffinity here", file=sys.stderr)
        yield
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print(f"not pinned: one usable core ({cores})", file=sys.stderr)
        yield
        return
    placed = {os.getpid(): {cores[0]}, server_pid: {cores[1]}}
    before: dict[int, set[int]] = {}
    for pid, core in placed.items():
        for tid in _threads(pid):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended since it was listed
                before[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, core)
    print(f"client pinned to CPU {cores[0]}, data server to CPU {cores[1]}", file=sys.stderr)
    try:
        yield
    finally:
        for tid, affinity in before.items():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, affinity)


def terminate(process: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL if it has not ended within 10 s (bounded either way)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def wait_until(condition: Any, timeout: float, interval: float = 0.05) -> bool:
    """Poll `condition()` until true or `timeout` (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return False


if __name__ == "__main__":
    main()
