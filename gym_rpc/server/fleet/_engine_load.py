"""The engines' load, read by the head from each engine instance's Prometheus `/metrics`.

An entry with `session_affinity_header` is an OpenAI-compatible engine (or a router): beside its probes, the head
reads every instance's `/metrics` every READ_INTERVAL_SECONDS, each read bounded by READ_TIMEOUT_SECONDS and
MAX_METRICS_BYTES, and keeps three figures per instance, by vLLM's names or SGLang's:

| figure           | vLLM                          | SGLang                    |
| ---------------- | ----------------------------- | ------------------------- |
| `waiting`        | `vllm:num_requests_waiting`   | `sglang:num_queue_reqs`   |
| `running`        | `vllm:num_requests_running`   | `sglang:num_running_reqs` |
| `kv_cache_usage` | `vllm:kv_cache_usage_perc`    | `sglang:token_usage`      |

Several series of one name (an engine serving data-parallel ranks) add up for the counts and average for the
cache use. A figure an engine does not report, a read that fails, and a figure older than MAX_AGE_SECONDS are
unknown (None), never zero. A config without engine entries reads nothing and costs nothing.

Watches that ask for it (`include_engine_load`) get the table as ENGINE_LOAD messages, coalesced: at most one per
PUSH_INTERVAL_SECONDS per watcher, each carrying the latest figures (`LoadPush`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import aiohttp

from gym_rpc._tasks import stop_poller
from gym_rpc.config import ServerEntry
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import ENGINE_LOAD_MAX_AGE_SECONDS, EngineLoad, StatusReport, convert

logger = logging.getLogger("gym_rpc.server.engine_load")

READ_INTERVAL_SECONDS = 0.5
READ_TIMEOUT_SECONDS = 1.0
MAX_METRICS_BYTES = 4 * 1024 * 1024  # a vLLM /metrics is tens of kB; a body past this is not read on
MAX_AGE_SECONDS = ENGINE_LOAD_MAX_AGE_SECONDS
PUSH_INTERVAL_SECONDS = 0.25  # per watcher: at most four ENGINE_LOAD messages a second
METRICS_PATH = "/metrics"

# metric name -> the figure it gives
ENGINE_METRICS: Mapping[str, str] = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",  # vLLM before 0.10 named it so
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_running_reqs": "running",
    "sglang:token_usage": "kv_cache_usage",
}
_AVERAGED = frozenset({"kv_cache_usage"})


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The figures a Prometheus text exposition gives (figure -> value), from the names in ENGINE_METRICS only;
    a sample that is not a finite number (NaN, +Inf, garbage) is left out, so its figure stays unknown."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace != -1:
            name, rest = line[:brace], line[line.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        figure = ENGINE_METRICS.get(name.strip())
        if figure is None:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        sums[figure] = sums.get(figure, 0.0) + value
        counts[figure] = counts.get(figure, 0) + 1
    return {figure: total / counts[figure] if figure in _AVERAGED else total for figure, total in sums.items()}


@dataclass(frozen=True)
class EngineTarget:
    """One engine instance to read: its server, its instance id and base URL."""

    server_name: str
    instance_id: str
    url: str


@dataclass
class _Reading:
    figures: dict[str, float]
    read_at: float | None  # monotonic; None: never read


class EngineLoads:
    """Every engine instance's latest figures. `version` rises with every read round that read anything, so a
    watcher knows there is news; `loads()` gives the table as of now (ages computed, stale figures unknown)."""

    def __init__(
        self,
        targets: Callable[[], Iterable[EngineTarget]],
        *,
        interval_seconds: float = READ_INTERVAL_SECONDS,
        timeout_seconds: float = READ_TIMEOUT_SECONDS,
        max_age_seconds: float = MAX_AGE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._targets = targets  # read every round: instances come and go (registrations, reloads)
        self._interval = interval_seconds
        self._timeout = timeout_seconds
        self._max_age = max_age_seconds
        self._clock = clock
        self._readings: dict[tuple[str, str], _Reading] = {}
        self._order: list[tuple[str, str]] = []
        self.version = 0  # 0: nothing read yet
        self.reads = 0  # reads made (tests)
        self._message: tuple[tuple[int, int, str], pb.WatchServerStatusesResponse] | None = None
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._failing: set[tuple[str, str]] = set()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="gym-rpc engine load")

    async def stop(self) -> None:
        await stop_poller(self._task, self._session)
        self._task = None
        self._session = None

    def loads(self) -> list[EngineLoad]:
        """Every engine instance's load now, in the config's order; a figure older than the bound is unknown."""
        now = self._clock()
        table = []
        for key in self._order:
            reading = self._readings.get(key)
            if reading is None:
                continue
            age = None if reading.read_at is None else max(0.0, now - reading.read_at)
            fresh = age is not None and age <= self._max_age
            figures = reading.figures if fresh else {}
            table.append(
                EngineLoad(
                    server_name=key[0],
                    instance_id=key[1],
                    waiting=figures.get("waiting"),
                    running=figures.get("running"),
                    kv_cache_usage=figures.get("kv_cache_usage"),
                    age_seconds=age,
                )
            )
        return table

    @property
    def engines(self) -> int:
        """Engine instances read in the latest round (0: the config has none, and watches need not look)."""
        return len(self._order)

    def message(self, revision: int, config_version: str) -> pb.WatchServerStatusesResponse:
        """The ENGINE_LOAD message of a watch at `revision`, built once per read round for every watcher there."""
        key = (self.version, revision, config_version)
        if self._message is None or self._message[0] != key:
            self._message = (key, engine_load_message(self.loads(), revision, config_version))
        return self._message[1]

    def take(self, loads: Iterable[EngineLoad]) -> None:
        """Another head's table as this one's latest round (a node's watch relay passes the head's on): each
        figure as read there, its age going on from what the head said."""
        now = self._clock()
        readings: dict[tuple[str, str], _Reading] = {}
        for load in loads:
            figures = {
                name: value
                for name, value in (
                    ("waiting", load.waiting),
                    ("running", load.running),
                    ("kv_cache_usage", load.kv_cache_usage),
                )
                if value is not None
            }
            read_at = None if load.age_seconds is None else now - load.age_seconds
            readings[(load.server_name, load.instance_id)] = _Reading(figures, read_at)
        self._order = list(readings)
        self._readings = readings
        self.version += 1

    async def read_all(self) -> None:
        """One round: every engine instance's /metrics, concurrently, each bounded."""
        targets = list(self._targets())
        keys = [(target.server_name, target.instance_id) for target in targets]
        if not targets and self._order:
            self.version += 1  # the last engine left the config: watchers get the empty table once
        self._order = keys
        self._readings = {key: self._readings.get(key) or _Reading({}, None) for key in keys}
        if not targets:
            return
        if self._session is None:
            self._session = aiohttp.ClientSession(trust_env=False, cookie_jar=aiohttp.DummyCookieJar())
        results = await asyncio.gather(*(self._read(self._session, target) for target in targets))
        if any(result is not None for result in results):
            self.version += 1

    async def _read(self, session: aiohttp.ClientSession, target: EngineTarget) -> dict[str, float] | None:
        key = (target.server_name, target.instance_id)
        self.reads += 1
        try:
            async with session.get(
                target.url.rstrip("/") + METRICS_PATH, timeout=aiohttp.ClientTimeout(total=self._timeout)
            ) as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                body = await response.content.read(MAX_METRICS_BYTES)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a down or slow engine: its figures age into unknown
            if key not in self._failing:
                self._failing.add(key)
                logger.info(
                    "cannot read the load of %s %s at %s%s (%s): its figures count as unknown after %g s",
                    target.server_name,
                    target.instance_id,
                    target.url,
                    METRICS_PATH,
                    f"{type(error).__name__}: {error}".rstrip(": "),
                    self._max_age,
                )
            return None
        self._failing.discard(key)
        figures = parse_engine_metrics(body.decode("utf-8", "replace"))
        self._readings[key] = _Reading(figures, self._clock())
        return figures

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a round never ends the loop; each read logs its own failure
                await self.read_all()
            await asyncio.sleep(self._interval)


class LoadPush:
    """One watcher's ENGINE_LOAD messages: the latest table whenever it is news, at most one per
    PUSH_INTERVAL_SECONDS (coalesced: a watcher gets the latest figures, never a backlog), and its heartbeats
    only when it has been sent nothing for a heartbeat interval."""

    def __init__(self, loads: EngineLoads, clock: Callable[[], float] = time.monotonic) -> None:
        self._loads = loads
        self._clock = clock
        self._sent_version = 0  # version 0: nothing read yet, nothing to send
        self._sent_at = clock()
        self._pushed_at = -math.inf

    def wait_seconds(self, heartbeat: float) -> float:
        """How long the watch waits for a change before it looks at the load again: the push interval while the
        head reads engines, else the heartbeat (a head without engines wakes its watchers no more than before)."""
        return min(heartbeat, PUSH_INTERVAL_SECONDS) if self._loads.engines else heartbeat

    def due(self) -> bool:
        """Whether to send the table now: there is news, and none was sent in the last PUSH_INTERVAL_SECONDS."""
        now = self._clock()
        if self._loads.version == self._sent_version or now - self._pushed_at < PUSH_INTERVAL_SECONDS:
            return False
        self._sent_version = self._loads.version
        self._pushed_at = self._sent_at = now
        return True

    def heartbeat_due(self, heartbeat: float) -> bool:
        now = self._clock()
        if now - self._sent_at < heartbeat:
            return False
        self._sent_at = now
        return True


def engine_load_message(
    loads: list[EngineLoad], revision: int, config_version: str
) -> pb.WatchServerStatusesResponse:
    """The ENGINE_LOAD message of a watch at `revision`: the table, no revision of its own."""
    return pb.WatchServerStatusesResponse(
        type=pb.WATCH_EVENT_TYPE_ENGINE_LOAD,
        revision=revision,
        config_version=config_version,
        engine_loads=[convert.engine_load_to_pb(load) for load in loads],
    )


def engine_targets(
    servers: Mapping[str, ServerEntry], reports: Callable[[str], StatusReport | None]
) -> list[EngineTarget]:
    """The engine instances of `servers` (entries with a session affinity header, but not `engine_metrics: false`):
    each instance the head's report of the server lists (registered ones included), else the config's."""
    targets = []
    for name, entry in servers.items():
        if entry.session_affinity_header is None or not entry.engine_metrics:
            continue
        report = reports(name)
        if report is not None and report.instances:
            pairs = [(instance.instance_id, instance.url) for instance in report.instances]
        else:
            pairs = [(address.instance_id, address.url) for address in entry.instances]
        targets += [EngineTarget(name, instance_id, url) for instance_id, url in pairs]
    return targets
