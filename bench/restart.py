"""`python -m bench.restart`: issue 40's restart and failover runs on loopback, spliced into bench/SCALE.md.

* restart: a `gym-rpc head` in its own process serving a config instance, four replicas registering with it (the
  helper's defaults: renewed every 10 s, and again at once when the head is new), and a worker (a ServerClient
  following the head) running 1,000 rollouts of 4 calls each, 50 at a time, 0.3 s apart. After a quarter of the
  calls the head is killed with -9 and started again on its port 10 s later, once with its registrations file and
  once without it. Counted: failed calls, rollouts that moved off the instance they were on (none died), and
  `gym-rpc status` runs (one every second while the head serves) that said a server was not up.
* failover: two heads serving one config, the replicas registering with both, the worker given both addresses;
  the head the worker follows is killed with -9 mid-run: failed calls, and seconds until its follower is on the
  other head.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from gym_rpc.client import ServerClient
from gym_rpc.client._follower import _followers, close_instance_followers
from gym_rpc.client.server_client import rollout_context
from gym_rpc.config import BaseServerConfig
from gym_rpc.integrations import register_aiohttp_app

SCALE_PATH = Path(__file__).resolve().parent / "SCALE.md"
LOOPBACK = "127.0.0.1"
NAME = "sessions"
START = "<!-- restart and failover: python -m bench.restart -->"
END = "<!-- end of restart and failover -->"
LISTENING = re.compile(r"listening on (\S+)")


@dataclass(frozen=True)
class Plan:
    rollouts: int = 1000
    calls: int = 4
    concurrency: int = 50
    pause: float = 0.3  # between a rollout's calls
    replicas: int = 4
    down_seconds: float = 10.0


QUICK = Plan(rollouts=40, calls=3, concurrency=10, pause=0.05, replicas=2, down_seconds=1.0)


@dataclass
class Run:
    name: str
    calls: int = 0
    failed: list[str] = field(default_factory=list)
    where: dict[str, set[int]] = field(default_factory=dict)
    status_runs: int = 0
    status_not_up: int = 0  # status runs that answered and named a server not up
    failover_seconds: float | None = None
    seconds: float = 0.0

    @property
    def moved(self) -> int:
        return sum(1 for ports in self.where.values() if len(ports) > 1)


class Head:
    """`gym-rpc head` in a process of its own."""

    def __init__(self, config: Path, port: int = 0) -> None:
        command = [sys.executable, "-m", "gym_rpc", "head", "--config", str(config), "--port", str(port)]
        command += ["--probe-interval", "0.5"]
        env = {k: v for k, v in os.environ.items() if k != "GYM_RPC_HEAD"}
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.address = ""
        deadline = time.monotonic() + 120
        assert self.process.stdout is not None
        for line in self.process.stdout:
            match = LISTENING.search(line)
            if match:
                self.address = match.group(1)
                break
            if time.monotonic() > deadline:
                break
        if not self.address:
            self.process.kill()
            raise RuntimeError("the head did not start")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for _ in self.process.stdout:
            pass

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(30)


async def _replica(heads: str) -> tuple[web.AppRunner, int]:
    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    listener.listen(512)
    port = int(listener.getsockname()[1])

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"port": port})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    register_aiohttp_app(app, NAME, port, head=heads, listen_host=LOOPBACK)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, listener).start()
    return runner, port


def _status(address: str, run: Run, stop: threading.Event, paused: threading.Event) -> None:
    """`gym-rpc status` every second while the head serves (not while it is down: nothing answers then)."""
    while not stop.wait(1.0):
        if paused.is_set():
            continue
        result = subprocess.run(
            [sys.executable, "-m", "gym_rpc", "status", "--head", address, "--output", "json", "--timeout", "5"],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        try:
            rows = json.loads(result.stdout)
        except ValueError:
            continue
        run.status_runs += 1
        if any(row.get("status") != "success" for row in rows):
            run.status_not_up += 1


async def _rollouts(client: ServerClient, plan: Plan, run: Run) -> None:
    queue = iter(range(plan.rollouts))

    async def worker() -> None:
        for index in queue:
            rollout = f"rollout-{index}"
            for _ in range(plan.calls):
                try:
                    with rollout_context(rollout):
                        response = await client.post(NAME, "/seed_session", json={})
                        run.where.setdefault(rollout, set()).add((await response.json())["port"])
                except Exception as error:  # every failure counts, whatever it is
                    run.failed.append(f"{type(error).__name__}: {error}")
                run.calls += 1
                await asyncio.sleep(plan.pause)

    await asyncio.gather(*(worker() for _ in range(plan.concurrency)))


def _config(folder: Path, own: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    document: dict[str, Any] = {
        "head_server": {"host": LOOPBACK, "port": 0},
        NAME: {"resources_servers": {"bench": {"host": LOOPBACK, "port": own, "entrypoint": "app.py"}}},
    }
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


async def restart(plan: Plan, keep_file: bool, folder: Path) -> Run:
    run = Run("restart, registrations file kept" if keep_file else "restart, registrations file deleted")
    own_runner, own = await _replica_unregistered()
    config = _config(folder, own)
    head = await asyncio.to_thread(Head, config)
    host, port = head.address.rsplit(":", 1)
    runners = [own_runner]
    client = ServerClient.load_from_global_config(BaseServerConfig(host=host, port=int(port)))
    stop, paused = threading.Event(), threading.Event()
    try:
        for _ in range(plan.replicas):
            runners.append((await _replica(head.address))[0])
        await asyncio.sleep(1.5)  # the file written (every 0.2 s at most), the worker following every instance
        status = threading.Thread(target=_status, args=(head.address, run, stop, paused), daemon=True)
        status.start()
        started = time.monotonic()
        calls = asyncio.ensure_future(_rollouts(client, plan, run))
        while run.calls < plan.rollouts * plan.calls // 4 and not calls.done():  # noqa: ASYNC110 (polled)
            await asyncio.sleep(0.05)
        paused.set()
        await asyncio.to_thread(head.kill)
        if not keep_file:
            (config.parent / "config.yaml.registrations.json").unlink(missing_ok=True)
        await asyncio.sleep(plan.down_seconds)
        head = await asyncio.to_thread(Head, config, int(port))
        paused.clear()
        await calls
        run.seconds = time.monotonic() - started
    finally:
        stop.set()
        close_instance_followers()
        await client.aclose()
        head.kill()
        for runner in runners:
            await runner.cleanup()
    return run


async def _replica_unregistered() -> tuple[web.AppRunner, int]:
    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    listener.listen(512)
    port = int(listener.getsockname()[1])

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"port": port})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, listener).start()
    return runner, port


async def failover(plan: Plan, folder: Path) -> Run:
    run = Run("failover: the followed of two heads killed")
    own_runner, own = await _replica_unregistered()
    heads = [await asyncio.to_thread(Head, _config(folder / name, own)) for name in ("a", "b")]
    addresses = ",".join(head.address for head in heads)
    runners = [own_runner]
    host, port = heads[0].address.rsplit(":", 1)
    client = ServerClient.load_from_global_config(
        BaseServerConfig.model_validate(
            {"host": host, "port": int(port), "addresses": [head.address for head in heads]}
        )
    )
    try:
        for _ in range(plan.replicas):
            runners.append((await _replica(addresses))[0])
        await asyncio.sleep(1.5)
        started = time.monotonic()
        calls = asyncio.ensure_future(_rollouts(client, plan, run))
        while run.calls < plan.rollouts * plan.calls // 4 and not calls.done():  # noqa: ASYNC110 (polled)
            await asyncio.sleep(0.05)
        followers = [f for f in _followers.values() if f.address == addresses]
        followed = followers[0].source if followers else None
        victim = next((head for head in heads if head.address == followed), heads[0])
        other = next(head for head in heads if head is not victim)
        await asyncio.to_thread(victim.kill)
        killed = time.monotonic()
        while followers and followers[0].source != other.address and time.monotonic() - killed < 60:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if followers and followers[0].source == other.address:
            run.failover_seconds = time.monotonic() - killed
        await calls
        run.seconds = time.monotonic() - started
    finally:
        close_instance_followers()
        await client.aclose()
        for head in heads:
            head.kill()
        for runner in runners:
            await runner.cleanup()
    return run


def render(runs: list[Run], plan: Plan) -> str:
    lines = [
        START,
        "## A head restart and a failover, with rollouts in flight",
        "",
        f"`python -m bench.restart`: {plan.rollouts} rollouts of {plan.calls} calls ({plan.concurrency} at a "
        "time, "
        f"{plan.pause:g} s apart) from a worker following the head, over a config instance and {plan.replicas} "
        "registered replicas (the registration helper's defaults). Restart: the head killed -9 after a quarter of "
        f"the calls, started again on its port {plan.down_seconds:g} s later. Failover: two heads, the one the "
        "worker follows killed -9. A rollout moved: it was answered by more than one instance (none died). "
        "Status runs: `gym-rpc status` once a second while a head served, and those that named a server not up.",
        "",
        "| run | calls | failed | rollouts moved | status runs not all up | follower on the other head after "
        "| took |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        moved_over = "" if run.failover_seconds is None else f"{run.failover_seconds:.2f} s"
        status = f"{run.status_not_up} of {run.status_runs}" if run.status_runs else ""
        lines.append(
            f"| {run.name} | {run.calls} | {len(run.failed)} | {run.moved} of {len(run.where)} | {status} | "
            f"{moved_over} | {run.seconds:.0f} s |"
        )
    failures = sorted({f for run in runs for f in run.failed})[:3]
    if failures:
        lines += ["", "First failures: " + "; ".join(failures)]
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    lines += ["", f"(Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load}.)", END]
    return "\n".join(lines)


async def main_async(plan: Plan) -> list[Run]:
    with tempfile.TemporaryDirectory() as folder:
        runs = [await restart(plan, True, Path(folder) / "kept")]
        runs.append(await restart(plan, False, Path(folder) / "deleted"))
        runs.append(await failover(plan, Path(folder) / "two"))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.restart", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes; no file unless --out")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "GYM_RPC_HEAD"):
        os.environ.pop(name, None)
    plan = QUICK if args.quick else Plan()
    text = render(asyncio.run(main_async(plan)), plan)
    out = args.out if args.out is not None or args.quick else SCALE_PATH
    if out is not None:
        report = out.read_text(encoding="utf-8") if out.exists() else ""
        if START in report and END in report:
            before, rest = report.split(START, 1)
            report = before + text + rest.split(END, 1)[1]
        else:
            report = report.rstrip("\n") + "\n\n" + text + "\n"
        out.write_text(report, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
