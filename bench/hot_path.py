"""Do the speed tricks of `ServerClient.request` pay? The shipped client against the same client taking the plain
path: `self._x` attribute reads and `await send(...)` (no first attempt made inline).

Same server, same payload, interleaved rounds (bench/data_plane.py's `compare`); the figure is the median of the
per-round ratios shipped / plain requests per second: above 1 the tricks pay. `make bench` runs it (section
`hotpath`); a trick that stops paying should go.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Unpack

import aiohttp
from pydantic import BaseModel

from bench.data_plane import Post, compare, make_client, ours_post
from bench.stats import Row, median, percentile, ratio_row
from gym_rpc.client._http import close_http_sessions, send
from gym_rpc.client.server_client import ServerClient, _json_payload

if TYPE_CHECKING:
    from aiohttp.client import _RequestOptions


class PlainPathClient(ServerClient):
    """`ServerClient.request` without its speed tricks, everything else alike (tracing and observability off)."""

    async def request(
        self,
        server_name: str,
        url_path: str,
        method: str,
        _control: bool = False,
        _resend_after_disconnect: bool = True,
        **kwargs: Unpack[_RequestOptions],
    ) -> aiohttp.ClientResponse:
        url = self._server_base_urls.get(server_name) or await self._aresolve_base_url(server_name)
        body: Any = kwargs.get("json")
        if body is not None:
            if isinstance(body, BaseModel):
                body = body.model_dump(mode="json", exclude_unset=True)
            del kwargs["json"]
            kwargs["data"] = _json_payload(body)
        sessions = self._http.sessions()
        session = sessions.control if _control else sessions.data
        retry = self._http.settings.retry
        return await send(session, method, url + url_path, retry, _resend_after_disconnect, kwargs)


def make_plain_client(port: int) -> PlainPathClient:
    shipped = make_client(port)
    return PlainPathClient(
        head_server_config=shipped.head_server_config, global_config_dict=shipped.global_config_dict
    )


async def run(port: int, concurrencies: tuple[int, ...], requests: tuple[int, ...], rounds: int) -> list[Row]:
    shipped, plain = make_client(port), make_plain_client(port)
    rows: list[Row] = []
    try:
        for concurrency, count in zip(concurrencies, requests, strict=True):
            comparison = await compare(ours_post(shipped), plain_post(plain), concurrency, count, rounds)
            ratios = comparison.ratios
            middle = f"{percentile(ratios, 0.25):.2f}-{percentile(ratios, 0.75):.2f}"
            spread = f"{len(ratios)} rounds, middle half {middle}"
            rows.append(
                ratio_row(
                    "hot path",
                    f"ServerClient.post with its speed tricks vs without, concurrency {concurrency} ({spread})",
                    f"{median([b.requests_per_second for b in comparison.ours]):.0f} req/s",
                    f"plain path: {median([b.requests_per_second for b in comparison.raw]):.0f} req/s",
                    median(ratios),
                    None,  # informs: a ratio near 1 says a trick no longer pays and should go
                )
            )
    finally:
        await close_http_sessions()
    return rows


def plain_post(client: PlainPathClient) -> Post:
    return ours_post(client)
