"""Simulated continuous-batching engines behind one model server name, and a GRPO multi-turn workload over them:
how much prefill each way of picking an engine wastes, and what that costs in time (`python -m bench.engines`;
results in bench/ENGINES.md, which bench/RESULTS.md takes in). The constants and their sources: bench/ENGINES.md.

**The engine** (`serve`: E engines in one process, each an aiohttp server on a loopback port) models what routing
can change, step by step as vLLM's scheduler runs:

* a prefix KV cache: the prompt (every input item's text, concatenated) cut into blocks of BLOCK_TOKENS tokens
  (CHARS_PER_TOKEN characters each), each block named by a hash chained over the blocks before it (vLLM's automatic
  prefix caching); only full blocks are cached, LRU, at most CACHE_BLOCKS per engine. A call's blocks count as
  cached from the step its prefill is scheduled in (a later call sharing them prefills only the rest);
* steps: each step admits waiting calls (up to MAX_BATCH running), decodes one token of every running call whose
  prefill is done, and prefills up to STEP_TOKENS (less the decode tokens) of the others' uncached tokens, first
  come first served (chunked prefill). A step takes STEP_SECONDS + PREFILL_SECONDS_PER_TOKEN per prefilled token +
  DECODE_SECONDS_PER_CALL per decoding call: prefill work slows every call the engine runs, as on a GPU;
* a call answers when its OUTPUT_TOKENS tokens are decoded;
* `GET /metrics` in vLLM's names (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
  `vllm:kv_cache_usage_perc`), `GET /stats` (its prefill and cached tokens, calls), `POST /reset` (cold cache).

Every duration is multiplied by TIME_SCALE; an engine `slow` times slower multiplies its steps by that.

**The workload**: P prompts x G rollouts x T turns. Every prompt is a system prompt the run shares (SYSTEM_TOKENS),
the prompt's task text (TASK_TOKENS), then per turn the model's answer (OUTPUT_TOKENS) and a tool result of the
rollout's own (TOOL_TOKENS): an agentic task, long context and short tool-calling turns. Two worker processes each
take every other prompt and dispatch group by group (E / 2 groups in flight each: one group per engine over both),
all G rollouts of a group at once, each rollout's turns one after the other. `--seed` changes every text and id.

**Pickers**, each over the same engines from cold caches:
* round robin: each worker cycles over the engines (raw aiohttp);
* rendezvous: the rollout's engine by gym_rpc's rendezvous on its id (today's rule for resources servers, and
  what model servers had before prefix-affine picking);
* default: gym_rpc's prefix-affine picking (`ServerRoute`/`RoutedCall` as ServerClient makes them for a model
  server of these instances, reading the engines' load a real `gym-rpc head` reads from their `/metrics` and
  pushes to the worker), each call sent with raw aiohttp as the others are, so the row differs from the others by
  where calls land only;
* default (ServerClient): the same through `ServerClient.post` itself (the entry has `session_affinity_header`;
  the client follows the head), the rollout bound (`rollout_context`);
* oracle: every rollout of prompt p on engine p mod E;
* vllm-router consistent_hash and cache_aware: the real router (the dev extra's wheel) in front of the engines,
  started afresh for each, every call sent to it with the rollout's id in `X-Session-ID`.

Figures: makespan, prefill tokens (and against the oracle's), cache hit rate (cached / prompt tokens), p99 turn
latency, calls per engine. A second scenario puts one of 8 engines at 4x the cost (prefill and decode). A third
table times the pick itself among 64 instances with their state populated, without I/O.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from bench.stats import percentile

LOOPBACK = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parent.parent
NAME = "policy_model"

# --- the engine's constants: Llama-3.1-8B, BF16, one H100 80GB, vLLM (sources: bench/ENGINES.md) ---------------
TIME_SCALE = 1.0
BLOCK_TOKENS = 16  # vLLM's default block size
CHARS_PER_TOKEN = 4
STEP_SECONDS = 0.0046  # a decode step of one call: NIM's Llama-3.1-8B ITL at concurrency 1 (4.63 ms)
DECODE_SECONDS_PER_CALL = 0.00003  # each more call in the step: ITL 7.57 ms at concurrency 100 -> +0.03 ms a call
PREFILL_SECONDS_PER_TOKEN = 1 / 25000  # prefill at about 25,000 tokens/s (43 % of the H100's BF16 peak)
STEP_TOKENS = 8192  # tokens per step (chunked prefill's budget)
MAX_BATCH = 256  # calls running at once
CACHE_BLOCKS = 27000  # ~432k tokens: 57 GB of KV cache at 128 KiB a token

# --- the workload's --------------------------------------------------------------------------------------------
SYSTEM_TOKENS = 1000
TASK_TOKENS = 3000
TOOL_TOKENS = 200
OUTPUT_TOKENS = 64


@dataclass(frozen=True)
class Workload:
    prompts: int = 16
    group: int = 8
    turns: int = 3
    workers: int = 2
    seed: int = 0
    groups_in_flight: int = 2  # per worker
    blocks: bool = False  # each worker takes a contiguous block of prompts (a check), not every other one


def _text(tokens: int, seed: str) -> str:
    """`tokens` tokens of text that differ from any other seed's from their first block on."""
    unit = f"{seed}|"
    return (unit * (tokens * CHARS_PER_TOKEN // len(unit) + 1))[: tokens * CHARS_PER_TOKEN]


# --- the engine ------------------------------------------------------------------------------------------------


class _Call:
    """One call in an engine: its prompt, the uncached tokens it still has to prefill, the tokens it still has to
    decode, and the future its answer waits on."""

    __slots__ = ("done", "left", "pending", "text")

    def __init__(self, text: str, done: asyncio.Future[None]) -> None:
        self.text = text
        self.pending = 0
        self.left = OUTPUT_TOKENS
        self.done = done


class Engine:
    """One simulated engine: its cache, its waiting and running calls, the loop that runs its steps, its
    counters."""

    def __init__(self, slow: float) -> None:
        self.slow = slow
        self.port = 0  # set once it listens: each answer names its engine (the timeline's)
        self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.waiting: collections.deque[_Call] = collections.deque()
        self.running: list[_Call] = []
        self.wake = asyncio.Event()
        self.steps: asyncio.Task[None] | None = None
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

    def admit(self) -> None:
        """Waiting calls join the batch: each looks its prompt up in the cache, and keeps the rest to prefill."""
        while self.waiting and len(self.running) < MAX_BATCH:
            call = self.waiting.popleft()
            hashes, hits = self.lookup(call.text)
            self.store(hashes)
            call.pending = len(call.text) // CHARS_PER_TOKEN - hits * BLOCK_TOKENS
            self.prefill_tokens += call.pending
            self.cached_tokens += hits * BLOCK_TOKENS
            self.calls += 1
            self.running.append(call)

    async def run(self) -> None:
        """The engine's steps, forever. A run of steps with no prefill in them is slept at once, until the first
        call it decodes ends or a new call comes (then to the end of the step under way)."""
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting and not self.running:
                self.wake.clear()
                await self.wake.wait()
            self.admit()
            decoding = [call for call in self.running if not call.pending]
            budget, prefill = STEP_TOKENS - len(decoding), 0
            for call in self.running:
                if call.pending and budget > 0:
                    take = min(call.pending, budget)
                    call.pending -= take
                    budget -= take
                    prefill += take
            step = STEP_SECONDS + prefill * PREFILL_SECONDS_PER_TOKEN + len(decoding) * DECODE_SECONDS_PER_CALL
            step *= self.slow * TIME_SCALE
            steps = 1 if prefill or not decoding else min(call.left for call in decoding)
            self.wake.clear()
            started = loop.time()
            if steps == 1:
                await asyncio.sleep(step)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), step * steps)
                elapsed = loop.time() - started
                done = min(steps, max(1, math.ceil(elapsed / step - 1e-9)))
                if done * step > elapsed:
                    await asyncio.sleep(done * step - elapsed)
                steps = done
            running, decoded = [], {id(call) for call in decoding}
            for call in self.running:
                if id(call) in decoded:
                    call.left -= steps
                    if call.left <= 0:
                        if not call.done.done():
                            call.done.set_result(None)
                        continue
                running.append(call)
            self.running = running

    async def respond(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = "".join(str(item.get("content") or item.get("output") or "") for item in body["input"])
        if self.steps is None:
            self.steps = asyncio.create_task(self.run())
        call = _Call(text, asyncio.get_running_loop().create_future())
        self.waiting.append(call)
        self.wake.set()
        await call.done
        answer = _text(OUTPUT_TOKENS, f"answer {len(text)}")
        output = [{"type": "message", "role": "assistant", "content": answer}]
        return web.json_response({"output": output, "engine": self.port})

    async def metrics(self, request: web.Request) -> web.Response:
        usage = len(self.cache) / CACHE_BLOCKS
        text = (
            f"vllm:num_requests_waiting {len(self.waiting)}\n"
            f"vllm:num_requests_running {len(self.running)}\n"
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
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/responses", self.respond)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)  # what a router checks before it routes
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/stats", self.stats)
        app.router.add_post("/reset", self.cold)
        return app


async def serve(count: int, slow_index: int | None) -> None:
    runners, ports, engines = [], [], []
    for index in range(count):
        engine = Engine(4.0 if index == slow_index else 1.0)
        runner = web.AppRunner(engine.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, LOOPBACK, 0)
        await site.start()
        runners.append(runner)
        engines.append(engine)
        engine.port = int(runner.addresses[0][1])
        ports.append(engine.port)
    print(json.dumps({"ports": ports}), flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the bench closes our stdin
    for engine in engines:
        if engine.steps is not None:
            engine.steps.cancel()
    for runner in runners:
        await runner.cleanup()


# --- a worker --------------------------------------------------------------------------------------------------


def task_of(prompt: int, seed: int) -> int:
    """The task number of the run's `prompt`-th prompt: NeMo Gym's rollout ids are `<task>-<rollout>`."""
    return seed * 100000 + prompt


def turn_body(prompt: int, rollout: int, turns_before: int, seed: int = 0) -> dict[str, Any]:
    task = task_of(prompt, seed)
    items: list[dict[str, Any]] = [
        {"role": "system", "content": _text(SYSTEM_TOKENS, f"system prompt every rollout shares {seed}")},
        {"role": "user", "content": _text(TASK_TOKENS, f"task {task}")},
    ]
    for turn in range(turns_before):
        answer = _text(OUTPUT_TOKENS, f"answer r{task}-{rollout} t{turn}")
        items.append({"role": "assistant", "content": answer})
        items.append(
            {"type": "function_call_output", "output": _text(TOOL_TOKENS, f"tool {task}-{rollout}-{turn}")}
        )
    return {"model": "sim", "input": items}


class _Engine:
    def __init__(self, url: str) -> None:
        from gym_rpc.client.replicas._picker import stable_key

        self.url = url
        self.key = stable_key(url.removeprefix("http://"))
        self.in_flight = 0


def engines_doc(ports: list[int], head_port: int) -> dict[str, Any]:
    """The config of the engines as one model server (an engine entry: `session_affinity_header`, so the head
    reads their `/metrics`), with the head at `head_port`."""
    entry = {
        "host": LOOPBACK,
        "port": ports[0],
        "replicas": [f"{LOOPBACK}:{port}" for port in ports[1:]],
        "session_affinity_header": True,
    }
    return {"head_server": {"host": LOOPBACK, "port": head_port}, NAME: {"responses_api_models": {"sim": entry}}}


async def work(
    picker: str, ports: list[int], worker: int, workload: Workload, router: str = "", head_port: int = 0
) -> dict[str, Any]:
    from gym_rpc.client import ServerClient, close_http_sessions, rollout_context
    from gym_rpc.client.replicas._call_in_flight import RoutedCall
    from gym_rpc.client.replicas._instance_state import InstanceState
    from gym_rpc.client.replicas._outliers import OutlierDetection
    from gym_rpc.client.replicas._picker import heaviest, slot_of
    from gym_rpc.client.replicas._prompt_key import prompt_key
    from gym_rpc.client.replicas._server_route import ServerRoute
    from gym_rpc.config import BaseServerConfig, GlobalConfig

    urls = [f"http://{LOOPBACK}:{port}" for port in ports]
    engines = [_Engine(url) for url in urls]
    cycle = itertools.cycle(urls)
    client = ServerClient._from_global_config(
        BaseServerConfig(host=LOOPBACK, port=head_port or 1), GlobalConfig.from_document(engines_doc(ports, 1))
    )
    client.follow_instances(bool(head_port))
    loads = client._endpoints.routing_started().engine_loads  # the engines' load, pushed by the head
    states = [InstanceState(url.removeprefix("http://"), url, "success") for url in urls]
    route = ServerRoute(NAME, states, OutlierDetection(), affine=True, engine_loads=loads if head_port else None)
    if head_port:  # every engine's load known before the run starts
        deadline = time.monotonic() + 60
        while len(client.engine_loads(NAME)) < len(ports):
            assert time.monotonic() < deadline, "the head pushed no load for every engine within 60 s"
            await asyncio.sleep(0.05)
    latencies: list[float] = []
    calls: list[tuple[int, int, int, int, float, float]] = []  # prompt, rollout, turn, engine port, sent, answered
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    seed = workload.seed

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def turn(prompt: int, rollout: int, number: int) -> None:
            body = turn_body(prompt, rollout, number, seed)
            rollout_id = f"{task_of(prompt, seed)}-{rollout}"
            started = time.monotonic()
            if picker == "default (ServerClient)":
                with rollout_context(rollout_id):
                    async with await client.post(NAME, "/v1/responses", json=body) as response:
                        answer = await response.json()
                        assert response.status == 200, (picker, response.status)
            elif picker == "default":  # ServerClient's routing code, sent as the other pickers send
                call = RoutedCall(route, rollout_id, "/v1/responses", None, prompt_key(body))
                try:
                    async with session.post(call.instance.url + "/v1/responses", json=body) as response:
                        answer = await response.json()
                except BaseException as error:
                    call.failed(error)
                    raise
                call.answered(response)
            else:
                headers = None
                if picker.startswith("vllm-router"):  # the router picks; the rollout's id as its session key
                    url, headers = router, {"X-Session-ID": rollout_id}
                elif picker == "round robin":
                    url = next(cycle)
                elif picker == "rendezvous":
                    url = heaviest(slot_of(rollout_id), engines).url
                else:  # oracle
                    url = urls[prompt % len(urls)]
                async with session.post(url + "/v1/responses", json=body, headers=headers) as response:
                    answer = await response.json()
                    assert response.status == 200, (picker, response.status)
            ended = time.monotonic()
            latencies.append(ended - started)
            calls.append((prompt, rollout, number, answer["engine"], started, ended))

        async def rollout(prompt: int, index: int) -> None:
            for number in range(workload.turns):
                await turn(prompt, index, number)

        async def group(prompt: int) -> None:
            await asyncio.gather(*(rollout(prompt, index) for index in range(workload.group)))

        mine = [prompt for prompt in range(workload.prompts) if prompt % workload.workers == worker]
        if workload.blocks:
            mine = [p for p in range(workload.prompts) if p * workload.workers // workload.prompts == worker]
        limit = asyncio.Semaphore(workload.groups_in_flight)

        async def limited(prompt: int) -> None:
            async with limit:
                await group(prompt)

        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # "go": every worker starts together
        started = time.monotonic()
        await asyncio.gather(*(limited(prompt) for prompt in mine))
        ended = time.monotonic()
    await close_http_sessions()
    return {"started": started, "ended": ended, "latencies": latencies, "calls": calls}


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


def _ready(process: subprocess.Popen[Any], url: str, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, f"{what} exited {process.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    raise RuntimeError(f"{what} did not become ready within 60 s")


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
    _ready(process, url + "/health", "vllm-router")
    return process, url


def start_head(ports: list[int], folder: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A real `gym-rpc head` serving the engines' config: it reads their `/metrics` and pushes the load to the
    workers that follow it."""
    port, http_port = _free_port(), _free_port()
    config = folder / "engines.yaml"
    config.write_text(yaml.safe_dump(engines_doc(ports, port)), encoding="utf-8")
    beside = Path(sys.executable).parent / "gym-rpc"
    command = [
        str(beside) if beside.exists() else "gym-rpc", "head", "--config", str(config), "--host", LOOPBACK,
        "--port", str(port), "--http-port", str(http_port), "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env
    )
    _ready(process, f"http://{LOOPBACK}:{http_port}/livez", "gym-rpc head")
    return process, port


def run_picker(picker: str, ports: list[int], workload: Workload, head_port: int) -> dict[str, Any]:
    router: subprocess.Popen[bytes] | None = None
    router_url = ""
    if picker.startswith("vllm-router"):
        router, router_url = start_router(picker.split()[-1], ports)
    try:
        return _run_picker(picker, ports, workload, router_url, head_port if picker.startswith("default") else 0)
    finally:
        if router is not None:
            os.killpg(router.pid, signal.SIGKILL)
            router.wait(30)


def _run_picker(
    picker: str, ports: list[int], workload: Workload, router_url: str, head_port: int
) -> dict[str, Any]:
    async def cold() -> None:
        async with aiohttp.ClientSession() as session:
            for port in ports:
                async with session.post(f"http://{LOOPBACK}:{port}/reset") as response:
                    await response.read()

    asyncio.run(cold())
    spec = json.dumps(workload.__dict__)
    workers = [
        _spawn("work", picker, ",".join(map(str, ports)), str(index), spec, router_url or "-", str(head_port))
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
                worker.wait(30)

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
        "started": min(result["started"] for result in results),
        "timeline": [
            [worker, *call] for worker, result in enumerate(results) for call in result["calls"]
        ],  # worker, prompt, rollout, turn, engine port, sent, answered
        "ports": ports,
    }


def _covered(spans: list[tuple[float, float]]) -> float:
    """Seconds the union of the spans covers."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def timeline_summary(row: dict[str, Any]) -> dict[str, Any]:
    """Where one run's time went, from each call's engine, send and answer times (`row["timeline"]`): per engine,
    the share of the makespan it had no call (idle) and had calls of 2+ groups at once (shared), the time from its
    last answer to the run's end (its tail); per group, the time from its first call sent to its last answered."""
    t0, makespan = row["started"], row["makespan"]
    end = t0 + makespan
    by_engine: dict[int, list[tuple[int, float, float]]] = collections.defaultdict(list)
    groups: dict[int, list[float]] = {}
    for _worker, prompt, _rollout, _turn, engine, sent, answered in row["timeline"]:
        by_engine[engine].append((prompt, sent, answered))
        span = groups.setdefault(prompt, [sent, answered])
        span[0], span[1] = min(span[0], sent), max(span[1], answered)
    idle, shared, tails, groups_on = [], [], [], []
    for port in row["ports"]:
        calls = by_engine.get(port, [])
        idle.append(1 - _covered([(sent, answered) for _, sent, answered in calls]) / makespan)
        tails.append(end - max((answered for _, _, answered in calls), default=t0))
        # a group is at an engine from its first call sent there to its last answered there
        spans: dict[int, list[float]] = {}
        for prompt, sent, answered in calls:
            span = spans.setdefault(prompt, [sent, answered])
            span[0], span[1] = min(span[0], sent), max(span[1], answered)
        groups_on.append(len(spans))
        edges = sorted([(start, 1) for start, _ in spans.values()] + [(stop, -1) for _, stop in spans.values()])
        depth, last, two = 0, t0, 0.0
        for at, step in edges:
            if depth >= 2:
                two += at - last
            depth, last = depth + step, at
        shared.append(two / makespan)
    durations = [stop - start for start, stop in groups.values()]
    return {
        "idle": idle,
        "shared": shared,
        "tails": tails,
        "groups_on": groups_on,
        "group_median": statistics.median(durations),
        "group_max": max(durations),
        "group_sum": sum(durations),
    }


def timeline_lines(runs: list[list[dict[str, Any]]]) -> list[str]:
    """One line per picker and run: the engines' idle and shared shares, tails, groups, and the groups' times."""
    lines = []
    for seed, run in enumerate(runs):
        for row in run:
            summary = timeline_summary(row)
            idle = " ".join(f"{value:.0%}" for value in summary["idle"])
            shared = " ".join(f"{value:.0%}" for value in summary["shared"])
            tails = " ".join(f"{value:.2f}" for value in summary["tails"])
            lines.append(
                f"seed {seed} {row['picker']:<28} makespan {row['makespan']:.2f} s | idle {idle} | 2+ groups "
                f"{shared} | tail {tails} s | groups {summary['groups_on']} | group median "
                f"{summary['group_median']:.2f} max {summary['group_max']:.2f} sum {summary['group_sum']:.1f} s"
            )
    return lines


PICKERS = ("round robin", "rendezvous", "default", "default (ServerClient)", "oracle")
ROUTER_PICKERS = ("vllm-router consistent_hash", "vllm-router cache_aware")
SLOW_PICKERS = ("rendezvous", "default", "default (ServerClient)", "oracle")


def scenario(
    engines: int, slow_index: int | None, workload: Workload, pickers: tuple[str, ...]
) -> list[dict[str, Any]]:
    server = _spawn("serve", str(engines), str(-1 if slow_index is None else slow_index))
    head: subprocess.Popen[bytes] | None = None
    try:
        assert server.stdout is not None
        ports = json.loads(server.stdout.readline())["ports"]
        with tempfile.TemporaryDirectory(prefix="gym-rpc-engines-") as folder:
            head, head_port = start_head(ports, Path(folder))
            return [run_picker(picker, ports, workload, head_port) for picker in pickers]
    finally:
        if head is not None:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(30)
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)


# --- the pick's own cost ---------------------------------------------------------------------------------------


def pick_cost(instances: int = 64, blocks: int = 15, per_block: int = 2000) -> dict[str, float]:
    """µs per call, median over `blocks` interleaved blocks of `per_block` calls, no I/O, among `instances`
    instances with their state populated (every instance's engine load pushed and fresh, every instance's
    latency known, 4,096 groups and 32,768 rollouts placed): the prefix-affine pick alone (`pick_affine`, a
    rollout's later turn or a new rollout of a placed group: the steady state of a run), against a plain dict
    lookup and a rendezvous over the instances (`heaviest`) in the same blocks."""
    from gym_rpc.client.replicas._engine_load_table import EngineLoadTable
    from gym_rpc.client.replicas._instance_state import InstanceState
    from gym_rpc.client.replicas._outliers import OutlierDetection
    from gym_rpc.client.replicas._picker import heaviest, slot_of
    from gym_rpc.client.replicas._server_route import ServerRoute
    from gym_rpc.wire import EngineLoad

    urls = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(instances)]
    states = [InstanceState(url.removeprefix("http://"), url, "success") for url in urls]
    table = EngineLoadTable(max_age_seconds=1e9)
    table.apply([EngineLoad(NAME, state.instance_id, 2.0, 8.0, 0.5, 0.0) for state in states])
    route = ServerRoute(NAME, states, OutlierDetection(), affine=True, engine_loads=table)
    for number, instance in enumerate(route.instances):
        instance.latency, instance.latency_at = 0.5 + number % 3 * 0.01, time.monotonic() + 1e9
    groups, per_group = 4096, 8
    rollouts = [(f"{g}-{r}", g * 2654435761 % 2**32) for g in range(groups) for r in range(per_group)]
    for rollout, prompt in rollouts:
        route.pick_affine(rollout, None, prompt, time.monotonic())  # every group and rollout placed
    plain = {rollout: route.instances[index % instances] for index, (rollout, _) in enumerate(rollouts)}
    picked = itertools.cycle(rollouts)
    keys = [slot_of(rollout) for rollout, _ in rollouts]
    sides: dict[str, list[float]] = {"affine": [], "dict": [], "rendezvous": []}
    for _ in range(blocks):
        batch = [next(picked) for _ in range(per_block)]
        began = time.perf_counter()
        for rollout, prompt in batch:
            route.pick_affine(rollout, None, prompt, time.monotonic())
        sides["affine"].append((time.perf_counter() - began) / per_block * 1e6)
        began = time.perf_counter()
        for rollout, _ in batch:
            plain.get(rollout)
        sides["dict"].append((time.perf_counter() - began) / per_block * 1e6)
        instances_list = route.instances
        began = time.perf_counter()
        for slot in keys[:per_block]:
            heaviest(slot, instances_list)
        sides["rendezvous"].append((time.perf_counter() - began) / per_block * 1e6)
    return {side: statistics.median(values) for side, values in sides.items()}


# --- the report ------------------------------------------------------------------------------------------------

# bench/ENGINES.md: a hand-written head (the constants, their sources, the workload), this line, then the last
# run's tables, which `run --out` rewrites.
MARKER = "<!-- python -m bench.engines run --out bench/ENGINES.md writes what follows -->"


def _range(values: list[float], form: str = "{:.2f}x") -> str:
    middle = statistics.median(values)
    if len(values) == 1:
        return form.format(middle)
    return f"{form.format(middle)} ({form.format(min(values))} to {form.format(max(values))})"


def table(title: str, runs: list[list[dict[str, Any]]], base: str, time_base: str | None) -> str:
    """One row per picker: medians over the seeds' runs; each ratio is taken within one run (against that run's
    oracle, `base`'s p99 and `time_base`'s makespan), then its median and range over the runs."""
    pickers = [row["picker"] for row in runs[0]]
    by = [{row["picker"]: row for row in run} for run in runs]
    head = "| picker | makespan (s) | makespan vs " + (time_base or "—") + " | prefill tokens | vs oracle | "
    head += f"hit rate | p99 turn (ms) | p99 vs {base} | calls per engine (seed 0) |"
    lines = [f"**{title}**", "", head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for picker in pickers:
        rows = [run[picker] for run in by]
        versus_time = _range([r[picker]["makespan"] / r[time_base]["makespan"] for r in by]) if time_base else "—"
        versus = _range([r[picker]["prefill"] / r["oracle"]["prefill"] for r in by])
        p99 = _range([r[picker]["p99"] / r[base]["p99"] for r in by])
        lines.append(
            f"| {picker} | {statistics.median(row['makespan'] for row in rows):.2f} | {versus_time} | "
            f"{statistics.median(row['prefill'] for row in rows):,.0f} | {versus} | "
            f"{statistics.median(row['hit_rate'] for row in rows):.0%} | "
            f"{statistics.median(row['p99'] for row in rows) * 1000:.0f} | {p99} | "
            f"{' / '.join(map(str, rows[0]['calls']))} |"
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
    work_args.add_argument("router")
    work_args.add_argument("head", type=int)
    run_args = sub.add_parser("run")
    run_args.add_argument("--prompts", type=int, default=16, help="prompts of the 4-engine scenario (16)")
    run_args.add_argument("--slow-prompts", type=int, default=64, help="prompts of the slow-engine one (64)")
    run_args.add_argument("--group", type=int, default=8)
    run_args.add_argument("--turns", type=int, default=3)
    run_args.add_argument("--seeds", type=int, default=3, help="runs of each scenario, each its own texts and ids")
    run_args.add_argument("--only", choices=("even", "slow", "pick"), help="one scenario only")
    run_args.add_argument(
        "--blocks",
        action="store_true",
        help="a check, not the issue's workload: each worker takes a contiguous block of the prompts (tasks "
        "in flight are then not consecutive) instead of every other one",
    )
    run_args.add_argument(
        "--timeline",
        help="also write every call's engine, send and answer times there (JSON), and print where time went",
    )
    run_args.add_argument(
        "--out", help="also write the tables there (make bench puts bench/ENGINES.md in RESULTS.md)"
    )
    args = parser.parse_args()
    if args.command == "serve":
        asyncio.run(serve(args.engines, None if args.slow < 0 else args.slow))
        return
    if args.command == "work":
        workload = Workload(**json.loads(args.spec))
        ports = [int(port) for port in args.ports.split(",")]
        router = "" if args.router == "-" else args.router
        print(json.dumps(asyncio.run(work(args.picker, ports, args.worker, workload, router, args.head))))
        return
    routers = ROUTER_PICKERS if _router_binary() else ()  # the wheel is published for Linux x86_64 only
    parts = [
        f"Written by `python -m bench.engines run --seeds {args.seeds}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. The engine's model and the workload: the module's "
        "docstring; the constants and their sources: the section above. Prefill tokens and hit rates follow from "
        f"where calls land; times are simulated steps (x{TIME_SCALE:g}) on a machine shared with other work, so "
        "each ratio is taken within one run, then its median (and range) over the seeds' runs."
    ]
    timelines: dict[str, list[list[dict[str, Any]]]] = {}
    if args.only in (None, "even"):
        runs = []
        for seed in range(args.seeds):
            workload = Workload(
                args.prompts, args.group, args.turns, seed=seed, groups_in_flight=2, blocks=args.blocks
            )
            runs.append(scenario(4, None, workload, (*PICKERS, *routers)))
        shape = f"{args.prompts} prompts x {args.group} rollouts x {args.turns} turns, 2 workers, 2 groups each"
        if args.blocks:
            shape += ", each worker a contiguous block of the prompts"
        time_base = ROUTER_PICKERS[0] if routers else None
        parts.append(table(f"4 engines, {shape}", runs, "rendezvous", time_base))
        timelines["even"] = runs
    if args.only in (None, "slow"):
        runs = []
        for seed in range(args.seeds):
            workload = Workload(args.slow_prompts, args.group, args.turns, seed=seed, groups_in_flight=4)
            runs.append(scenario(8, 0, workload, SLOW_PICKERS))
        shape = (
            f"{args.slow_prompts} prompts x {args.group} rollouts x {args.turns} turns, 2 workers, 4 groups each"
        )
        parts.append(
            table(f"8 engines, the first 4x slower (prefill and decode), {shape}", runs, "rendezvous", None)
        )
        timelines["slow"] = runs
    if args.only in (None, "pick"):
        cost = pick_cost()
        parts.append(
            "**The pick itself**, among 64 instances with their state populated (engine loads pushed, latencies "
            "known, 4,096 groups and 32,768 rollouts placed), no I/O, µs per call, median of 15 interleaved "
            "blocks of 2,000 calls:\n\n"
            "| prefix-affine pick (`pick_affine`) | dict lookup | rendezvous over 64 (`heaviest`) | goal |\n"
            "| --- | --- | --- | --- |\n"
            f"| {cost['affine']:.2f} | {cost['dict']:.2f} | {cost['rendezvous']:.2f} | < 5 µs: "
            f"{'met' if cost['affine'] < 5 else 'missed'} |"
        )
    report = "\n\n".join(parts)
    print(report)
    if args.timeline:
        Path(args.timeline).write_text(json.dumps(timelines), encoding="utf-8")
        for name, runs in timelines.items():
            print(f"\nWhere time went ({name}):", *timeline_lines(runs), sep="\n")
    if args.out:  # the file's hand-written head (the constants' sources) is kept, up to the marker
        out = Path(args.out)
        old = out.read_text(encoding="utf-8") if out.exists() else ""
        head = old[: old.index(MARKER) + len(MARKER)] if MARKER in old else MARKER
        out.write_text(f"{head}\n\n{report}\n", encoding="utf-8")


if __name__ == "__main__":
    main()
