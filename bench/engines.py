"""Simulated continuous-batching engines behind one model server name, and a GRPO multi-turn workload over them:
how much prefill each way of picking an engine wastes (`python -m bench.engines`; results in bench/RESULTS.md).

**The engine** (`serve`: E engines in one process, each an aiohttp server on a loopback port) models what routing
can change, nothing else:

* a prefix KV cache: the prompt (every input item's text, concatenated) cut into blocks of BLOCK_TOKENS tokens
  (CHARS_PER_TOKEN characters each), each block named by a hash chained over the blocks before it (as vLLM's
  automatic prefix caching names them); only full blocks are cached, LRU, at most CACHE_BLOCKS per engine;
* prefill: a call's uncached tokens cost PREFILL_SECONDS_PER_TOKEN each, one call at a time per engine (a queue);
* decode: OUTPUT_TOKENS tokens at DECODE_SECONDS_PER_TOKEN each, overlapping with other calls' decode (continuous
  batching), at most MAX_BATCH calls running at once (the rest wait, counted as waiting);
* `GET /metrics` in vLLM's names (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
  `vllm:kv_cache_usage_perc`), `GET /stats` (its prefill and cached tokens, calls), `POST /reset` (cold cache).

**Constants**, calibrated to the order of magnitude public reports give for an 8B model on one H100 with vLLM:
prefill throughput around 15,000 tokens/s, a decode step around 15 ms at moderate batch, block size 16 (vLLM's
default). Every duration is multiplied by TIME_SCALE (1/20) so a run takes seconds; ratios between pickers are
what the figures mean, not absolute times. CACHE_BLOCKS is scaled with the workload: one engine holds its share
of the run's prefixes under the oracle, not the whole run's.

**The workload**: P prompts x G rollouts x T turns. Every prompt is a system prompt the run shares
(SYSTEM_TOKENS), the prompt's task text (TASK_TOKENS), then per turn the model's answer and a tool result of the
rollout's own (TOOL_TOKENS). Two worker processes each take every other prompt and dispatch group by group,
GROUPS_IN_FLIGHT groups at a time, all G rollouts of a group at once, each rollout's turns one after the other.

**Pickers**, each over the same engines from cold caches:
* round robin: each worker cycles over the engines (raw aiohttp);
* rendezvous: the rollout's engine by gym_rpc's rendezvous on its id (today's rule for resources servers, and
  what model servers had before prefix-affine picking);
* default: gym_rpc's prefix-affine picking (the route ServerClient makes for a model server of these instances:
  `RoutedCall` with the prompt's number, the rollout's id), each call sent with raw aiohttp as the others are, so
  the row differs from the others by where calls land only;
* default (ServerClient): the same through `ServerClient.post` itself, the rollout bound (`rollout_context`);
* oracle: every rollout of prompt p on engine p mod E;
* vllm-router consistent_hash and cache_aware: the real router (the dev extra's wheel) in front of the engines,
  started afresh for each, every call sent to it with the rollout's id in `X-Session-ID`.

Figures: makespan, prefill tokens (and against the oracle's), cache hit rate (cached / prompt tokens), p99 turn
latency, calls per engine. A second scenario puts one of 8 engines at 4x the cost (prefill and decode).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from bench.stats import percentile

LOOPBACK = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parent.parent
NAME = "policy_model"

# --- the engine's constants --------------------------------------------------------------------------------------
TIME_SCALE = 1 / 20
BLOCK_TOKENS = 16
CHARS_PER_TOKEN = 4
PREFILL_SECONDS_PER_TOKEN = TIME_SCALE / 15000
DECODE_SECONDS_PER_TOKEN = TIME_SCALE * 0.015
MAX_BATCH = 64
CACHE_BLOCKS = 1200  # 19,200 tokens per engine

# --- the workload's --------------------------------------------------------------------------------------------
SYSTEM_TOKENS = 1000
TASK_TOKENS = 600
TOOL_TOKENS = 120
OUTPUT_TOKENS = 20
GROUPS_IN_FLIGHT = 2


@dataclass(frozen=True)
class Workload:
    prompts: int = 16
    group: int = 8
    turns: int = 3
    workers: int = 2


def _text(tokens: int, seed: str) -> str:
    """`tokens` tokens of text that differ from any other seed's from their first block on."""
    unit = f"{seed}|"
    return (unit * (tokens * CHARS_PER_TOKEN // len(unit) + 1))[: tokens * CHARS_PER_TOKEN]


SYSTEM = _text(SYSTEM_TOKENS, "system prompt every rollout shares")


# --- the engine ------------------------------------------------------------------------------------------------


class Engine:
    """One simulated engine: its cache, its prefill queue, its batch, its counters."""

    def __init__(self, slow: float) -> None:
        self.slow = slow
        self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.prefill = asyncio.Lock()
        self.batch = asyncio.Semaphore(MAX_BATCH)
        self.waiting = 0
        self.running = 0
        self.reset()

    def reset(self) -> None:
        self.cache.clear()
        self.prefill_tokens = 0
        self.cached_tokens = 0
        self.calls = 0

    def lookup(self, text: str) -> tuple[list[int], int]:
        """The chained hashes of the prompt's full blocks, and how many leading ones the cache holds."""
        size = BLOCK_TOKENS * CHARS_PER_TOKEN
        hashes, chained = [], 0
        for start in range(0, len(text) - size + 1, size):
            chained = hash((chained, text[start : start + size]))
            hashes.append(chained)
        hits = 0
        for block in hashes:
            if block not in self.cache:
                break
            self.cache.move_to_end(block)
            hits += 1
        return hashes, hits

    def store(self, hashes: list[int]) -> None:
        for block in hashes:
            self.cache[block] = None
            self.cache.move_to_end(block)
        while len(self.cache) > CACHE_BLOCKS:
            self.cache.popitem(last=False)

    async def respond(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = "".join(str(item.get("content") or item.get("output") or "") for item in body["input"])
        tokens = len(text) // CHARS_PER_TOKEN
        self.waiting += 1
        async with self.batch:
            self.waiting -= 1
            self.running += 1
            try:
                async with self.prefill:  # the cache is looked up when the call's prefill is scheduled
                    hashes, hits = self.lookup(text)
                    uncached = tokens - hits * BLOCK_TOKENS
                    await asyncio.sleep(uncached * PREFILL_SECONDS_PER_TOKEN * self.slow)
                    self.store(hashes)
                self.prefill_tokens += uncached
                self.cached_tokens += hits * BLOCK_TOKENS
                self.calls += 1
                await asyncio.sleep(OUTPUT_TOKENS * DECODE_SECONDS_PER_TOKEN * self.slow)
            finally:
                self.running -= 1
        answer = _text(OUTPUT_TOKENS, f"answer {len(text)}")
        return web.json_response({"output": [{"type": "message", "role": "assistant", "content": answer}]})

    async def metrics(self, request: web.Request) -> web.Response:
        usage = len(self.cache) / CACHE_BLOCKS
        text = (
            f"vllm:num_requests_waiting {self.waiting}\n"
            f"vllm:num_requests_running {self.running}\n"
            f"vllm:kv_cache_usage_perc {usage}\n"
        )
        return web.Response(text=text)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "sim", "object": "model"}]})

    async def stats(self, request: web.Request) -> web.Response:
        counts = {"prefill": self.prefill_tokens, "cached": self.cached_tokens, "calls": self.calls}
        return web.json_response(counts)

    async def cold(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/responses", self.respond)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)  # what a router checks before it routes
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/stats", self.stats)
        app.router.add_post("/reset", self.cold)
        return app


async def serve(count: int, slow_index: int | None) -> None:
    runners, ports = [], []
    for index in range(count):
        runner = web.AppRunner(Engine(4.0 if index == slow_index else 1.0).app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, LOOPBACK, 0)
        await site.start()
        runners.append(runner)
        ports.append(int(runner.addresses[0][1]))
    print(json.dumps({"ports": ports}), flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the bench closes our stdin
    for runner in runners:
        await runner.cleanup()


# --- a worker --------------------------------------------------------------------------------------------------


def turn_body(prompt: int, rollout: int, turns_before: int) -> dict[str, Any]:
    items: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": _text(TASK_TOKENS, f"task {prompt}")},
    ]
    for turn in range(turns_before):
        answer = _text(OUTPUT_TOKENS, f"answer r{prompt}-{rollout} t{turn}")
        items.append({"role": "assistant", "content": answer})
        items.append(
            {"type": "function_call_output", "output": _text(TOOL_TOKENS, f"tool {prompt}-{rollout}-{turn}")}
        )
    return {"model": "sim", "input": items}


class _Engine:
    def __init__(self, url: str) -> None:
        from gym_rpc.client.replicas._picker import stable_key

        self.url = url
        self.key = stable_key(url.removeprefix("http://"))
        self.in_flight = 0


async def work(picker: str, ports: list[int], worker: int, workload: Workload, router: str = "") -> dict[str, Any]:
    from gym_rpc.client import ServerClient, close_http_sessions, rollout_context
    from gym_rpc.client.replicas._instance_state import InstanceState
    from gym_rpc.client.replicas._outliers import OutlierDetection
    from gym_rpc.client.replicas._picker import heaviest, slot_of
    from gym_rpc.client.replicas._prompt_key import prompt_key
    from gym_rpc.client.replicas._routing import RoutedCall, ServerRoute
    from gym_rpc.config import BaseServerConfig, GlobalConfig

    urls = [f"http://{LOOPBACK}:{port}" for port in ports]
    engines = [_Engine(url) for url in urls]
    states = [InstanceState(url.removeprefix("http://"), url, "success") for url in urls]
    route = ServerRoute(NAME, states, OutlierDetection(), affine=True)  # what ServerClient's route for them is
    cycle = itertools.cycle(urls)
    entry = {"host": LOOPBACK, "port": ports[0], "replicas": [f"{LOOPBACK}:{port}" for port in ports[1:]]}
    doc = {"head_server": {"host": LOOPBACK, "port": 1}, NAME: {"responses_api_models": {"sim": entry}}}
    client = ServerClient._from_global_config(
        BaseServerConfig(host=LOOPBACK, port=1), GlobalConfig.from_document(doc)
    )
    client.follow_instances(False)
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def turn(prompt: int, rollout: int, number: int) -> None:
            body = turn_body(prompt, rollout, number)
            started = time.monotonic()
            if picker == "default (ServerClient)":
                with rollout_context(f"{prompt}-{rollout}"):
                    async with await client.post(NAME, "/v1/responses", json=body) as response:
                        await response.read()
            elif picker == "default":  # ServerClient's routing code, sent as the other pickers send
                call = RoutedCall(route, f"{prompt}-{rollout}", "/v1/responses", None, prompt_key(body))
                try:
                    async with session.post(call.instance.url + "/v1/responses", json=body) as response:
                        await response.read()
                except BaseException as error:
                    call.failed(error)
                    raise
                call.answered(response)
            else:
                headers = None
                if picker.startswith("vllm-router"):  # the router picks; the rollout's id as its session key
                    url, headers = router, {"X-Session-ID": f"{prompt}-{rollout}"}
                elif picker == "round robin":
                    url = next(cycle)
                elif picker == "rendezvous":
                    url = heaviest(slot_of(f"{prompt}-{rollout}"), engines).url
                else:  # oracle
                    url = urls[prompt % len(urls)]
                async with session.post(url + "/v1/responses", json=body, headers=headers) as response:
                    await response.read()
                    assert response.status == 200, (picker, response.status)
            latencies.append(time.monotonic() - started)

        async def rollout(prompt: int, index: int) -> None:
            for number in range(workload.turns):
                await turn(prompt, index, number)

        async def group(prompt: int) -> None:
            await asyncio.gather(*(rollout(prompt, index) for index in range(workload.group)))

        mine = [prompt for prompt in range(workload.prompts) if prompt % workload.workers == worker]
        limit = asyncio.Semaphore(GROUPS_IN_FLIGHT)

        async def limited(prompt: int) -> None:
            async with limit:
                await group(prompt)

        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # "go": every worker starts together
        started = time.monotonic()
        await asyncio.gather(*(limited(prompt) for prompt in mine))
        ended = time.monotonic()
    await close_http_sessions()
    return {"started": started, "ended": ended, "latencies": latencies}


# --- the bench -------------------------------------------------------------------------------------------------


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "bench.engines", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=env,
    )


async def _get(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as response:
        return await response.json()


def _router_binary() -> str | None:
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def start_router(policy: str, ports: list[int]) -> tuple[subprocess.Popen[bytes], str]:
    """A real `vllm-router` (the dev extra's wheel) in front of the engines, with `policy`, ready."""
    binary = _router_binary()
    assert binary is not None
    port = _free_port()
    command = [
        binary, "--host", LOOPBACK, "--port", str(port),
        "--prometheus-host", LOOPBACK, "--prometheus-port", str(_free_port()),
        "--policy", policy, "--log-level", "warning",
        "--worker-urls", *(f"http://{LOOPBACK}:{engine}" for engine in ports),
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://{LOOPBACK}:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, f"vllm-router exited {process.returncode}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return process, url
        except OSError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError("vllm-router did not become ready within 60 s")


def run_picker(picker: str, ports: list[int], workload: Workload) -> dict[str, Any]:
    router: subprocess.Popen[bytes] | None = None
    router_url = ""
    if picker.startswith("vllm-router"):
        router, router_url = start_router(picker.split()[-1], ports)
    try:
        return _run_picker(picker, ports, workload, router_url)
    finally:
        if router is not None:
            os.killpg(router.pid, signal.SIGKILL)
            router.wait(30)


def _run_picker(picker: str, ports: list[int], workload: Workload, router_url: str) -> dict[str, Any]:
    async def cold() -> None:
        async with aiohttp.ClientSession() as session:
            for port in ports:
                async with session.post(f"http://{LOOPBACK}:{port}/reset") as response:
                    await response.read()

    asyncio.run(cold())
    spec = json.dumps({"prompts": workload.prompts, "group": workload.group, "turns": workload.turns})
    workers = [
        _spawn("work", picker, ",".join(map(str, ports)), str(index), spec, router_url)
        for index in range(workload.workers)
    ]
    try:
        for worker in workers:
            assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write("go\n")
            worker.stdin.flush()
        results = []
        for worker in workers:
            out, _ = worker.communicate(timeout=600)
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()

    async def stats() -> list[dict[str, int]]:
        async with aiohttp.ClientSession() as session:
            return [await _get(session, f"http://{LOOPBACK}:{port}/stats") for port in ports]

    per_engine = asyncio.run(stats())
    latencies = [value for result in results for value in result["latencies"]]
    prefill = sum(engine["prefill"] for engine in per_engine)
    cached = sum(engine["cached"] for engine in per_engine)
    return {
        "picker": picker,
        "makespan": max(result["ended"] for result in results) - min(result["started"] for result in results),
        "prefill": prefill,
        "hit_rate": cached / (cached + prefill),
        "p99": percentile(latencies, 0.99),
        "calls": [engine["calls"] for engine in per_engine],
    }


PICKERS = ("round robin", "rendezvous", "default", "default (ServerClient)", "oracle")
ROUTER_PICKERS = ("vllm-router consistent_hash", "vllm-router cache_aware")


def scenario(
    engines: int, slow_index: int | None, workload: Workload, pickers: tuple[str, ...]
) -> list[dict[str, Any]]:
    server = _spawn("serve", str(engines), str(-1 if slow_index is None else slow_index))
    try:
        assert server.stdout is not None
        ports = json.loads(server.stdout.readline())["ports"]
        return [run_picker(picker, ports, workload) for picker in pickers]
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(10)


def table(title: str, rows: list[dict[str, Any]], baseline: str) -> str:
    oracle = next((row for row in rows if row["picker"] == "oracle"), None)
    base = next(row for row in rows if row["picker"] == baseline)
    lines = [
        f"**{title}**",
        "",
        "| picker | makespan (s) | prefill tokens | vs oracle | hit rate | p99 turn (ms) | p99 vs "
        f"{baseline} | calls per engine |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        versus = f"{row['prefill'] / oracle['prefill']:.2f}x" if oracle else "—"
        lines.append(
            f"| {row['picker']} | {row['makespan']:.2f} | {row['prefill']:,} | {versus} | {row['hit_rate']:.0%} | "
            f"{row['p99'] * 1000:.0f} | {row['p99'] / base['p99']:.2f}x | {' / '.join(map(str, row['calls']))} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    serve_args = sub.add_parser("serve")
    serve_args.add_argument("engines", type=int)
    serve_args.add_argument("slow", type=int)
    work_args = sub.add_parser("work")
    work_args.add_argument("picker")
    work_args.add_argument("ports")
    work_args.add_argument("worker", type=int)
    work_args.add_argument("spec")
    work_args.add_argument("router", nargs="?", default="")
    run_args = sub.add_parser("run")
    run_args.add_argument("--prompts", type=int, default=16)
    run_args.add_argument("--group", type=int, default=8)
    run_args.add_argument("--turns", type=int, default=3)
    run_args.add_argument(
        "--out", help="also write the tables there (make bench puts bench/ENGINES.md in RESULTS.md)"
    )
    args = parser.parse_args()
    if args.command == "serve":
        asyncio.run(serve(args.engines, None if args.slow < 0 else args.slow))
    elif args.command == "work":
        spec = json.loads(args.spec)
        workload = Workload(spec["prompts"], spec["group"], spec["turns"])
        ports = [int(port) for port in args.ports.split(",")]
        print(json.dumps(asyncio.run(work(args.picker, ports, args.worker, workload, args.router))))
    else:
        workload = Workload(args.prompts, args.group, args.turns)
        routers = ROUTER_PICKERS if _router_binary() else ()  # the wheel is published for Linux x86_64 only
        even = scenario(4, None, workload, (*PICKERS, *routers))
        slow = scenario(8, 0, workload, ("rendezvous", "default", "default (ServerClient)", "oracle"))
        shape = f"{workload.prompts} prompts x {workload.group} rollouts x {workload.turns} turns, 2 workers"
        report = "\n\n".join(
            [
                f"Written by `python -m bench.engines run` on "
                f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (the model and its constants: the module's "
                "docstring). Prefill tokens and hit rates follow from where calls land; times are simulated "
                f"sleeps (x{TIME_SCALE:g} of the calibrated figures) on a machine shared with other work.",
                table(f"4 engines, {shape}", even, "rendezvous"),
                table(f"8 engines, one 4x slower (prefill and decode), {shape}", slow, "rendezvous"),
            ]
        )
        print(report)
        if args.out:
            Path(args.out).write_text(report + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
