"""Do the speed tricks of `ServerClient.request` pay? The shipped client against the same client with one trick
taken out: `self._x` attribute reads instead of one read of pydantic's private store, or `await send(...)` instead
of the first attempt made inline.

Same server, same payload, interleaved rounds (bench/data_plane.py's `compare`); the figure is the median of the
per-round ratios shipped / without-the-trick requests per second: above 1 the trick pays. `make bench` runs it
(section `hotpath`); a trick that stops paying should go.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Unpack

import aiohttp
from pydantic import BaseModel

from bench.data_plane import Block, compare, make_client, ours_post
from bench.stats import Row, median, percentile, ratio_row
from gym_rpc.client._http import RESENDABLE_ERRORS, close_http_sessions, send
from gym_rpc.client.server_client import ServerClient, _json_payload

if TYPE_CHECKING:
    from aiohttp.client import _RequestOptions


class WithoutTrick(ServerClient):
    """`ServerClient.request` with one speed trick taken out (`trick`), all else as shipped (observability off)."""

    # "private": read `self._x` attributes; "inline": `await send(...)` makes the first attempt.
    trick: ClassVar[str] = ""

    async def request(
        self,
        server_name: str,
        url_path: str,
        method: str,
        _control: bool = False,
        _resend_after_disconnect: bool = True,
        **kwargs: Unpack[_RequestOptions],
    ) -> aiohttp.ClientResponse:
        if self.trick == "private":
            cached, pools = self._server_base_urls, self._http
        else:
            private: dict[str, Any] = self.__pydantic_private__  # type: ignore[assignment]
            cached, pools = private["_server_base_urls"], private["_http"]
        url = cached.get(server_name) or await self._aresolve_base_url(server_name)
        body: Any = kwargs.get("json")
        if body is not None:
            if type(body) is not dict and isinstance(body, BaseModel):
                body = body.model_dump(mode="json", exclude_unset=True)
            del kwargs["json"]
            kwargs["data"] = _json_payload(body)
        sessions = pools.sessions()
        session = sessions.control if _control else sessions.data
        retry, full_url = pools.settings.retry, url + url_path
        if self.trick == "inline":
            return await send(session, method, full_url, retry, _resend_after_disconnect, kwargs)
        try:
            return await session.request(method, full_url, **kwargs)
        except RESENDABLE_ERRORS as error:
            return await send(session, method, full_url, retry, _resend_after_disconnect, kwargs, failed=error)


class WithoutPrivateRead(WithoutTrick):
    trick: ClassVar[str] = "private"


class WithoutInlineAttempt(WithoutTrick):
    trick: ClassVar[str] = "inline"


TRICKS = {
    "one read of pydantic's private store, not `self._x`": WithoutPrivateRead,
    "the first attempt made inline, not in `send`": WithoutInlineAttempt,
}


def make_variant(port: int, cls: type[WithoutTrick]) -> WithoutTrick:
    shipped = make_client(port)
    return cls(head_server_config=shipped.head_server_config, global_config_dict=shipped.global_config_dict)


async def run(port: int, concurrencies: tuple[int, ...], requests: tuple[int, ...], rounds: int) -> list[Row]:
    shipped = make_client(port)
    rows: list[Row] = []
    try:
        for trick, cls in TRICKS.items():
            variant = make_variant(port, cls)
            for concurrency, count in zip(concurrencies, requests, strict=True):
                comparison = await compare(ours_post(shipped), ours_post(variant), concurrency, count, rounds)
                ratios = comparison.ratios
                middle = f"{percentile(ratios, 0.25):.2f}-{percentile(ratios, 0.75):.2f}"
                rows.append(
                    ratio_row(
                        "hot path",
                        f"ServerClient.post with vs without {trick}, concurrency {concurrency} "
                        f"({len(ratios)} rounds, middle half {middle})",
                        _figures(comparison.ours),
                        f"without: {_figures(comparison.raw)}",
                        median(ratios),
                        None,  # informs: a ratio near 1 says the trick no longer pays and should go
                    )
                )
    finally:
        await close_http_sessions()
    return rows


def _figures(blocks: list[Block]) -> str:
    """Requests per second and this process's CPU per request (the client's own cost, less moved by load)."""
    rps = median([b.requests_per_second for b in blocks])
    return f"{rps:.0f} req/s, {median([b.cpu_us_per_request for b in blocks]):.1f} µs CPU/req"
