"""TraceContextPathMiddleware: the shared parser, then round trips through a real aiohttp server and a real ASGI
server (uvicorn serving a hand-written ASGI app), with aiohttp's ClientSession as the client."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import uvicorn
from aiohttp import ClientSession, web
from aiohttp.typedefs import Handler
from yarl import URL

from gym_rpc.client.data._rollout import current_rollout_id
from gym_rpc.errors import MalformedGymPrefixError
from gym_rpc.integrations._middleware import Message, Receive, Scope, Send, TraceContextPathMiddleware
from gym_rpc.wire import rollout_path_prefix
from gym_rpc.wire._paths import GymPrefixes, split_gym_prefixes
from tests.support.loopback import LOOPBACK

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{SPAN_ID}-01"
FULL_PREFIX = f"/ng-rollout/r-1/training-token-capture/ng-trace/{TRACEPARENT}"
MALFORMED_TRACEPARENTS = [
    "garbage",
    f"01-{TRACE_ID}-{SPAN_ID}-01",  # unknown version
    f"00-{TRACE_ID.upper()}-{SPAN_ID}-01",  # upper-case hex
    f"00-{TRACE_ID}-{SPAN_ID}-01-extra",
    f"00-{TRACE_ID}-{SPAN_ID}",
    f"00-{'0' * 32}-{SPAN_ID}-01",  # all-zero trace id
    f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero span id
    f"00-{TRACE_ID}-{SPAN_ID}-01%20",
]
BAD_ROLLOUT_PATHS = [
    "/ng-rollout",
    "/ng-rollout/",
    "/ng-rollout//v1/responses",
    "/ng-rollout/%zz/v1/responses",
    "/ng-rollout/%2E%2E/v1/responses",
    "/ng-rollout/%FF/v1/responses",
    f"/ng-rollout/{'x' * 257}/v1/responses",
]
# Hostile ids (issue 26, point 7): each decodes to what is not one plain segment, so no handler may see it.
HOSTILE_ROLLOUT_PATHS = [
    "/ng-rollout/r%2F1/v1/responses",  # "/"
    "/ng-rollout/..%2Fetc/v1/responses",
    "/ng-rollout/%2E%2E%2F%2E%2E/v1/responses",
    "/ng-rollout/r%00/v1/responses",  # NUL
    "/ng-rollout/r%0A1/v1/responses",  # a line feed
    "/ng-rollout/r%7F/v1/responses",  # DEL
    "/ng-rollout/%E2%80%AEtxt.exe/v1/responses",  # RIGHT-TO-LEFT OVERRIDE
    "/ng-rollout/r%E2%81%A61/v1/responses",  # LEFT-TO-RIGHT ISOLATE
    "/ng-rollout/r%201/v1/responses",  # a space
    "/ng-rollout/r%5C1/v1/responses",  # a backslash
    "/ng-rollout/.hidden/v1/responses",
]
PLAIN_IDS = ["r1", "rollout-7", "task_3.attempt-2", "0" * 256]


# --- the shared parser -------------------------------------------------------------------------------------------


def test_full_prefix_is_split():
    assert split_gym_prefixes(FULL_PREFIX + "/v1/responses") == GymPrefixes(
        "/v1/responses", "r-1", True, TRACEPARENT
    )


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v1/responses", GymPrefixes("/v1/responses", None, False, None)),
        ("/ng-other/v1", GymPrefixes("/ng-other/v1", None, False, None)),
        ("/ng-rolloutx/v1", GymPrefixes("/ng-rolloutx/v1", None, False, None)),
        ("/ng-rollout/r1/v1/responses", GymPrefixes("/v1/responses", "r1", False, None)),
        ("/ng-rollout/r1", GymPrefixes("/", "r1", False, None)),
        ("/ng-rollout/r1/training-token-capture", GymPrefixes("/", "r1", True, None)),
        (f"/ng-trace/{TRACEPARENT}/verify", GymPrefixes("/verify", None, False, TRACEPARENT)),
        (f"/ng-rollout/r1/ng-trace/{TRACEPARENT}/a%2Fb//c/", GymPrefixes("/a%2Fb//c/", "r1", False, TRACEPARENT)),
    ],
)
def test_prefix_combinations(path: str, expected: GymPrefixes):
    assert split_gym_prefixes(path) == expected
    assert split_gym_prefixes(path).stripped == (expected.rest != path)


@pytest.mark.parametrize("path", HOSTILE_ROLLOUT_PATHS)
def test_the_parser_refuses_hostile_rollout_ids(path: str):
    with pytest.raises(MalformedGymPrefixError, match="not a rollout id"):
        split_gym_prefixes(path)


def test_an_escaped_plain_id_is_the_plain_id():
    assert split_gym_prefixes("/ng-rollout/r%2D1/v1").rollout_id == "r-1"


@pytest.mark.parametrize("rollout_id", PLAIN_IDS)
def test_parser_inverts_the_client_prefix(rollout_id: str):
    path = rollout_path_prefix(rollout_id, token_capture=True) + "/v1/responses"
    assert split_gym_prefixes(path) == GymPrefixes("/v1/responses", rollout_id, True, None)


@pytest.mark.parametrize("traceparent", MALFORMED_TRACEPARENTS)
def test_malformed_traceparent_is_rejected(traceparent: str):
    with pytest.raises(MalformedGymPrefixError, match="traceparent"):
        split_gym_prefixes(f"/ng-rollout/r1/ng-trace/{traceparent}/v1/responses")


@pytest.mark.parametrize("path", [*BAD_ROLLOUT_PATHS, "/ng-trace", "/ng-trace/", "/ng-trace//v1"])
def test_bad_segments_are_rejected_with_a_value_error(path: str):
    with pytest.raises(MalformedGymPrefixError) as caught:
        split_gym_prefixes(path)
    assert isinstance(caught.value, ValueError)


# --- servers -----------------------------------------------------------------------------------------------------


def _observation(
    path: str, query: str, rollout_id: Any, token_capture: Any, traceparents: list[str], body: str
) -> dict[str, Any]:
    """What a handler saw, in the same shape for both app kinds."""
    return {
        "path": path,
        "query": query,
        "rollout_id": rollout_id,
        "token_capture": token_capture,
        "traceparents": traceparents,
        "current_rollout_id": current_rollout_id(),
        "body": body,
    }


def aiohttp_app() -> web.Application:
    """The middleware first, with an outer and an inner middleware around it and a sub-app, to prove routing
    and the middleware chain behave as for a fresh request."""

    @web.middleware
    async def outer(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        response.headers["x-outer-path"] = request.rel_url.raw_path  # as received: header-safe
        resource = request.match_info.route.resource  # the route aiohttp assigned, before any middleware ran
        response.headers["x-outer-route"] = resource.canonical if resource is not None else "-"
        return response

    @web.middleware
    async def inner(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        response.headers["x-inner-path"] = request.path
        return response

    async def responses(request: web.Request) -> web.Response:
        traceparents = request.headers.getall("traceparent", [])
        query = request.rel_url.raw_query_string
        seen = _observation(
            request.path,
            query,
            request.get("rollout_id"),
            request.get("token_capture"),
            traceparents,
            await request.text(),
        )
        return web.json_response(seen)

    async def item(request: web.Request) -> web.Response:
        return web.json_response({"name": request.match_info["name"], "rollout_id": current_rollout_id()})

    sub = web.Application(middlewares=[inner])

    async def in_sub(request: web.Request) -> web.Response:
        return web.json_response({"app_is_sub": request.app is sub, "rollout_id": request.get("rollout_id")})

    async def prepared_in_sub(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-sub-prepared"] = "yes"

    sub.router.add_get("/where", in_sub)
    sub.on_response_prepare.append(prepared_in_sub)
    app = web.Application(middlewares=[outer, TraceContextPathMiddleware.aiohttp(), inner])
    app.router.add_route("*", "/v1/responses", responses)
    app.router.add_get("/items/{name}", item)
    app.add_subapp("/sub", sub)
    return TraceContextPathMiddleware.install(app)


class RawAsgiApp:
    """A hand-written ASGI app: lifespan puts a flag in the shared state; `/v1/responses` reports what it saw."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] != "/v1/responses":
            await self._send(send, 404, b"not found")
            return
        state = scope.get("state", {})
        traceparents = [value.decode() for name, value in scope["headers"] if name == b"traceparent"]
        seen = _observation(
            scope["path"],
            scope["query_string"].decode(),
            state.get("rollout_id"),
            state.get("token_capture"),
            traceparents,
            body.decode(),
        )
        seen["started_by_lifespan"] = state.get("started_by_lifespan")
        seen["raw_path"] = scope["raw_path"].decode()
        await self._send(send, 200, json.dumps(seen).encode())

    @staticmethod
    async def _lifespan(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                scope["state"]["started_by_lifespan"] = True
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    @staticmethod
    async def _send(send: Send, status: int, body: bytes) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def uvicorn_server() -> AsyncIterator[Callable[[Any], Awaitable[int]]]:
    """Factory: serve an ASGI app with a real uvicorn on a free loopback port (lifespan on); return the port."""
    running: list[tuple[uvicorn.Server, asyncio.Task]] = []

    async def start(app: Any) -> int:
        config = uvicorn.Config(app, host=LOOPBACK, port=0, lifespan="on", log_level="warning", access_log=False)
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        running.append((server, task))
        deadline = asyncio.get_running_loop().time() + 5
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("uvicorn stopped before it started")
            assert asyncio.get_running_loop().time() < deadline, "uvicorn did not start within 5 s"
            await asyncio.sleep(0.01)
        return int(server.servers[0].sockets[0].getsockname()[1])

    yield start
    for server, task in running:
        server.should_exit = True
        await asyncio.wait_for(task, 5)


@pytest.fixture(params=["aiohttp", "asgi"])
async def base_url(request: pytest.FixtureRequest, http_server: Any, uvicorn_server: Any) -> str:
    """Each round-trip test runs against both app kinds."""
    if request.param == "aiohttp":
        port = await http_server(aiohttp_app())
    else:
        port = await uvicorn_server(TraceContextPathMiddleware(RawAsgiApp()))
    return f"http://{LOOPBACK}:{port}"


@pytest.fixture
async def session() -> AsyncIterator[ClientSession]:
    async with ClientSession() as client:
        yield client


async def _call(
    session: ClientSession, base_url: str, path: str, method: str = "GET", **kwargs: Any
) -> tuple[int, str]:
    async with session.request(method, URL(base_url + path, encoded=True), **kwargs) as response:
        return response.status, await response.text()


# --- round trips (both kinds) ------------------------------------------------------------------------------------


async def test_full_prefix_reaches_the_handler_with_everything_handed_over(session: ClientSession, base_url: str):
    status, text = await _call(
        session,
        base_url,
        FULL_PREFIX + "/v1/responses?x=1&y=a%2Fb",
        "POST",
        json={"input": "hi"},
        headers={"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"},  # replaced by the path's value
    )
    assert status == 200, text
    seen = json.loads(text)
    assert seen["path"] == "/v1/responses"
    assert seen["query"] == "x=1&y=a%2Fb"
    assert seen["rollout_id"] == "r-1"
    assert seen["token_capture"] is True
    assert seen["traceparents"] == [TRACEPARENT]
    assert seen["current_rollout_id"] == "r-1"
    assert json.loads(seen["body"]) == {"input": "hi"}


async def test_plain_path_passes_untouched(session: ClientSession, base_url: str):
    status, text = await _call(session, base_url, "/v1/responses?x=1")
    assert status == 200, text
    seen = json.loads(text)
    assert (seen["path"], seen["query"], seen["traceparents"]) == ("/v1/responses", "x=1", [])
    assert (seen["rollout_id"], seen["token_capture"], seen["current_rollout_id"]) == (None, None, None)


async def test_trace_segment_alone_sets_only_the_header(session: ClientSession, base_url: str):
    status, text = await _call(session, base_url, f"/ng-trace/{TRACEPARENT}/v1/responses")
    assert status == 200, text
    seen = json.loads(text)
    assert seen["traceparents"] == [TRACEPARENT]
    assert (seen["rollout_id"], seen["token_capture"], seen["current_rollout_id"]) == (None, False, None)


async def test_plain_rollout_ids_round_trip(session: ClientSession, base_url: str):
    for rollout_id in PLAIN_IDS:
        status, text = await _call(session, base_url, rollout_path_prefix(rollout_id) + "/v1/responses")
        assert status == 200, text
        seen = json.loads(text)
        assert (seen["rollout_id"], seen["current_rollout_id"], seen["path"]) == (
            rollout_id,
            rollout_id,
            "/v1/responses",
        )


async def test_malformed_traceparent_segment_is_answered_400(session: ClientSession, base_url: str):
    for traceparent in MALFORMED_TRACEPARENTS:
        status, text = await _call(session, base_url, f"/ng-rollout/r1/ng-trace/{traceparent}/v1/responses")
        assert status == 400, (traceparent, text)
        assert "traceparent" in text


async def test_bad_rollout_segment_is_answered_400(session: ClientSession, base_url: str):
    for path in BAD_ROLLOUT_PATHS:
        status, text = await _call(session, base_url, path)
        assert status == 400, (path, text)
        assert "rollout id" in text


async def test_hostile_rollout_ids_are_answered_400_and_never_reach_a_handler(
    session: ClientSession, base_url: str
):
    for path in HOSTILE_ROLLOUT_PATHS:
        status, text = await _call(session, base_url, path)
        assert (status, text.startswith("rollout id segment")) == (400, True), (path, text)
        assert "\x00" not in text and "\u202e" not in text  # the reply quotes the segment as it came, escaped


async def test_stripped_path_without_a_route_is_404(session: ClientSession, base_url: str):
    status, _ = await _call(session, base_url, "/ng-rollout/r1/nowhere")
    assert status == 404


# --- aiohttp specifics -------------------------------------------------------------------------------------------


async def test_aiohttp_reroute_behaves_like_a_fresh_request(http_server: Any, session: ClientSession):
    base = f"http://{LOOPBACK}:{await http_server(aiohttp_app())}"

    async with session.get(URL(base + "/ng-rollout/r1/v1/responses", encoded=True)) as response:
        assert response.status == 200
        assert response.headers["x-outer-path"] == "/ng-rollout/r1/v1/responses"  # before: the original
        assert response.headers["x-inner-path"] == "/v1/responses"  # after: the rerouted clone

    async with session.get(URL(base + "/ng-rollout/r1/items/a%20b", encoded=True)) as response:
        assert await response.json() == {"name": "a b", "rollout_id": "r1"}  # match_info of the new route
        assert response.headers["x-outer-route"] == "/items/{name}"  # aiohttp assigned it, for every middleware

    async with session.post(URL(base + "/ng-rollout/r1/items/a", encoded=True)) as response:
        assert response.status == 405  # as for POST /items/a
        assert set(response.headers["Allow"].split(",")) == {"GET", "HEAD"}

    async with session.get(
        URL(base + f"/ng-rollout/r1/ng-trace/{TRACEPARENT}/sub/where", encoded=True)
    ) as response:
        assert await response.json() == {"app_is_sub": True, "rollout_id": "r1"}
        assert response.headers["x-inner-path"] == "/sub/where"  # the sub-app's own middleware ran
        assert response.headers.get("x-sub-prepared") == "yes"  # and its on_response_prepare signal


def _catch_all_app(seen: list[tuple[str, Any]], *middlewares: Any) -> web.Application:
    """An app whose one route serves every path (and records what it saw): a path it does not see was refused."""

    async def anything(request: web.Request) -> web.Response:
        seen.append((request.raw_path, request.get("rollout_id")))
        return web.Response(text="served")

    app = web.Application(middlewares=list(middlewares))
    app.router.add_route("*", "/{tail:.*}", anything)
    return app


async def test_an_empty_segment_after_the_prefix_is_answered_404_and_never_reaches_a_handler(
    http_server: Any, session: ClientSession
):
    """`/ng-rollout/<id>//x`: the stripped path would start with "//", which a request clone cannot carry as its
    raw path (yarl writes it with an empty authority); it is answered as aiohttp answers a path without a route,
    even where a catch-all route would serve it."""
    seen: list[tuple[str, Any]] = []
    base = f"http://{LOOPBACK}:{await http_server(TraceContextPathMiddleware.install(_catch_all_app(seen)))}"
    for path in ("/ng-rollout/r1//v1/responses?x=1", f"/ng-trace/{TRACEPARENT}//v1/responses", "/ng-rollout/r1//"):
        status, text = await _call(session, base, path, "POST")
        assert (status, text) == (404, "404: Not Found"), path
    assert seen == []
    assert await _call(session, base, "/ng-rollout/r1/v1/responses?x=1") == (200, "served")
    # A second prefix inside the stripped path is a plain path there, as it always was.
    assert await _call(session, base, "/ng-rollout/r1/ng-rollout/r2/x") == (200, "served")
    assert seen == [("/v1/responses?x=1", "r1"), ("/ng-rollout/r2/x", "r1")]


async def test_an_app_that_lists_the_middleware_without_install_refuses_prefixed_paths_with_500(
    http_server: Any, session: ClientSession, caplog: pytest.LogCaptureFixture
):
    """The middleware alone cannot give a request another route (aiohttp routes before middlewares run, and
    has no public way to re-route): a prefixed path is answered 500 with what to do, never served at the
    prefixed path, and the log says so once. Plain paths and the 400s are as with install."""
    seen: list[tuple[str, Any]] = []
    app = _catch_all_app(seen, TraceContextPathMiddleware.aiohttp())
    base = f"http://{LOOPBACK}:{await http_server(app)}"
    with caplog.at_level(logging.ERROR, logger="gym_rpc.integrations._middleware"):
        assert await _call(session, base, "/v1/responses") == (200, "served")
        assert "install(app)" not in caplog.text  # said when a prefixed path is refused, not before
        for _ in range(3):
            status, text = await _call(session, base, FULL_PREFIX + "/v1/responses")
            assert status == 500 and "TraceContextPathMiddleware.install(app)" in text, text
        assert (await _call(session, base, "/ng-rollout/r%2F1/v1/responses"))[0] == 400
        assert await _call(session, base, "/v1/responses") == (200, "served")
    assert seen == [("/v1/responses", None)] * 2
    errors = [record for record in caplog.records if "install(app)" in record.getMessage()]
    assert len(errors) == 1, caplog.text


async def _domain_sub_apps_come_first(http_server: Any, session: ClientSession) -> bool:
    """Whether this aiohttp tries a domain sub-app before the root app's path routes (it does since
    aio-libs/aiohttp#11673; before, after them): asked of aiohttp itself, with one path served by both."""

    def answering(text: str) -> web.Application:
        async def answer(request: web.Request) -> web.Response:
            return web.Response(text=text)

        app = web.Application()
        app.router.add_get("/probe", answer)
        return app

    root = answering("root")
    root.add_domain("rollouts.test", answering("sub"))
    base = f"http://{LOOPBACK}:{await http_server(root)}"
    return await _call(session, base, "/probe", headers={"Host": "rollouts.test"}) == (200, "sub")


async def test_a_domain_sub_app_routes_prefixed_paths_with_its_own_install(
    http_server: Any, session: ClientSession, caplog: pytest.LogCaptureFixture
):
    """A domain sub-app (`app.add_domain`) that aiohttp tries before any path route of the root app takes its
    requests before the root's prefix routes see them: without install of its own, a prefixed path there is a
    404 and the log says what to do, once. With it, the sub-app's handler gets the stripped path and the rollout
    id, whichever aiohttp tries first."""

    def served(install_sub: bool) -> web.Application:
        sub = web.Application()

        async def where(request: web.Request) -> web.Response:
            return web.json_response([request.app is sub, request.get("rollout_id"), request.path])

        sub.router.add_get("/where", where)
        if install_sub:
            TraceContextPathMiddleware.install(sub)
        app = TraceContextPathMiddleware.install(web.Application())
        app.add_domain("rollouts.test", sub)
        return app

    host = {"Host": "rollouts.test"}
    domain_first = await _domain_sub_apps_come_first(http_server, session)
    with caplog.at_level(logging.WARNING, logger="gym_rpc.integrations._middleware"):
        bare = f"http://{LOOPBACK}:{await http_server(served(install_sub=False))}"
        assert await _call(session, bare, "/where", headers=host) == (200, '[true, null, "/where"]')
        for _ in range(2):
            status, text = await _call(session, bare, "/ng-rollout/r1/where", headers=host)
            if domain_first:
                assert status == 404, text
            else:  # the root's prefix routes come first, and resolve the stripped path into the sub-app
                assert (status, json.loads(text)) == (200, [True, "r1", "/where"])
    claimed = [record for record in caplog.records if "install(subapp)" in record.getMessage()]
    assert len(claimed) == (1 if domain_first else 0), caplog.text

    installed = f"http://{LOOPBACK}:{await http_server(served(install_sub=True))}"
    status, text = await _call(session, installed, f"/ng-rollout/r1/ng-trace/{TRACEPARENT}/where", headers=host)
    assert (status, json.loads(text)) == (200, [True, "r1", "/where"])


async def test_install_puts_the_middleware_first_once_and_only_before_the_root_app_starts(http_server: Any):
    @web.middleware
    async def other(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await handler(request)

    middleware = TraceContextPathMiddleware.aiohttp()
    app = web.Application(middlewares=[other])
    assert TraceContextPathMiddleware.install(app) is app
    TraceContextPathMiddleware.install(app)  # again: nothing more
    assert (list(app.middlewares), len(app.router.resources())) == ([middleware, other], 2)
    listed = TraceContextPathMiddleware.install(web.Application(middlewares=[other, middleware]))
    assert list(listed.middlewares) == [other, middleware]  # where the user put it (warned about at run time)

    started = web.Application()
    await http_server(started)
    with pytest.raises(RuntimeError, match="before the aiohttp app starts"):
        TraceContextPathMiddleware.install(started)
    with pytest.raises(RuntimeError, match="on the root aiohttp application"):
        web.Application().add_subapp("/sub", TraceContextPathMiddleware.install(web.Application()))


# --- ASGI specifics ----------------------------------------------------------------------------------------------


async def test_asgi_lifespan_passes_through_and_its_state_reaches_handlers(
    uvicorn_server: Any, session: ClientSession
):
    base = f"http://{LOOPBACK}:{await uvicorn_server(TraceContextPathMiddleware(RawAsgiApp()))}"
    status, text = await _call(session, base, FULL_PREFIX + "/v1/responses")
    assert status == 200, text
    seen = json.loads(text)
    assert seen["started_by_lifespan"] is True
    assert seen["raw_path"] == "/v1/responses"


class _Capture:
    """A real ASGI callable that keeps the scope it was called with."""

    def __init__(self) -> None:
        self.scopes: list[Scope] = []
        self.rollout_ids: list[str | None] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scopes.append(scope)
        self.rollout_ids.append(current_rollout_id())


async def _no_message() -> Message:
    raise AssertionError("nothing should be received")


async def _discard(message: Message) -> None:
    return None


def _http_scope(path: str, raw_path: bytes | None, root_path: str = "") -> dict:
    scope = {"type": "http", "path": path, "root_path": root_path, "query_string": b"q=1", "headers": []}
    if raw_path is not None:
        scope["raw_path"] = raw_path
    return scope


async def test_asgi_websocket_scope_passes_untouched():
    inner = _Capture()
    scope = {"type": "websocket", "path": "/ng-rollout/r1/ws", "raw_path": b"/ng-rollout/r1/ws", "headers": []}
    await TraceContextPathMiddleware(inner)(scope, _no_message, _discard)
    assert inner.scopes == [scope]
    assert inner.scopes[0] is scope
    assert inner.rollout_ids == [None]


async def test_asgi_without_raw_path_parses_the_decoded_path():
    inner = _Capture()
    await TraceContextPathMiddleware(inner)(
        _http_scope("/ng-rollout/r-1/v1/responses", None), _no_message, _discard
    )
    (scope,) = inner.scopes
    assert scope["path"] == "/v1/responses"
    assert "raw_path" not in scope
    assert scope["state"] == {"rollout_id": "r-1", "token_capture": False}
    assert scope["query_string"] == b"q=1"
    assert inner.rollout_ids == ["r-1"]


async def test_asgi_root_path_is_kept_in_front_of_the_stripped_path():
    inner = _Capture()
    scope = _http_scope("/api/ng-rollout/r%2D1/v1/x%2Fy", b"/api/ng-rollout/r%2D1/v1/x%2Fy", root_path="/api")
    scope["path"] = "/api/ng-rollout/r-1/v1/x/y"  # what a server decodes from that raw path
    await TraceContextPathMiddleware(inner)(scope, _no_message, _discard)
    (rewritten,) = inner.scopes
    assert rewritten["path"] == "/api/v1/x/y"
    assert rewritten["raw_path"] == b"/api/v1/x%2Fy"
    assert rewritten["state"]["rollout_id"] == "r-1"
    assert scope["path"] == "/api/ng-rollout/r-1/v1/x/y"  # the caller's scope is not mutated


_FRESH_PROCESS = """
import asyncio, json, urllib.request, warnings
from aiohttp import web
from gym_rpc.integrations import TraceContextPathMiddleware

warnings.simplefilter("error")  # any warning at all is an exception, in the handler too

async def handler(request):
    return web.json_response({"rollout_id": request["rollout_id"], "token_capture": request["token_capture"]})

async def main():
    app = TraceContextPathMiddleware.install(web.Application())
    app.router.add_post("/v1/responses", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    answers = []
    for _ in range(2):
        url = f"http://127.0.0.1:{port}/ng-rollout/r1/training-token-capture/v1/responses"
        request = urllib.request.Request(url, data=b"{}", method="POST")
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=10).read())
        answers.append(json.loads(body))
    await runner.cleanup()
    print(json.dumps(answers))

asyncio.run(main())
"""


@pytest.mark.process
def test_the_prefix_values_are_stored_without_a_warning_in_a_fresh_process() -> None:
    """aiohttp >= 3.14 warns once per process for each str key stored in a request (it prefers RequestKey); the
    documented keys are str, so the middleware's first store silences that one warning. In a process where every
    warning is an error, the first requests are answered with both values."""
    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == [{"rollout_id": "r1", "token_capture": True}] * 2
