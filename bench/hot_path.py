"""Does the speed trick of `ServerClient.request` pay? Its data plane (gym_rpc.client._data_plane.DataPlane) holds
what every call reads (the base URLs, the typed config, the routes, the pools) as plain attributes of one object,
made on the client's first call, so a call reads them as ordinary attributes. The shipped client against the same
client whose data plane reads that state from the client's private attributes at each use, as `self._x` reads it
(each read misses the instance and goes through pydantic's BaseModel.__getattr__), all else alike: both run the
shipped `DataPlane.call` itself (its routing lookup, rollout prefix rule, metrics and tracing checks), so the
comparison cannot drift from what ships (it once did: a copy of the call that skipped the routing lookup and later
the checks).

Two figures. Against the real data server (interleaved rounds, bench/data_plane.py's `compare`): the median of
the per-round ratios shipped / without requests per second, with each side's CPU per request; on two shared cores
a few µs per request drown in the scatter. With no I/O (a session whose `request` returns at once): the client's
own µs per call, the best of interleaved blocks, where the trick's saving shows by itself. Above 1 the trick pays;
near 1 in both, it should go. (Its first attempt made inline, with no coroutine of `send`'s, and `post`'s kwargs
never copied again, save little of this no-I/O time; they are there for what a call keeps alive while it waits,
which bench/allocations.py counts.)
"""

from __future__ import annotations

import functools
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from bench.data_plane import PATH, PAYLOAD, SERVER_NAME, Block, compare, make_client, ours_post
from bench.stats import UNLIMITED, Row, median, pair_budget, percentile, ratio_row
from gym_rpc.client.data import DataPlane
from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.resend._budget import new_call_count
from gym_rpc.client.server_client import ServerClient, _bind_direct_calls

if TYPE_CHECKING:
    from gym_rpc.client.data._http_pools import HttpPools
    from gym_rpc.client.replicas._routing import Routing
    from gym_rpc.config import GlobalConfig

NO_IO_CALLS = 2000  # per block
NO_IO_BLOCKS = 30  # per side, interleaved; the best block is the figure


class PrivateReads(DataPlane):
    """The shipped DataPlane without its trick: the same `call` and once-made decisions (the path rule), but the
    client's state (`base_urls`, `config`, `pools`, `routing`) read from the client's private attributes at each
    use, as `self._x` would read it (pydantic's BaseModel.__getattr__, as each read misses the instance). A
    property per read is all it adds to `self._x`, a few tens of ns. What the shipped `__init__` stores there is
    dropped: the client keeps it already."""

    __slots__ = ("_client",)

    def __init__(self, client: ServerClient) -> None:
        self._client = client
        super().__init__(client._endpoints, client._http)

    @property
    def base_urls(self) -> dict[str, str]:
        return self._client._server_base_urls

    @base_urls.setter
    def base_urls(self, value: dict[str, str]) -> None:
        pass

    @property
    def config(self) -> GlobalConfig:
        return self._client._global_config

    @config.setter
    def config(self, value: GlobalConfig) -> None:
        pass

    @property
    def pools(self) -> HttpPools:
        return self._client._http

    @pools.setter
    def pools(self, value: HttpPools) -> None:
        pass

    @property
    def routing(self) -> Routing | None:
        return self._client._endpoints.routing

    @routing.setter
    def routing(self, routing: Routing | None) -> None:
        """`call` stores what the endpoints made, which they already keep in their `routing`."""


STATE = frozenset(name for name, value in vars(PrivateReads).items() if isinstance(value, property))


class WithoutTrick(ServerClient):
    """The shipped client, whose `DataPlane.call` runs as shipped (routing lookup, prefix rule, switches and all)
    on a `PrivateReads`: the only difference is where the state is read from."""

    @functools.cached_property
    def _data_plane(self) -> DataPlane:
        plane = PrivateReads(self)
        _bind_direct_calls(self, plane)  # as the shipped one does
        return plane


def make_without(port: int) -> WithoutTrick:
    shipped = make_client(port)
    return WithoutTrick(
        head_server_config=shipped.head_server_config, global_config_dict=shipped.global_config_dict
    )


async def run(
    port: int,
    concurrencies: tuple[int, ...],
    requests: tuple[int, ...],
    rounds: tuple[int, ...],
    seconds: tuple[float, ...] | None = None,
) -> list[Row]:
    """The rows at each concurrency (`seconds`: each row's budget, bench.stats.Budget; none: every round), then
    the no-I/O row."""
    rows: list[Row] = []
    shipped, without = make_client(port), make_without(port)
    budgets = [pair_budget(s, 1) for s in seconds] if seconds else [UNLIMITED] * len(rounds)
    try:
        for concurrency, count, round_count, budget in zip(concurrencies, requests, rounds, budgets, strict=True):
            comparison = await compare(
                ours_post(shipped), ours_post(without), concurrency, count, round_count, budget
            )
            ratios = comparison.ratios
            middle = f"{percentile(ratios, 0.25):.2f}-{percentile(ratios, 0.75):.2f}"
            rows.append(
                ratio_row(
                    "hot path",
                    f"ServerClient.post with vs without its speed trick (its data-plane state cached in one plain "
                    f"attribute), "
                    f"concurrency {concurrency} ({len(ratios)} rounds, middle half {middle})",
                    _figures(comparison.ours),
                    f"without: {_figures(comparison.raw)}",
                    median(ratios),
                    None,  # informs: on two shared cores the no-I/O row below is the one that can tell
                )
            )
    finally:
        await close_http_sessions()
    rows.append(await _no_io_row(port))
    return rows


def _figures(blocks: list[Block]) -> str:
    """Requests per second and this process's CPU per request (the client's own cost, less moved by load)."""
    rps = median([b.requests_per_second for b in blocks])
    return f"{rps:.0f} req/s, {median([b.cpu_us_per_request for b in blocks]):.1f} µs CPU/req"


_NO_IO_ANSWER = SimpleNamespace(status=200)  # what the client reads of an answer on its hot path


class _NoIoSession:
    async def request(self, method: str, url: str, **kwargs: Any) -> Any:
        return _NO_IO_ANSWER


def _no_io(client: ServerClient) -> ServerClient:
    """The client with sessions whose `request` returns at once: what remains is the client's own work."""
    session = _NoIoSession()
    sessions = SimpleNamespace(data=session, calls=new_call_count())
    pools = SimpleNamespace(settings=client._http.settings, sessions=lambda: sessions)
    client._http = pools  # type: ignore[assignment]  # before the first call, which gathers it in _data_plane
    return client


async def _us_per_call(client: ServerClient) -> float:
    started = time.perf_counter()
    for _ in range(NO_IO_CALLS):
        await client.request(SERVER_NAME, PATH, "POST", json=PAYLOAD)
    return (time.perf_counter() - started) / NO_IO_CALLS * 1e6


async def _no_io_row(port: int) -> Row:
    shipped, without = _no_io(make_client(port)), _no_io(make_without(port))
    best_shipped = best_without = float("inf")
    for _ in range(NO_IO_BLOCKS):
        best_shipped = min(best_shipped, await _us_per_call(shipped))
        best_without = min(best_without, await _us_per_call(without))
    return ratio_row(
        "hot path",
        f"ServerClient.post's own work (no I/O), with vs without its speed trick (best of {NO_IO_BLOCKS} "
        f"interleaved blocks of {NO_IO_CALLS} calls; ratio: time without / with)",
        f"{best_shipped:.2f} µs/call",
        f"without: {best_without:.2f} µs/call",
        best_without / best_shipped,
        None,
    )
