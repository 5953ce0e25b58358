"""The head's status page: `/ui/` on the HTTP head's port (`head_server.http_port`), read-only, live.

* `/ui/` serves one HTML file, one hand-written script and one stylesheet, shipped in the package
  (gym_rpc/server/status_page/): no fetch from anywhere but the head, so it works on a cluster without internet.
  They hold no fleet data, so they are served to anyone who may reach the port.
* `/ui/api/events` is the data, as server-sent events read by `fetch` (which, unlike `EventSource`, can send the
  token in a header rather than in a URL that logs keep): a snapshot, then a frame per revision of the head's
  change feed, a heartbeat every couple of seconds (gym_rpc.server.http._page_feed). A reconnect says the revision
  it had (`Last-Event-ID`, or `?since=`) and is sent what it missed, or a fresh snapshot.
* With a token configured (`head_server.auth_token` or GYM_RPC_TOKEN), the data needs `Authorization: Bearer
  <token>`, compared in constant time as the gRPC port compares it; the page asks for the token once and keeps it
  in the tab's sessionStorage. No config value is ever sent, whatever the caller: names, types, instance
  addresses, statuses, labels, pids and calls in flight only.
* Every response carries a strict Content-Security-Policy (scripts, styles and fetches from the head only, no
  inline script or style, no frames, no forms) and the head's Host check applies (the app's first middleware on a
  loopback-bound port: gym_rpc.server.security._host_check).
* A page that stops reading holds nothing of the head: each write is bounded by the watch stall limit (as a gRPC
  watch's is), after which its connection is closed; open streams are counted per client address and in total
  (gym_rpc.server.security._watch_slots), past which a page is told to retry later (429).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from importlib import resources
from typing import Any

from aiohttp import web

from gym_rpc._logging import RateLimitedLog
from gym_rpc.server.http._page_feed import HEARTBEAT_SECONDS, EngineLoadSource, PageFeed, PageSource
from gym_rpc.server.observability import AppServer
from gym_rpc.server.security import DEFAULT_STALL_SECONDS, WatchSlots, authenticate

logger = logging.getLogger("gym_rpc.server._status_page")  # its name from before the move

UI_PATH = "/ui/"
EVENTS_PATH = "/ui/api/events"
MAX_PAGES = 64  # open page streams at once, per head
MAX_PAGES_PER_CLIENT = 16  # per client address (every loopback address is one client)
RETRY_AFTER_SECONDS = 5
SEND_BUFFER_BYTES = (
    64 * 1024
)  # the kernel's share of what a page stream may have unsent (aiohttp holds ~64 KiB more)

# No inline script or style, nothing from elsewhere, no frames, no forms, no plugins: text from a registration that
# somehow became markup could still run nothing.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-store",
}
ASSETS = {
    "index.html": "text/html",
    "page.js": "text/javascript",
    "page.css": "text/css",
}
UNAUTHENTICATED = "this head needs its token: send `Authorization: Bearer <token>` (the page asks for it)\n"


def _asset(name: str) -> bytes:
    return resources.files("gym_rpc.server").joinpath("status_page", name).read_bytes()


def _headers(**extra: str) -> dict[str, str]:
    return {**SECURITY_HEADERS, **extra}


class StatusPage:
    """The page's routes on one aiohttp app, and the feed they read (started and stopped with the head)."""

    def __init__(
        self,
        head: PageSource,
        *,
        token: str | None,
        stall_seconds: float = DEFAULT_STALL_SECONDS,
        max_pages: int = MAX_PAGES,
        max_pages_per_client: int = MAX_PAGES_PER_CLIENT,
        head_info: Any = dict,
        engine_loads: EngineLoadSource | None = None,
    ) -> None:
        self.feed = PageFeed(head, head_info=head_info, engine_loads=engine_loads)
        self._expected = token.encode() if token else None
        self.stall_seconds = stall_seconds
        self.slots = WatchSlots("status pages", max_pages, max_pages_per_client, instead="close another page")
        self._assets = {name: _asset(name) for name in ASSETS}  # read once: a few kB
        self._refusals = RateLimitedLog(logger, level=logging.INFO)
        self._dropped = RateLimitedLog(logger)

    @property
    def requires_token(self) -> bool:
        return self._expected is not None

    async def start(self) -> None:
        await self.feed.start()

    async def stop(self) -> None:
        """End every open stream (before the HTTP port stops: it waits for them) and stop following."""
        await self.feed.stop()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/ui", self.to_page)
        app.router.add_get(UI_PATH, self._asset_handler("index.html"))
        app.router.add_get("/ui/page.js", self._asset_handler("page.js"))
        app.router.add_get("/ui/page.css", self._asset_handler("page.css"))
        app.router.add_get(EVENTS_PATH, self._events)

    async def to_page(self, request: web.Request) -> web.Response:
        raise web.HTTPMovedPermanently(UI_PATH, headers=SECURITY_HEADERS)

    def _asset_handler(self, name: str) -> Any:
        body, content_type = self._assets[name], ASSETS[name]

        async def serve(request: web.Request) -> web.Response:
            return web.Response(body=body, content_type=content_type, charset="utf-8", headers=SECURITY_HEADERS)

        return serve

    def _authorized(self, request: web.Request) -> bool:
        if self._expected is None:
            return True
        header = request.headers.get("Authorization")
        return header is not None and authenticate([("authorization", header)], self._expected)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            self._refusals.log(f"refused {EVENTS_PATH}: missing or invalid bearer token")
            return web.Response(
                status=401,
                text=UNAUTHENTICATED,
                headers=_headers(**{"WWW-Authenticate": 'Bearer realm="gym-rpc"'}),
            )
        address = request.remote or ""
        refusal = self.slots.refusal(address)
        if refusal is not None:
            return web.Response(
                status=429, text=refusal + "\n", headers=_headers(**{"Retry-After": str(RETRY_AFTER_SECONDS)})
            )
        with self.slots.held(address):
            response = web.StreamResponse(
                headers=_headers(**{"Content-Type": "text/event-stream; charset=utf-8", "X-Accel-Buffering": "no"})
            )
            _bound_send_buffer(request)
            await response.prepare(request)
            await self._stream(request, response, _resume_from(request))
        return response

    async def _stream(self, request: web.Request, response: web.StreamResponse, since: int | None) -> None:
        """Send what the page misses, then every change and a heartbeat, until the page goes, stalls, or the head
        stops. The stream holds only the revision it has sent."""
        feed = self.feed
        frames = feed.frames_after(since) if since is not None else None
        if frames is None:
            seen, snapshot = feed.snapshot()
            frames = [snapshot]
        else:
            seen = feed.revision
        while not feed.closed:
            for frame in frames:
                if not await self._write(request, response, frame):
                    return
            changed = await feed.wait_for_change(seen, HEARTBEAT_SECONDS)
            if feed.closed:
                return
            if changed:
                missed = feed.frames_after(seen)
                if missed is None:
                    seen, snapshot = feed.snapshot()
                    frames = [snapshot]
                else:
                    seen, frames = feed.revision, missed
            else:
                frames = [feed.heartbeat()]

    async def _write(self, request: web.Request, response: web.StreamResponse, frame: bytes) -> bool:
        """One frame, bounded by the stall limit; False when the page went away or stalled (its connection is then
        closed, freeing what it held)."""
        try:
            await asyncio.wait_for(response.write(frame), self.stall_seconds)
        except TimeoutError:
            self._dropped.log(
                f"dropped a status page stream to {request.remote}: its reader took nothing for "
                f"{self.stall_seconds:g} s"
            )
        except (ConnectionError, RuntimeError):  # the page closed its connection (aiohttp: reset, or closing)
            return False
        else:
            return True
        transport = request.transport
        if transport is not None:
            transport.abort()
        return False


def _bound_send_buffer(request: web.Request) -> None:
    """Keep the kernel from buffering megabytes for a page that stopped reading (its send buffer would grow to
    tcp_wmem's maximum): past SEND_BUFFER_BYTES a write waits, and the stall limit ends the stream."""
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


class PageServer(AppServer):
    """The page alone on a port of its own (`--ui-port`): `/ui/` and its feed, `/` sending a browser there; none of
    NeMo Gym's unauthenticated endpoints."""

    what = "the status page"
    setting = "--ui-port"

    def __init__(self, page: StatusPage) -> None:
        super().__init__()
        self._page = page

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self._page.to_page)
        self._page.add_routes(app)
        return app


def _resume_from(request: web.Request) -> int | None:
    """The revision a reconnecting page had: `Last-Event-ID` (as EventSource sends it) or `?since=`."""
    text = request.headers.get("Last-Event-ID") or request.query.get("since", "")
    return int(text) if text.isdigit() and len(text) < 20 else None
