"""TraceContextPathMiddleware: turn `/ng-rollout/<id>[/training-token-capture][/ng-trace/<tp>]` back into state.

Clients Gym does not instrument (a harness in a sandbox, a third-party SDK) are handed base URLs that carry the
rollout id and the trace context in the path (see `gym_rpc.client.data._rollout.apply_rollout_prefix`). A receiving
server strips those leading segments so its routes see the plain path, hands the rollout id to the handler, and
turns `/ng-trace/<traceparent>` back into the `traceparent` header. A malformed segment is answered with 400 and
a short reason instead of being routed somewhere surprising.

Two forms share one pure parser, `gym_rpc.wire.split_gym_prefixes` (next to the builder), so the rules live in
one place:

* aiohttp.web: `web.Application(middlewares=[TraceContextPathMiddleware.aiohttp(), ...])`, first in the list.
* plain ASGI: `TraceContextPathMiddleware(asgi_app)`, the outermost wrapper.

A rollout id is one plain segment (gym_rpc.wire's rule, the client's): one with `/`, `..`, a control, NUL or bidi
character is answered with 400, never handed to a handler.

With tracing on (`gym_rpc.telemetry`), both run the handler inside a SERVER span continuing the caller's trace.
"""

from __future__ import annotations

import functools
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
    if request.app not in _apps_checked:
        _check_outermost(request.app)
    raw_path = request.rel_url.raw_path
    if not raw_path.startswith(GYM_PREFIX_HEAD):
        if tracing_enabled():
            return await _traced_aiohttp(request, request, handler, None)
        return await handler(request)
    try:
        prefixes = split_gym_prefixes(raw_path)
    except MalformedGymPrefixError as error:
        return web.Response(status=400, text=f"{error}\n")
    if not prefixes.stripped:
        if tracing_enabled():
            return await _traced_aiohttp(request, request, handler, None)
        return await handler(request)
    rerouted = await _rerouted_request(request, prefixes)
    _store_prefixes(rerouted, prefixes)
    with rollout_context(prefixes.rollout_id):
        if tracing_enabled():
            return await _traced_aiohttp(request, rerouted, _inner_chain(rerouted), prefixes.rollout_id)
        return await _inner_chain(rerouted)(rerouted)


_apps_checked: weakref.WeakSet[web.Application] = weakref.WeakSet()
_keys_stored = False  # whether the documented str keys were stored once (aiohttp warns once per str key)


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


def _check_outermost(app: web.Application) -> None:
    """Warn, once per app, when a middleware runs before this one: it sees the path with the prefix, not the path
    the handler sees, so a guard there (auth by path, say) judges `/ng-rollout/x/admin` but serves `/admin`."""
    _apps_checked.add(app)
    position = list(app.middlewares).index(_aiohttp_middleware) if _aiohttp_middleware in app.middlewares else 0
    if position > 0:
        logger.warning(
            "TraceContextPathMiddleware is middleware %d of this aiohttp app: put it first "
            "(web.Application(middlewares=[TraceContextPathMiddleware.aiohttp(), ...])), so every middleware sees "
            "the path the handler sees",
            position + 1,
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


async def _rerouted_request(request: web.Request, prefixes: GymPrefixes) -> web.Request:
    """A clone of the request at the stripped path, resolved against the root app's router like a fresh request."""
    rel_url = URL.build(path=prefixes.rest, query_string=request.rel_url.raw_query_string, encoded=True)
    headers = CIMultiDict(request.headers)
    if prefixes.traceparent is not None:
        headers[TRACEPARENT_HEADER] = prefixes.traceparent  # replaces every existing value
    clone = request.clone(rel_url=rel_url, headers=headers)
    if prefixes.rest.startswith("//"):
        # clone() sets raw_path to str(rel_url), which yarl writes with two extra slashes when the path starts
        # with "//" (an empty authority), and no public way takes a raw path: keep raw_path what was actually left
        # after the prefix. Only this edge (an empty segment after the prefix, which no Gym client sends).
        query = request.rel_url.raw_query_string
        clone._message = clone._message._replace(path=prefixes.rest + (f"?{query}" if query else ""))
    root = request.app
    match_info = await root.router.resolve(clone)
    match_info.add_app(root)  # what Application._handle does: sub-app resolution already added the sub-app
    match_info.freeze()
    # aiohttp has no public way to give a request its route (Request.clone copies the old one; aiohttp's own
    # normalize_path_middleware assigns a resolved clone's the same way), so the handler sees the stripped
    # route's match_info, app and config_dict only through this.
    clone._match_info = match_info
    return clone


def _inner_chain(request: web.Request) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The handler the stripped path resolves to, wrapped in the middlewares aiohttp would run inside this one.

    For the root app those are the ones listed after this middleware (all of them if it is not listed, e.g.
    wrapped by the user); for sub-apps on the new route, all of theirs. Each app's layer runs with
    `request.app` set to that app, as aiohttp does.
    """
    match_info = request.match_info
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]] = match_info.handler
    apps = match_info.apps
    for app in reversed(apps):
        middlewares = list(app.middlewares)
        if app is apps[0]:
            middlewares = middlewares[_position_after_self(middlewares) :]
        for middleware in reversed(middlewares):
            handler = functools.partial(middleware, handler=handler)
        handler = functools.partial(_with_current_app, app, handler)
    return handler


def _position_after_self(middlewares: list[Any]) -> int:
    for index, middleware in enumerate(middlewares):
        if middleware is _aiohttp_middleware:
            return index + 1
    return 0


async def _with_current_app(
    app: web.Application,
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    request: web.Request,
) -> web.StreamResponse:
    match_info = request.match_info
    previous = match_info.current_app
    match_info.current_app = app
    try:
        return await handler(request)
    finally:
        match_info.current_app = previous


# --- the public class: plain ASGI, and aiohttp via .aiohttp() -----------------------------------------------


class TraceContextPathMiddleware:
    """Strip Gym's rollout and trace-context path prefixes before the wrapped app routes the request.

    Plain ASGI: `app = TraceContextPathMiddleware(asgi_app)`. Only `http` scopes are rewritten (`lifespan` and
    `websocket` pass through untouched). The handler gets `scope["state"]["rollout_id"]` and
    `scope["state"]["token_capture"]` (present only when the path carried a prefix), `current_rollout_id()`
    bound while the app runs, and `/ng-trace/<tp>` as the `traceparent` header. The path is parsed from
    `raw_path` (without it, from the decoded `path`); an id that is not one plain segment is answered with 400.
    Query strings are untouched. Wrap the app with it outermost: a wrapper outside it sees the prefixed path.

    aiohttp.web: `web.Application(middlewares=[TraceContextPathMiddleware.aiohttp(), ...])` on the root app,
    first in the list: a middleware before it (a path guard) would judge the path with the prefix while the
    handler serves the stripped one, so it logs a warning once, at the first request, when it is not first.
    aiohttp resolves the route before middlewares run, so for a prefixed path this middleware clones the request
    at the stripped path (with the new `traceparent` header), resolves the clone against `request.app.router`
    exactly as a fresh request would be (sub-apps included), then runs the resolved handler
    through the middlewares aiohttp would have run inside this one. Middlewares listed before it see the original
    request; the handler and those after it see the clone, with `request["rollout_id"]` and
    `request["token_capture"]` set (absent on requests that carried no prefix: use `request.get`).

    Tracing (`gym_rpc.telemetry`; off by default): while on, every request's handler runs inside a SERVER span that
    continues the caller's trace from the `traceparent` header (the one the path segment became, or the one Gym's
    clients send), with `gym.rollout_id` from the path and the http semantic-convention attributes. While off, no
    span and no OpenTelemetry import: one boolean check per request.
    """

    @staticmethod
    def aiohttp() -> Middleware:
        """The aiohttp.web form, for `web.Application(middlewares=[TraceContextPathMiddleware.aiohttp()])`."""
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
