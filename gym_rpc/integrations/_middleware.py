"""TraceContextPathMiddleware: turn `/ng-rollout/<id>[/training-token-capture][/ng-trace/<tp>]` back into state.

Clients Gym does not instrument (a harness in a sandbox, a third-party SDK) are handed base URLs that carry the
rollout id and the trace context in the path (see `gym_rpc.client.data._rollout.apply_rollout_prefix`). A receiving
server strips those leading segments so its routes see the plain path, hands the rollout id to the handler, and
turns `/ng-trace/<traceparent>` back into the `traceparent` header. A malformed segment is answered with 400 and
a short reason instead of being routed somewhere surprising.

Two forms share one pure parser, `gym_rpc.wire.split_gym_prefixes` (next to the builder), so the rules live in
one place:

* aiohttp.web: `TraceContextPathMiddleware.install(app)` before the app starts: the middleware first, and the
  routes for the prefixed paths (`_prefix_routes`: aiohttp routes before any middleware runs).
* plain ASGI: `TraceContextPathMiddleware(asgi_app)`, the outermost wrapper.

A rollout id is one plain segment (gym_rpc.wire's rule, the client's): one with `/`, `..`, a control, NUL or bidi
character is answered with 400, never handed to a handler.

With tracing on (`gym_rpc.telemetry`), both run the handler inside a SERVER span continuing the caller's trace.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any
from urllib.parse import quote, unquote

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from multidict import CIMultiDict
from yarl import URL

from gym_rpc.client import rollout_context
from gym_rpc.errors import MalformedGymPrefixError
from gym_rpc.integrations._prefix_routes import ROUTED_PREFIXES, has_prefix_routes, install_prefix_routes
from gym_rpc.telemetry import propagation, record_failure, server_span, set_response_status, tracing_enabled
from gym_rpc.wire import GYM_PREFIX_HEAD, TRACEPARENT_HEADER, GymPrefixes, split_gym_prefixes

logger = logging.getLogger(__name__)

ROLLOUT_ID_KEY = "rollout_id"
TOKEN_CAPTURE_KEY = "token_capture"
_TRACEPARENT_ASGI = TRACEPARENT_HEADER.encode("ascii")  # ASGI header names are lower-case bytes

# Characters left as they are when a decoded ASGI path has to be re-encoded (RFC 3986 pchar minus '%').
_PATH_SAFE = "/:@!$&'()*+,;=-._~"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


# --- aiohttp.web ------------------------------------------------------------------------------------------------


@web.middleware
async def _aiohttp_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp form; see `TraceContextPathMiddleware`."""
    installed = _apps_checked.get(request.app)
    if installed is None:
        installed = _check_app(request.app)
    raw_path = request.rel_url.raw_path
    if raw_path.startswith(GYM_PREFIX_HEAD):
        prefixes = request.get(ROUTED_PREFIXES)
        if prefixes is not None:  # routed by the prefix resources: aiohttp has assigned the stripped path's route
            rerouted = _rerouted_request(request, prefixes)
            _store_prefixes(rerouted, prefixes)
            with rollout_context(prefixes.rollout_id):
                if tracing_enabled():
                    return await _traced_aiohttp(request, rerouted, handler, prefixes.rollout_id)
                return await handler(rerouted)
        try:
            stripped = split_gym_prefixes(raw_path).stripped
        except MalformedGymPrefixError as error:
            return web.Response(status=400, text=f"{error}\n")
        if stripped and not installed:
            return _refused_not_installed(request.app)
        if stripped:
            _check_claimed(request)
    # A plain path, or a prefixed one the resources left to aiohttp's own route (see _prefix_routes)
    if tracing_enabled():
        return await _traced_aiohttp(request, request, handler, None)
    return await handler(request)


# Per app, at its first request: whether TraceContextPathMiddleware.install(app) registered the prefix routes.
_apps_checked: weakref.WeakKeyDictionary[web.Application, bool] = weakref.WeakKeyDictionary()
_subapps_warned: weakref.WeakSet[web.Application] = weakref.WeakSet()
_refusals_logged: weakref.WeakSet[web.Application] = weakref.WeakSet()
_keys_stored = False  # whether the documented str keys were stored once (aiohttp warns once per str key)
_NOT_INSTALLED = (
    "TraceContextPathMiddleware cannot route a Gym-prefixed path in an aiohttp app it was not installed in: "
    "call TraceContextPathMiddleware.install(app) before the app starts"
)


def _store_prefixes(request: web.Request, prefixes: GymPrefixes) -> None:
    """`request["rollout_id"]` and `request["token_capture"]`, through the request's public mapping.

    The documented keys are plain strings, as handlers written for Gym read them; aiohttp >= 3.14 prefers
    `web.RequestKey` and warns once per process for each str key it is given, which the first store silences (a
    warning the user cannot act on). Every later store is a plain item assignment."""
    global _keys_stored
    if _keys_stored:
        request[ROLLOUT_ID_KEY] = prefixes.rollout_id
        request[TOKEN_CAPTURE_KEY] = prefixes.token_capture
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", web.NotAppKeyWarning)
        request[ROLLOUT_ID_KEY] = prefixes.rollout_id
        request[TOKEN_CAPTURE_KEY] = prefixes.token_capture
    _keys_stored = True


def _check_app(app: web.Application) -> bool:
    """Once per app, at its first request: whether the prefix routes are installed, and a warning when a
    middleware runs before this one: it sees the path with the prefix, not the path the handler sees, so a guard
    there (auth by path, say) judges `/ng-rollout/x/admin` but serves `/admin`."""
    installed = has_prefix_routes(app)
    _apps_checked[app] = installed
    position = list(app.middlewares).index(_aiohttp_middleware) if _aiohttp_middleware in app.middlewares else 0
    if position > 0:
        logger.warning(
            "TraceContextPathMiddleware is middleware %d of this aiohttp app: put it first "
            "(TraceContextPathMiddleware.install(app) does when it is not listed), so every middleware sees "
            "the path the handler sees",
            position + 1,
        )
    return installed


def _refused_not_installed(app: web.Application) -> web.Response:
    """A prefixed path in an app without the prefix routes: a middleware cannot give the request the stripped
    path's route, so it is refused rather than served at the prefixed path. Logged once per app."""
    if app not in _refusals_logged:
        _refusals_logged.add(app)
        logger.error(
            "%s (web.Application(middlewares=[TraceContextPathMiddleware.aiohttp()]) alone no longer routes "
            "/ng-rollout/... paths)",
            _NOT_INSTALLED,
        )
    return web.Response(status=500, text=_NOT_INSTALLED + "\n")


def _check_claimed(request: web.Request) -> None:
    """A well-formed prefixed path the prefix routes did not take, in a sub-app: a domain sub-app
    (`app.add_domain`) is tried before any path route of the root app, so it needs install of its own. Said once
    per sub-app; the request is served as routed (usually a 404)."""
    apps = request.match_info.apps
    if len(apps) > 1 and apps[-1] not in _subapps_warned:
        _subapps_warned.add(apps[-1])
        logger.warning(
            "a sub-app took the Gym-prefixed path %s before TraceContextPathMiddleware's routes did (a domain "
            "sub-app, app.add_domain, is tried first): call TraceContextPathMiddleware.install(subapp) before "
            "adding it",
            request.rel_url.raw_path[:200],
        )


async def _traced_aiohttp(
    original: web.Request,
    request: web.Request,
    call: Callable[[web.Request], Awaitable[web.StreamResponse]],
    rollout_id: str | None,
) -> web.StreamResponse:
    """Run the handler inside a SERVER span continuing the trace of `request`'s `traceparent` (which, for a
    `/ng-trace/<tp>` path, is the one taken from the path)."""
    resource = request.match_info.route.resource
    url = request.url
    with server_span(
        request.method,
        request.headers,
        path=original.rel_url.raw_path,  # as received: an encoded '/' in a rollout id stays encoded
        scheme=request.scheme,
        rollout_id=rollout_id,
        route=resource.canonical if resource is not None else None,
        server_address=(url.host, url.port) if url.host and url.port else None,
    ) as span:
        try:
            response = await call(request)
        except web.HTTPException as answer:  # raised as an answer, e.g. HTTPNotFound
            set_response_status(span, answer.status, server=True)
            raise
        except BaseException as error:
            record_failure(span, error)
            raise
        set_response_status(span, response.status, server=True)
        return response


def _rerouted_request(request: web.Request, prefixes: GymPrefixes) -> web.Request:
    """A clone of the request at the stripped path: `clone()` keeps the route aiohttp assigned, which the prefix
    resources resolved from that same path; `/ng-trace/<tp>` becomes the `traceparent` header."""
    rel_url = URL.build(path=prefixes.rest, query_string=request.rel_url.raw_query_string, encoded=True)
    if prefixes.traceparent is None:
        return request.clone(rel_url=rel_url)
    headers = CIMultiDict(request.headers)
    headers[TRACEPARENT_HEADER] = prefixes.traceparent  # replaces every existing value
    return request.clone(rel_url=rel_url, headers=headers)


# --- the public class: plain ASGI, and aiohttp via .aiohttp() -----------------------------------------------


class TraceContextPathMiddleware:
    """Strip Gym's rollout and trace-context path prefixes before the wrapped app routes the request.

    Plain ASGI: `app = TraceContextPathMiddleware(asgi_app)`. Only `http` scopes are rewritten (`lifespan` and
    `websocket` pass through untouched). The handler gets `scope["state"]["rollout_id"]` and
    `scope["state"]["token_capture"]` (present only when the path carried a prefix), `current_rollout_id()`
    bound while the app runs, and `/ng-trace/<tp>` as the `traceparent` header. The path is parsed from
    `raw_path` (without it, from the decoded `path`); an id that is not one plain segment is answered with 400.
    Query strings are untouched. Wrap the app with it outermost: a wrapper outside it sees the prefixed path.

    aiohttp.web: `TraceContextPathMiddleware.install(app)` on the root app, before it starts. aiohttp picks a
    request's route before any middleware runs, so install registers two routes (custom resources) for
    `/ng-rollout/...` and `/ng-trace/...` that resolve the stripped path in the same router (sub-apps included)
    and stand for the route found there: aiohttp then runs that route's apps' middlewares with `request.app` set as
    for a fresh request. It also puts this middleware first in `app.middlewares` unless it is listed already
    (`TraceContextPathMiddleware.aiohttp()`): a middleware before it (a path guard) would judge the path with the
    prefix while the handler serves the stripped one, so it logs a warning once, at the first request, when it is
    not first. It hands the handler and the middlewares after it a `request.clone()` at the stripped path (with the
    new `traceparent` header) and `request["rollout_id"]` and `request["token_capture"]` set (absent on requests
    that carried no prefix: use `request.get`); middlewares listed before it see the original request. An app that
    lists the middleware without install answers a prefixed path with 500 and logs an error once.

    Tracing (`gym_rpc.telemetry`; off by default): while on, every request's handler runs inside a SERVER span that
    continues the caller's trace from the `traceparent` header (the one the path segment became, or the one Gym's
    clients send), with `gym.rollout_id` from the path and the http semantic-convention attributes. While off, no
    span and no OpenTelemetry import: one boolean check per request.
    """

    @staticmethod
    def install(app: web.Application) -> web.Application:
        """Set up the aiohttp.web form on the root `app` before it starts (once; again is a no-op): the routes for
        the prefixed paths, and the middleware first in `app.middlewares` unless it is listed already."""
        install_prefix_routes(app)
        if _aiohttp_middleware not in app.middlewares:
            app.middlewares.insert(0, _aiohttp_middleware)
        return app

    @staticmethod
    def aiohttp() -> Middleware:
        """The aiohttp.web middleware itself, to list it in a chosen place (`web.Application(middlewares=[...])`);
        `install(app)` is still needed, for the routes."""
        return _aiohttp_middleware

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        root_path: str = scope.get("root_path") or ""
        mount = root_path if root_path and path.startswith(root_path) else ""
        if not path.startswith(GYM_PREFIX_HEAD, len(mount)):
            if tracing_enabled():
                await self._traced(scope, receive, send, None, scope)
            else:
                await self.app(scope, receive, send)
            return
        raw_mount, raw_relative = _raw_relative_path(scope, mount)
        try:
            prefixes = split_gym_prefixes(raw_relative)
        except MalformedGymPrefixError as error:
            await _send_plain_text(send, 400, f"{error}\n")
            return
        if not prefixes.stripped:
            if tracing_enabled():
                await self._traced(scope, receive, send, None, scope)
            else:
                await self.app(scope, receive, send)
            return
        rewritten = _rewritten_scope(scope, mount, raw_mount, prefixes)
        with rollout_context(prefixes.rollout_id):
            if tracing_enabled():
                await self._traced(rewritten, receive, send, prefixes.rollout_id, scope)
            else:
                await self.app(rewritten, receive, send)

    async def _traced(
        self, scope: Scope, receive: Receive, send: Send, rollout_id: str | None, original: Scope
    ) -> None:
        """The wrapped app inside a SERVER span continuing the caller's trace (tracing on); `original` is the scope
        as received, for the span's url.path."""

        async def call(traced_send: Send) -> None:
            await self.app(scope, receive, traced_send)

        await traced_asgi_call(call, send, scope, rollout_id, _received_path(original))


def _received_path(scope: Scope) -> str:
    """The path as the client sent it (still percent-encoded when the server kept `raw_path`)."""
    raw: bytes | None = scope.get("raw_path")
    return raw.decode("latin-1").partition("?")[0] if raw else str(scope["path"])


def _raw_relative_path(scope: Scope, mount: str) -> tuple[str, str]:
    """(raw mount part, raw path below the mount) from `raw_path`, or re-encoded from `path` when that is absent
    or does not agree with `path` (a proxy that rewrote one but not the other)."""
    relative = scope["path"][len(mount) :]
    raw: bytes | None = scope.get("raw_path")
    if raw:
        raw_text = raw.decode("utf-8", "surrogateescape").partition("?")[0]
        for raw_mount in (mount, ""):
            if raw_text.startswith(raw_mount) and _decodes_to(raw_text[len(raw_mount) :], relative):
                return raw_mount, raw_text[len(raw_mount) :]
    return mount, quote(relative, safe=_PATH_SAFE)


def _decodes_to(raw: str, decoded: str) -> bool:
    """Whether `raw` decodes to `decoded` the way servers decode `path` (invalid UTF-8 becomes U+FFFD)."""
    return unquote(raw) == decoded


def _rewritten_scope(scope: Scope, mount: str, raw_mount: str, prefixes: GymPrefixes) -> Scope:
    """A copy of the scope at the stripped path, with the prefix values in its state and the traceparent header."""
    rewritten = dict(scope)
    rewritten["path"] = mount + unquote(prefixes.rest)
    if scope.get("raw_path") is not None:
        rewritten["raw_path"] = (raw_mount + prefixes.rest).encode("utf-8", "surrogateescape")
    state = dict(scope.get("state") or {})
    state[ROLLOUT_ID_KEY] = prefixes.rollout_id
    state[TOKEN_CAPTURE_KEY] = prefixes.token_capture
    rewritten["state"] = state
    if prefixes.traceparent is not None:
        headers = [(name, value) for name, value in scope.get("headers", ()) if name.lower() != _TRACEPARENT_ASGI]
        headers.append((_TRACEPARENT_ASGI, prefixes.traceparent.encode("ascii")))
        rewritten["headers"] = headers
    return rewritten


async def _send_plain_text(send: Send, status: int, text: str) -> None:
    body = text.encode("utf-8")
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode("ascii")),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# --- tracing of ASGI calls -------------------------------------------------------------------------------------


def asgi_trace_headers(raw_headers: Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    """The propagation headers of an ASGI scope, as the propagator reads them (lower-case names)."""
    wanted = propagation().get_global_textmap().fields
    headers: dict[str, str] = {}
    for name, value in raw_headers:
        key = name.decode("latin-1").lower()
        if key in wanted:
            headers[key] = value.decode("latin-1")
    return headers


async def traced_asgi_call(
    call: Callable[[Callable[[MutableMapping[str, Any]], Awaitable[None]]], Awaitable[None]],
    send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    scope: Mapping[str, Any],
    rollout_id: str | None,
    original_path: str,
) -> None:
    """Run an ASGI app (`call(send)`) inside a SERVER span; the status comes from `http.response.start`."""
    server = scope.get("server")
    with server_span(
        scope.get("method", "GET"),
        asgi_trace_headers(scope.get("headers") or ()),
        path=original_path,
        scheme=scope.get("scheme", "http"),
        rollout_id=rollout_id,
        server_address=(str(server[0]), int(server[1])) if server and server[1] is not None else None,
    ) as span:

        async def send_recording_status(message: MutableMapping[str, Any]) -> None:
            if message.get("type") == "http.response.start":
                set_response_status(span, int(message["status"]), server=True)
            await send(message)

        try:
            await call(send_recording_status)
        except BaseException as error:
            record_failure(span, error)
            raise
