"""Bad input, generated: rollout ids, traceparents, URL paths, server names and config documents get a typed error
or a correct answer, never another exception and never an extra path segment; raw garbage and half-open
connections on the gRPC port leave the head serving.

Example counts stay modest (the whole suite must stay fast); no example database is written.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, unquote

import grpc
import pytest
import yaml
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.config import GlobalConfig, parse_config_text
from gym_rpc.errors import ConfigError, InvalidRolloutIdError, MalformedGymPrefixError
from gym_rpc.integrations._middleware import TraceContextPathMiddleware
from gym_rpc.server._head import HeadOptions, HeadServer
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.v1 import control_plane_pb2_grpc as pb_grpc
from gym_rpc.wire import TRACEPARENT_RE, encode_rollout_id, prefixed_path, rollout_path_prefix
from gym_rpc.wire._paths import split_gym_prefixes
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port

# At least these many examples; the `fuzz` profile (tests/conftest.py) raises both for a long local run.
# Whether the examples are derandomised comes from the profile too (these settings do not override it).
PROFILE_EXAMPLES = settings().max_examples  # settings() inherits the loaded profile
FUZZ = settings(
    max_examples=max(150, PROFILE_EXAMPLES),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
FEW = settings(
    max_examples=max(80, PROFILE_EXAMPLES // 4),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
utf8_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=120)
valid_traceparents = st.from_regex(TRACEPARENT_RE, fullmatch=True)
# Segments a path is made of: Gym's own markers, dot segments, percent escapes (good and broken) and anything else.
path_segments = st.one_of(
    st.sampled_from(
        ["ng-rollout", "ng-trace", "training-token-capture", "..", ".", "", "%2F", "%2e%2e", "%", "%zz", "%C3%A9"]
    ),
    valid_traceparents,
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="/"), max_size=20),
)
paths = st.lists(path_segments, max_size=8).map(lambda segments: "/" + "/".join(segments))


# --- rollout ids ---


@FUZZ
@given(st.text(max_size=300))
@example("..")
@example("a/b?c#d")
@example("\ud800")
@example("%2F..%2F")
def test_a_rollout_id_is_one_segment_or_a_typed_error(rollout_id: str) -> None:
    try:
        encoded = encode_rollout_id(rollout_id)
    except InvalidRolloutIdError:
        return
    assert not set(encoded) & set("/?#") and encoded not in (".", "..")
    assert unquote(encoded, errors="strict") == rollout_id
    # The receiving side recovers exactly the id, and the path after it is untouched.
    path = prefixed_path("/v1/responses", "responses_api_models", rollout_id)
    assert path == rollout_path_prefix(rollout_id) + "/v1/responses"
    split = split_gym_prefixes(path)
    assert (split.rollout_id, split.rest, split.traceparent) == (rollout_id, "/v1/responses", None)


# --- traceparents and paths on the receiving side ---


def _acceptable_traceparent(candidate: str) -> bool:
    """W3C: the pattern, and neither the trace id nor the span id all zeros."""
    if not TRACEPARENT_RE.fullmatch(candidate):
        return False
    _, trace_id, span_id, _ = candidate.split("-")
    return trace_id != "0" * 32 and span_id != "0" * 16


@FUZZ
@given(st.one_of(valid_traceparents, st.text(alphabet=st.characters(exclude_characters="/"), max_size=80)))
@example(TRACEPARENT)
@example("00-" + "0" * 32 + "-00f067aa0ba902b7-01")
@example(TRACEPARENT.upper())
@example(TRACEPARENT + "\n")
def test_a_traceparent_segment_is_valid_or_refused(candidate: str) -> None:
    path = f"/ng-trace/{candidate}/v1/responses"
    try:
        split = split_gym_prefixes(path)
    except MalformedGymPrefixError:
        assert not _acceptable_traceparent(candidate)
        return
    assert _acceptable_traceparent(candidate)
    assert split.traceparent == candidate and TRACEPARENT_RE.fullmatch(candidate)
    assert split.rest == "/v1/responses"


@FUZZ
@given(paths)
@example("/ng-rollout/%2e%2e/x")
@example("/ng-rollout/a/ng-trace/" + TRACEPARENT + "/../../etc/passwd")
@example("/ng-rollout/")
def test_splitting_any_path_strips_only_its_own_prefix(path: str) -> None:
    try:
        split = split_gym_prefixes(path)
    except MalformedGymPrefixError:
        return
    if not split.stripped:
        assert split.rest == path
        return
    # What is routed is exactly what followed the prefix: nothing added, nothing decoded.
    assert split.rest == "/" or path.endswith(split.rest)
    assert split.rest.startswith("/")
    if split.rollout_id is not None:  # the id came from one segment, and maps back to one segment
        assert "/" not in encode_rollout_id(split.rollout_id)
    if split.traceparent is not None:
        assert TRACEPARENT_RE.fullmatch(split.traceparent)


class ThreadedApp:
    """An aiohttp app behind TraceContextPathMiddleware on its own loop in a thread (hypothesis tests are sync)."""

    def __init__(self) -> None:
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @staticmethod
    async def _echo(request: web.Request) -> web.Response:
        body = {"path": request.raw_path, "traceparent": request.headers.get("traceparent")}
        return web.json_response(body)

    async def _start(self) -> None:
        app = TraceContextPathMiddleware.install(web.Application())
        app.router.add_route("*", "/{tail:.*}", self._echo)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, LOOPBACK, 0).start()
        self.port = int(self._runner.addresses[0][1])

    def _serve(self) -> None:
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> ThreadedApp:
        self._thread.start()
        assert self._ready.wait(10), "the aiohttp thread did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture(scope="module")
def receiving_server() -> Iterator[ThreadedApp]:
    with ThreadedApp() as app:
        yield app


def _request_target(path: str) -> str:
    """The path as a legal HTTP request target: keep `/` and `%`, escape what HTTP forbids."""
    return quote(path, safe="/%:@!$&'()*+,;=-._~")


@FEW
@given(paths)
@example("/ng-trace/" + TRACEPARENT + "/v1/responses")
@example("/ng-rollout/r%2F1/training-token-capture/v1/responses")
@example("/ng-rollout/r1///v1/responses")  # raw_path once came back with two extra slashes
def test_a_receiving_server_answers_any_path_with_a_route_or_a_4xx(
    receiving_server: ThreadedApp, path: str
) -> None:
    target = _request_target(path)
    connection = http.client.HTTPConnection(LOOPBACK, receiving_server.port, timeout=5)
    try:
        connection.request("GET", target)
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    assert response.status in (200, 400, 404), (target, response.status, body[:200])  # never a 5xx
    if response.status == 200:
        answer = json.loads(body)
        assert answer["path"].startswith("/") and (answer["path"] == "/" or target.endswith(answer["path"]))
        if answer["traceparent"] is not None:
            assert TRACEPARENT_RE.fullmatch(answer["traceparent"])


# --- server names over a real head ---


@pytest.fixture(scope="module")
def threaded_head() -> Iterator[HeadServer]:
    """A head on its own loop in a thread, so synchronous hypothesis tests can call it."""
    doc = document(
        {
            "policy": server_entry(closed_port()),
            "agent": server_entry(
                closed_port(), "responses_api_agents", model_server={"type": "x", "name": "policy"}
            ),
        }
    )
    head = HeadServer(GlobalConfig.from_document(doc), HeadOptions(port=0, probe_interval_seconds=0.5))
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve() -> None:
        loop.run_until_complete(head.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10), "the head did not start"
    yield head
    asyncio.run_coroutine_threadsafe(head.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.fixture(scope="module")
def raw_stub(threaded_head: HeadServer) -> Iterator[pb_grpc.ControlPlaneServiceStub]:
    with grpc.insecure_channel(threaded_head.address) as channel:
        yield pb_grpc.ControlPlaneServiceStub(channel)


server_names = st.one_of(
    st.sampled_from(["policy", "agent", "head_server", "", " policy", "policy\x00"]), utf8_text
)


@FUZZ
@given(server_names)
def test_any_server_name_is_answered_ok_not_found_or_invalid(raw_stub, name: str) -> None:
    calls: list[Callable[[], object]] = [
        lambda: raw_stub.GetServerStatus(pb.GetServerStatusRequest(server_name=name), timeout=5),
        lambda: raw_stub.GetAssistantMessageHeader(
            pb.GetAssistantMessageHeaderRequest(model_server_name=name), timeout=5
        ),
    ]
    for call in calls:
        try:
            call()
        except grpc.RpcError as error:
            assert isinstance(error, grpc.Call)
            code = error.code()
            assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), (name, error)
        else:
            assert name in ("policy", "agent", "head_server")


# --- config documents ---

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), utf8_text)
json_like = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(utf8_text, st.integers(), st.none()), children, max_size=4),
    ),
    max_leaves=20,
)
server_like = st.fixed_dictionaries(
    {
        "host": st.one_of(st.sampled_from(["127.0.0.1", "::", "0.0.0.0", "", "[::1]"]), json_like),
        "port": st.one_of(st.integers(-5, 70000), json_like),
    }
).map(lambda entry: {"some_type": {"some_impl": entry}})
global_keys = st.sampled_from(
    ["head_server", "checkpoint", "observability_enabled", "http_client", "policy", "agent"]
)
documents = st.dictionaries(
    st.one_of(global_keys, utf8_text), st.one_of(json_like, server_like, st.just("${policy}")), max_size=6
)


def _load_or_refuse(document: Any) -> None:
    try:
        config = GlobalConfig.from_document(document)
    except ConfigError:
        return
    assert json.loads(config.config_json) == json.loads(json.dumps(config.document))
    for entry in config.servers.values():
        assert 0 < entry.port < 65536 and entry.url.startswith("http://")


@FUZZ
@given(documents)
@example({"head_server": {"host": "h", "port": 1, "tls": "yes"}})
@example({"head_server": {"host": "h", "port": 1, "health_port": -1}})
@example({"head_server": ["not", "a", "mapping"]})
@example({"a": {"b": {"c": {"host": "h", "port": True}}}})
def test_any_config_document_loads_or_is_a_config_error(document: dict[str, Any]) -> None:
    _load_or_refuse(document)


@FUZZ
@given(st.one_of(utf8_text, documents.map(lambda d: yaml.safe_dump(d, allow_unicode=True))))
@example("a: &x [*x]")  # a self-referencing anchor
@example("a: 2001-12-14\n")  # a date JSON cannot carry
@example("a: !!set {x, y}\n")
@example("? [1, 2]\n: x\n")
@example("- just\n- a list\n")
@example("a: ${nope}\n")
@example("\t:\n")
def test_any_config_text_parses_or_is_a_config_error(text: str) -> None:
    try:
        document = parse_config_text(text, "fuzz.yaml")
    except ConfigError as error:
        assert "fuzz.yaml" in str(error)
        return
    _load_or_refuse(document)


# --- garbage and half-open connections on the gRPC port ---


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection(LOOPBACK, port), 5.0)


async def test_garbage_and_half_open_connections_leave_the_head_serving(head_factory) -> None:
    head = await head_factory(document({}))
    client = ControlClient(head.address, timeout_seconds=2.0)
    silent = [await _connect(head.port) for _ in range(8)]  # connect, send nothing, hold
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    payloads = [
        os.urandom(4096),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        preface[:10],  # a preface cut short, then held
        preface + b"\x00\x00\x04\x08\x00\x00\x00\x00\x00" + os.urandom(64),  # a frame cut short, then junk
        preface + b"\xff" * 9 + os.urandom(1024),  # a frame header announcing a huge frame
        b"\x16\x03\x01\x02\x00" + os.urandom(512),  # a TLS ClientHello to a plaintext port
    ]
    noisy = []
    for payload in payloads:
        reader, writer = await _connect(head.port)
        writer.write(payload)
        await writer.drain()
        noisy.append((reader, writer))
    # Meanwhile every well-behaved call is answered.
    for _ in range(3):
        assert (await client.list_server_statuses()).reports == []
    # Junk that is not a cut-short preface gets the connection closed rather than held forever.
    for reader, _ in (noisy[0], noisy[1], noisy[3], noisy[4], noisy[5]):
        closed = False
        while not closed:
            chunk = await asyncio.wait_for(reader.read(65536), 5.0)
            closed = chunk == b""
    for _, writer in silent + noisy:
        writer.close()
    assert (await client.get_head_server_config()).port == head.port
