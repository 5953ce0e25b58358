"""DNS rebinding: a web page the operator opens can make its own name resolve to 127.0.0.1, and the browser then
treats the head's HTTP-side ports (NeMo Gym's HTTP head, metrics, Connect) as that page's own origin: it could read
the config and the statuses, and call the control plane. Such a request still names the page's host in its `Host`
header. So a port bound to a loopback address (the default) answers only requests whose `Host` is a loopback name:
a loopback IP literal, `localhost` or a `*.localhost` name (RFC 6761), any port; others get 403. Requests without a
`Host` (HTTP/1.0, no browser) pass. A head bound to another address is reachable by design and checks no `Host`
(SECURITY.md says what that leaves open).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from aiohttp import web

from gym_rpc.config import connectable_host
from gym_rpc.errors import quoted

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


def ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address an IP literal names (bracketed or not, a zone dropped, IPv4-mapped IPv6 as IPv4); None for
    anything else."""
    try:
        address = ipaddress.ip_address(host.strip().strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_loopback_host(host: str) -> bool:
    """A loopback IP literal (bracketed or not), `localhost` or a name under `.localhost`."""
    bare = host.strip().strip("[]").lower().removesuffix(".")
    if bare == "localhost" or bare.endswith(".localhost"):
        return True
    address = ip_literal(bare)
    return address is not None and address.is_loopback


def bound_to_loopback(bind_host: str) -> bool:
    """Whether a port bound to `bind_host` is reachable from this machine only (a wildcard is not)."""
    return connectable_host(bind_host) == bind_host.strip() and is_loopback_host(bind_host)


def host_of(header: str) -> str:
    """The host of a `Host` header value (`[::1]:8080` -> `::1`, `localhost:1` -> `localhost`)."""
    value = header.strip()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rpartition(":")[0] if value.count(":") == 1 else value


def refusal(header: str | None) -> str | None:
    """Why a request with this `Host` may not be served by a loopback-bound port; None when it may."""
    if header is None or is_loopback_host(host_of(header)):
        return None
    return (
        f"Host {quoted(header)} is not a loopback name: this head listens on loopback and answers requests for "
        f"localhost and loopback addresses only (a page in a browser may not reach it by another name)\n"
    )


@web.middleware
async def loopback_host_only(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The aiohttp form: first middleware of a loopback-bound app."""
    problem = refusal(request.headers.get("Host"))
    if problem is not None:
        return web.Response(status=403, text=problem)
    return await handler(request)


class LoopbackHostOnly:
    """The ASGI form: wraps a loopback-bound app (the Connect port)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            header = next((v for k, v in scope.get("headers", ()) if k == b"host"), None)
            problem = refusal(header.decode("latin-1") if header is not None else None)
            if problem is not None:
                body = problem.encode()
                headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"%d" % len(body))]
                await send({"type": "http.response.start", "status": 403, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self._app(scope, receive, send)
