"""Exact answers that mutation testing (`make mutate`, bench/MUTATION.md) found no other test pinned down.

Each test names the mutant class it kills: a change to the code that left the rest of the suite green.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import inspect
import itertools
import logging
import random
import re
import socket
import sys
import time
import tracemalloc
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import BaseModel, ValidationError

from gym_rpc import config as config_module
from gym_rpc.client import ClientSecurity, ClientTls, ControlClient, SyncControlClient
from gym_rpc.client.control._watch import StatusWatch, SyncStatusWatch
from gym_rpc.client.data import _call_metrics as client_metrics
from gym_rpc.client.data._call_spans import ObserverPair, call_span
from gym_rpc.client.data._http import (
    Call,
    LoopSessions,
    _sessions_by_loop,
    close_loop_sessions,
    loop_sessions,
    send,
)
from gym_rpc.client.data._http_settings import HttpClientSettings
from gym_rpc.client.data._observers import observer_for
from gym_rpc.client.data._rollout import apply_rollout_prefix
from gym_rpc.client.resend._policy import RetryPolicy
from gym_rpc.client.tracing._aiohttp_instrumentation import _ATTRIBUTES_KEY, _add_attributes
from gym_rpc.config import (
    BaseServerConfig,
    GlobalConfig,
    HeadTlsConfig,
    ServerEntry,
    get_first_server_config_dict,
    load_config_file,
    parse_config_text,
    url_authority,
    validation_error_line,
)
from gym_rpc.config import _parsing as config_parsing
from gym_rpc.errors import (
    ConfigError,
    ControlPlaneError,
    GymRpcError,
    HeadUnreachableError,
    InvalidRolloutIdError,
    MalformedGymPrefixError,
    ServerUnreachableError,
)
from gym_rpc.metrics import METRICS
from gym_rpc.server._head import HeadOptions
from gym_rpc.server.fleet._prober import Changes, StatusProber, new_probe_session, probe, unsampled_traceparent
from gym_rpc.server.registry._registry import InstanceRegistry
from gym_rpc.server.security._auth import (
    ServerSecurity,
    _bearer_token,
    check_tls_files,
    head_token,
    server_options,
)
from gym_rpc.telemetry import TRACING
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import InstanceRegistration, StatusReport, WatchEvent
from gym_rpc.wire._paths import _first_segment, encode_rollout_id, rollout_path_prefix, split_gym_prefixes
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port, tcp_keepalive_options
from tests.support.prober import registered_as
from tests.support.security import make_pki
from tests.support.servers import start_dropping_server


def test_server_config_repr_redacts_only_secret_keys() -> None:
    """`__repr_args__` redacts a value when its key is secret *and* the value may be a secret: not every text."""
    config = BaseServerConfig.model_validate(
        {"host": "127.0.0.1", "port": 8000, "api_key": "sk-1", "note": "hello", "n": 5}
    )
    assert repr(config) == "BaseServerConfig(host='127.0.0.1', port=8000, api_key='<redacted>', note='hello', n=5)"


def test_client_security_repr_says_whether_a_token_and_tls_are_set() -> None:
    assert repr(ClientSecurity(token="t0ken", tls=ClientTls())) == "ClientSecurity(token=<set>, tls=True)"
    assert repr(ClientSecurity()) == "ClientSecurity(token=None, tls=False)"


def test_apply_rollout_prefix_strips_only_trailing_slashes() -> None:
    """The base URL loses its trailing '/' and nothing else, whatever characters come before it."""
    assert apply_rollout_prefix("http://gw/api/X/", "r1") == "http://gw/api/X/ng-rollout/r1"
    assert apply_rollout_prefix("http://gw/api/X//", "r1") == "http://gw/api/X/ng-rollout/r1"


@pytest.mark.parametrize("entry", [{"x": 1}, {"x": {"impl": 1}}], ids=["type-not-a-mapping", "impl-not-a-mapping"])
def test_a_misshapen_entry_is_named_in_one_exact_line(entry: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as caught:
        get_first_server_config_dict({"bad": entry}, "bad")
    assert str(caught.value) == "config entry 'bad' is not of the form {server_type: {impl: {...}}}"


RULE = "at most 256 letters, digits, dots, dashes or underscores, starting with a letter or digit"


@pytest.mark.parametrize(
    ("rollout_id", "message"),
    [
        ("", f"invalid rollout id '': {RULE}"),
        (".", f"invalid rollout id '.': {RULE}"),
        ("..", f"invalid rollout id '..': {RULE}"),
        (5, f"invalid rollout id 5: {RULE}"),
        ("x" * 257, f"invalid rollout id {'x' * 80!r} (and more): {RULE}"),
        ("\ud800", f"invalid rollout id '\\ud800': {RULE}"),
        ("r/1", f"invalid rollout id 'r/1': {RULE}"),
    ],
)
def test_a_refused_rollout_id_gets_one_exact_line(rollout_id: object, message: str) -> None:
    with pytest.raises(InvalidRolloutIdError) as caught:
        encode_rollout_id(rollout_id)  # type: ignore[arg-type]
    assert str(caught.value) == message


def test_the_longest_rollout_id_is_256_characters() -> None:
    assert encode_rollout_id("x" * 256) == "x" * 256


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/ng-trace/zz/v1", "malformed traceparent segment 'zz': expected 00-<32 hex>-<16 hex>-<2 hex>"),
        (
            f"/ng-trace/00-{'0' * 32}-{'1' * 16}-01/v1",
            f"traceparent '00-{'0' * 32}-{'1' * 16}-01' has an all-zero trace id or span id",
        ),
        (
            f"/ng-trace/00-{'1' * 32}-{'0' * 16}-01/v1",
            f"traceparent '00-{'1' * 32}-{'0' * 16}-01' has an all-zero trace id or span id",
        ),
    ],
)
def test_a_refused_traceparent_segment_gets_one_exact_line(path: str, message: str) -> None:
    with pytest.raises(MalformedGymPrefixError) as caught:
        split_gym_prefixes(path)
    assert str(caught.value) == message


def test_token_capture_is_any_truthy_flag_and_an_empty_id_has_no_prefix() -> None:
    assert rollout_path_prefix("r", 1) == "/ng-rollout/r/training-token-capture"  # type: ignore[arg-type]
    assert rollout_path_prefix("r", 0) == "/ng-rollout/r"  # type: ignore[arg-type]
    assert rollout_path_prefix("", True) == ""
    assert rollout_path_prefix(None, True) == ""


# --- data-plane resends ------------------------------------------------------------------------------------------


def test_backoff_is_exponential_capped_and_half_random() -> None:
    """RetryPolicy.backoff_seconds: after the n-th failure, a pause in [c/2, c] with c = min(max, initial *
    multiplier ** (n - 1)); both halves of that range are reached (random.seed: the same draws every run)."""
    policy = RetryPolicy(initial_backoff_seconds=0.1, multiplier=3.0, max_backoff_seconds=2.0)
    random.seed(18)
    for failed, ceiling in ((1, 0.1), (2, 0.3), (3, 0.9), (4, 2.0), (9, 2.0)):
        pauses = [policy.backoff_seconds(failed) for _ in range(200)]
        assert ceiling / 2 <= min(pauses) < ceiling * 0.55, (failed, min(pauses))
        assert ceiling * 0.95 < max(pauses) <= ceiling, (failed, max(pauses))


async def test_a_resent_request_carries_the_same_body_and_each_resend_is_counted() -> None:
    """send(): every attempt sends the caller's body again, and its observer hears the number of each attempt
    after the first (the metrics and the span's http.request.resend_count come from it)."""
    bodies: list[bytes] = []

    async def drop_then_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            body = await reader.readexactly(int(length.group(1))) if length else b""
            bodies.append(body)
            if len(bodies) == 3:  # the first two connections are dropped unanswered
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(drop_then_echo, LOOPBACK, 0)
    url = f"http://{LOOPBACK}:{server.sockets[0].getsockname()[1]}/v1/responses"
    observer = RecordingObserver()
    policy = RetryPolicy(attempts=3, initial_backoff_seconds=0.01, max_backoff_seconds=0.02)
    try:
        async with aiohttp.ClientSession() as session:
            response = await send(
                Call(session, "POST", url, {"json": {"a": 1}}, policy, resend=True, observer=observer)
            )
            async with response:
                assert await response.read() == b'{"a": 1}'
    finally:
        server.close()
        await server.wait_closed()
    assert bodies == [b'{"a": 1}'] * 3
    assert observer.told == [
        ("resent", 2, "dropped_after_write"),
        ("resent", 3, "dropped_after_write"),
        ("answered", response, 3),
    ]


class RecordingObserver:
    """A CallObserver noting what it is told, in order."""

    kind = "recording"

    def __init__(self) -> None:
        self.told: list[tuple[Any, ...]] = []

    def resent(self, attempt: int, kind: str) -> None:
        self.told.append(("resent", attempt, kind))

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None:
        self.told.append(("answered", response, attempts))

    def failed(self, error: BaseException, attempts: int) -> None:
        self.told.append(("failed", error, attempts))


async def test_send_tells_its_observer_each_resend_then_the_answer_or_error_with_the_attempts_made() -> None:
    """send(): after one dropped connection and then an answer, the observer hears resent(2) and the kind, then
    answered with the very response the caller gets and 2 attempts; for a refused port, every resend, then failed
    with the very ServerUnreachableError raised and all of the policy's attempts."""
    policy = RetryPolicy(attempts=3, initial_backoff_seconds=0.01, max_backoff_seconds=0.02)
    server, port, connections = await start_dropping_server(drops=1)
    answered = RecordingObserver()
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://{LOOPBACK}:{port}/v1/responses"
            async with await send(
                Call(session, "POST", url, {"data": b"{}"}, policy, resend=True, observer=answered)
            ) as response:
                assert response.status == 200
            assert answered.told == [("resent", 2, "dropped_after_write"), ("answered", response, 2)]
            assert connections == [2]

            failed = RecordingObserver()
            refused = f"http://{LOOPBACK}:{closed_port()}/v1/responses"
            with pytest.raises(ServerUnreachableError) as caught:
                await send(Call(session, "POST", refused, {"data": b"{}"}, policy, resend=True, observer=failed))
    finally:
        server.close()
        await server.wait_closed()
    assert failed.told == [("resent", 2, "refused"), ("resent", 3, "refused"), ("failed", caught.value, 3)]
    assert str(caught.value).startswith(f"POST {refused}: refused or unreachable, given up after 3 attempt(s) in ")


async def test_a_refused_server_is_named_with_the_operating_systems_reason() -> None:
    """ServerUnreachableError carries the OS error's text, not the wrapper's, after what ran out, and the server's
    name where send was given it."""
    port = closed_port()
    url = f"http://{LOOPBACK}:{port}/x"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ServerUnreachableError) as caught:
            await send(Call(session, "GET", url, {}, RetryPolicy(attempts=1), server="model", resend=True))
    assert re.fullmatch(
        re.escape(f"GET {url} (server 'model'): refused or unreachable, given up after 1 attempt(s) in ")
        + r"\d+\.\d s "
        + re.escape(
            f"(its refused budget's attempts ran out): [Errno 111] Connect call failed ('{LOOPBACK}', {port}); "
            "check that it runs and that its host and port in the global config are right"
        ),
        str(caught.value),
    )
    assert (caught.value.kind, caught.value.limit, caught.value.server_name) == ("refused", "attempts", "model")


async def test_closing_a_loops_sessions_forgets_them_and_is_harmless_twice() -> None:
    """close_loop_sessions: nothing opened is nothing to close; closing one settings' sessions keeps the others
    and the loop's entry; the last one removes the loop's entry."""
    loop = asyncio.get_running_loop()
    first, second = HttpClientSettings(), HttpClientSettings(max_connections=5)
    await close_loop_sessions(first)  # no session of this loop yet
    first_sessions, second_sessions = loop_sessions(first), loop_sessions(second)
    await close_loop_sessions(first)
    assert first_sessions.is_closed and not second_sessions.is_closed
    assert list(_sessions_by_loop[loop]) == [second]
    await close_loop_sessions(first)  # already closed
    await close_loop_sessions(second)
    assert loop not in _sessions_by_loop


# --- the bounded YAML loader -------------------------------------------------------------------------------------


@pytest.fixture
def small_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's bounds lowered (read from the module at each check), so their exact edges are cheap to hit."""
    monkeypatch.setattr(config_parsing, "MAX_CONFIG_VALUES", 9)
    monkeypatch.setattr(config_parsing, "MAX_CONFIG_DEPTH", 3)
    monkeypatch.setattr(config_parsing, "MAX_CONFIG_BYTES", 64)


VALUES_OVER = "refusing a config of more than 9 values (with its YAML aliases expanded)"


@pytest.mark.usefixtures("small_bounds")
def test_the_value_bound_counts_every_node_with_aliases_expanded() -> None:
    """Every node counts one, an alias the size of what it names: `a: &l [1, 2]` + `b: *l` is 1 (the mapping) +
    1 + 3 + 1 + 3 = 9 values, the bound: accepted. One value more is refused, naming where the count ran over."""
    assert parse_config_text("a: &l [1, 2]\nb: *l\n") == {"a": [1, 2], "b": [1, 2]}
    assert parse_config_text("a: [1, 2]\nb: [3, 4]\n") == {"a": [1, 2], "b": [3, 4]}
    for text, where in (("a: &l [1, 2, 3]\nb: *l\n", "v.yaml:2:4"), ("a: &l [1, 2]\nb: *l\nc: 1\n", "v.yaml:3:4")):
        with pytest.raises(ConfigError) as caught:
            parse_config_text(text, "v.yaml")
        assert str(caught.value) == f"{where}: {VALUES_OVER}"


@pytest.mark.usefixtures("small_bounds")
def test_the_depth_bound_is_exact_and_names_the_line() -> None:
    assert parse_config_text("a: {b: 1}\n") == {"a": {"b": 1}}  # three levels: the document, a, b
    with pytest.raises(ConfigError) as caught:
        parse_config_text("a:\n  b: {c: 1}\n", "d.yaml")
    assert str(caught.value) == "d.yaml:2:7: refusing a config nested more than 3 levels deep"


@pytest.mark.usefixtures("small_bounds")
def test_the_size_bound_is_exact_for_text_and_files(tmp_path: Path) -> None:
    exactly = "a: " + "x" * 60 + "\n"
    assert len(exactly) == 64 and parse_config_text(exactly) == {"a": "x" * 60}
    with pytest.raises(ConfigError) as caught:
        parse_config_text(exactly + " ", "t.yaml")
    assert str(caught.value) == "t.yaml: refusing a config larger than 0 MiB"
    path = tmp_path / "f.yaml"
    path.write_text(exactly, encoding="utf-8")
    assert load_config_file(path).document == {"a": "x" * 60}
    path.write_text(exactly + "#", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config_file(path)
    assert str(caught.value) == f"{path}: refusing a config larger than 0 MiB"


def test_a_file_over_16_mib_is_refused_after_reading_only_its_first_16_mib(tmp_path: Path) -> None:
    """load_config_file reads at most 16 MiB + 1 byte: a 256 MiB (sparse) file is refused without reading it."""
    path = tmp_path / "huge.yaml"
    with path.open("wb") as file:
        file.truncate(256 * 1024 * 1024)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as caught:
            load_config_file(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(caught.value) == f"{path}: refusing a config larger than 16 MiB"
    assert peak < 64 * 1024 * 1024, peak


def test_a_file_that_is_not_utf8_is_named_with_its_line_and_byte(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"\n# caf\xe9\nkey: 1\n")
    with pytest.raises(ConfigError) as caught:
        load_config_file(path)
    assert str(caught.value) == f"{path}:2: not UTF-8 text (byte 0xe9 at offset 6); save the file as UTF-8"


def test_a_missing_file_is_named_with_the_systems_reason(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config_file(path)
    assert str(caught.value) == f"cannot read config file {path}: No such file or directory"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: [1\n", "y.yaml:2:1: invalid YAML: expected ',' or ']', but got '<stream end>'"),
        ("a: *nowhere\n", "y.yaml:1:4: invalid YAML: found undefined alias 'nowhere'"),
        ("a: 1\n---\nb: 2\n", "y.yaml:2:1: invalid YAML: but found another document"),
        (
            "\nb: \x07\n",
            "y.yaml:2: invalid YAML: unacceptable character #x0007: special characters are not allowed",
        ),
        (
            "a: \x07\n\n\nb: 1\n",
            "y.yaml:1: invalid YAML: unacceptable character #x0007: special characters are not allowed",
        ),
        (
            "a: !!python/object:os.system x\n",
            "y.yaml:1:4: invalid YAML: could not determine a constructor for the tag "
            "'tag:yaml.org,2002:python/object:os.system'",
        ),
    ],
)
def test_invalid_yaml_is_one_line_naming_line_column_and_problem(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config_text(text, "y.yaml")
    assert str(caught.value) == message


def test_a_document_too_deep_for_pythons_stack_is_one_line() -> None:
    """parse_config_text: an embedding program's small recursion limit gives one line, not a RecursionError."""
    depth = len(inspect.stack(0))
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 60)
    try:
        with pytest.raises(ConfigError) as caught:
            parse_config_text("a: " + "[" * 90 + "]" * 90 + "\n", "r.yaml")
    finally:
        sys.setrecursionlimit(limit)
    assert str(caught.value) == "r.yaml: config nested too deeply to parse"


def test_duplicate_keys_are_refused_after_merge_keys_too() -> None:
    """Merge keys (`<<`) are not duplicates of each other, and a duplicate after one is still found."""
    base = "base: &b {x: 1}\nmore: &m {y: 2}\n"
    assert parse_config_text(base + "c:\n  <<: *b\n  <<: *m\n")["c"] == {"x": 1, "y": 2}
    with pytest.raises(ConfigError) as caught:
        parse_config_text(base + "c:\n  <<: *b\n  z: 1\n  z: 2\n", "m.yaml")
    assert str(caught.value) == "m.yaml:6:3: duplicate key 'z'"


# --- pydantic errors, harness headers, unresolved servers --------------------------------------------------------


class _Three(BaseModel):
    a: int
    b: int
    c: int


@pytest.mark.parametrize(
    ("given", "line"),
    [
        ({}, "blk.a: Field required (and 2 more problems)"),
        ({"c": 1}, "blk.a: Field required (and 1 more problem)"),
        ({"b": 1, "c": 1}, "blk.a: Field required"),
        (
            {"a": "x", "b": 1, "c": 1},
            "blk.a: Input should be a valid integer, unable to parse string as an integer",
        ),
    ],
)
def test_validation_errors_are_one_line_counting_the_others(given: dict[str, object], line: str) -> None:
    with pytest.raises(ValidationError) as caught:
        _Three.model_validate(given)
    assert validation_error_line(caught.value, "blk") == line


def test_a_harness_package_without_a_header_declares_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """_declared_header: a harness package that defines no ASSISTANT_MESSAGE_HEADER declares no header; one that
    defines something other than text or bytes is one exact line naming the server."""
    (tmp_path / "plain_harness.py").write_text("NAME = 'x'\n", encoding="utf-8")
    (tmp_path / "odd_harness.py").write_text("ASSISTANT_MESSAGE_HEADER = 42\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))

    def agent(package: str) -> dict[str, object]:
        entry = server_entry(8100, "responses_api_agents", harness_package=package)
        next(iter(entry["responses_api_agents"].values()))["model_server"] = {"name": "policy"}
        return entry

    plain = GlobalConfig.from_document(document({"policy": server_entry(8000), "agent": agent("plain_harness")}))
    assert plain.assistant_message_header("policy") is None
    odd = GlobalConfig.from_document(document({"policy": server_entry(8000), "agent": agent("odd_harness")}))
    with pytest.raises(ConfigError) as caught:
        odd.assistant_message_header("policy")
    assert str(caught.value) == "server 'agent': assistant_message_header must be text or bytes"


def test_a_server_whose_address_cannot_be_resolved_is_named_when_called() -> None:
    """GlobalConfig.raise_unusable: only the server that cannot be resolved raises, with one exact line."""
    config = GlobalConfig.from_document(
        document({"good": server_entry(8000), "bad": server_entry(8001, host="${oc.env:H18_UNSET_HOST}")}),
        lenient=True,
    )
    config.raise_unusable("good")
    for call in (config.raise_unusable, config.server):
        with pytest.raises(ConfigError) as caught:
            call("bad")
        assert str(caught.value).startswith("server 'bad' cannot be called: cannot resolve ")
        assert "H18_UNSET_HOST" in str(caught.value)


# --- the head's token check --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "token"),
    [
        ((("authorization", "Bearer t0k"),), "t0k"),
        ((("authorization", b"Bearer t0k"),), "t0k"),  # a bytes value is decoded, not shown as b'...'
        ((("authorization", "  bearer   t0k  "),), "t0k"),
        ((("authorization", "Basic t0k"),), None),
        ((("authorization", b"Bearer t\xffk"),), "t\ufffdk"),  # undecodable bytes are replaced, never raised
        ((("authorization", "Bearer a b"),), "a b"),
        ((("x-other", "Bearer t0k"), ("authorization", "Bearer 2nd")), "2nd"),
        ((), None),
    ],
)
def test_the_bearer_token_is_read_from_the_first_authorization_entry(metadata: object, token: str | None) -> None:
    assert _bearer_token(metadata) == token


async def test_a_refused_call_is_logged_naming_the_method_only(head_factory, caplog) -> None:
    caplog.set_level(logging.INFO, logger="gym_rpc.server._security")
    head = await head_factory(document({}, head_server={"host": LOOPBACK, "port": 0, "auth_token": "s3cret-t0k"}))
    with pytest.raises(ControlPlaneError):
        await ControlClient(head.address, security=ClientSecurity(token="wrong")).list_server_statuses()
    refused = [r.getMessage() for r in caplog.records if r.name == "gym_rpc.server._security"]
    assert refused == [
        "refused /gym_rpc.v1.ControlPlaneService/ListServerStatuses: missing or invalid bearer token"
    ]


# --- the watch history -------------------------------------------------------------------------------------------


async def test_changes_since_is_exactly_what_a_watcher_missed() -> None:
    """StatusProber.changes_since: nothing at (or past) the current revision; the latest report per server of
    every change after the given revision; a compacted snapshot once that revision is older than the history."""
    config = GlobalConfig.from_document(document({"a": server_entry(1001), "b": server_entry(1002)}))
    told: list[tuple[StatusReport | None, str]] = []

    async def on_change(report: StatusReport | None, name: str) -> None:
        told.append((report, name))

    prober = StatusProber(config.servers, history_size=3, on_change=on_change)
    await prober.set_servers(config.servers)  # two changes: a and b appear, unprobed
    start = prober.revision
    assert prober.changes_since(start) == Changes(start, [], compacted=False)
    assert prober.changes_since(start + 5) == Changes(start, [], compacted=False)

    a_is = functools.partial(registered_as, config.servers["a"])
    await prober.set_instances("a", a_is("registered", "http://10.0.0.1:1001"))
    await prober.set_instances("a", a_is("registered", "http://10.0.0.1:1001"))  # no change: nothing recorded
    assert prober.revision == start + 1
    a_registered = prober.report("a")
    assert (a_registered.registration, a_registered.advertised_url) == ("registered", "http://10.0.0.1:1001")
    assert prober.changes_since(start) == Changes(start + 1, [a_registered], compacted=False)

    await prober.set_instances("b", registered_as(config.servers["b"], "expired"))
    await prober.set_instances("a", a_is("deregistered"))
    latest = prober.reports()
    assert [(r.server_name, r.registration) for r in latest] == [("a", "deregistered"), ("b", "expired")]
    # The history holds the last three changes (start+1 .. start+3): a watcher at `start` missed nothing older.
    assert prober.changes_since(start) == Changes(start + 3, [latest[0], latest[1]], compacted=False)
    assert prober.changes_since(start + 2) == Changes(start + 3, [latest[0]], compacted=False)
    assert prober.changes_since(start - 1) == Changes(start + 3, latest, compacted=True)
    await prober.set_instances("gone", a_is("registered", "http://x"))  # not a server of the config: ignored
    assert prober.revision == start + 3
    assert told[-3:] == [(a_registered, "a"), (latest[1], "b"), (latest[0], "a")]  # health follows each change


async def test_a_caller_that_outwaits_its_deadline_gets_an_exact_timeout_report(silent_server: int) -> None:
    """StatusProber.probe_now: joined to a longer probe in flight, a caller gets TIMEOUT after its own deadline,
    with the server's name and URL; with no probe in flight its own probe is bounded by its deadline."""
    config = GlobalConfig.from_document(document({"s": server_entry(silent_server)}))
    url = f"http://{LOOPBACK}:{silent_server}"
    prober = StatusProber(config.servers, interval_seconds=3600, probe_timeout_seconds=30)
    await prober.start()  # the first round's probe waits up to 30 s on the silent server
    try:
        before = time.time()
        report = await prober.probe_now("s", 0.2)
        assert (report.server_name, report.status, report.url, report.detail) == (
            "s",
            "timeout",
            url,
            "no answer within 0.2s",
        )
        assert 0.2 <= report.latency_seconds < 30 and before <= report.checked_at <= time.time()
    finally:
        await prober.stop()
    prober = StatusProber(config.servers, interval_seconds=3600, probe_timeout_seconds=0.1)
    await prober.start()
    try:
        if prober.report("s").status is None:  # the first round's result comes within its 0.1 s
            assert await prober.wait_for_change(prober.revision, 10)
        report = await prober.probe_now("s", 0.3)  # nothing in flight: a probe of its own, bounded by 0.3 s
        assert (report.status, report.detail) == ("timeout", "no answer within 0.3s")
    finally:
        await prober.stop()


@pytest.mark.parametrize(
    ("security", "banner"),
    [
        (ServerSecurity(), "plaintext, no token"),
        (ServerSecurity(token="t"), "plaintext, token required"),
        (ServerSecurity(tls=HeadTlsConfig(cert_file="c", key_file="k")), "TLS, no token"),
        (
            ServerSecurity(tls=HeadTlsConfig(cert_file="c", key_file="k", client_ca_file="ca"), token="t"),
            "mutual TLS, token required",
        ),
    ],
)
def test_the_banner_says_what_guards_the_port(security: ServerSecurity, banner: str) -> None:
    assert security.describe() == banner


async def test_the_health_port_has_the_main_ports_bounds(head_factory) -> None:
    """build_health_server: the plaintext health port has the main port's bounds (4 MiB requests, no sharing)."""
    head = await head_factory(document({}, head_server={"host": LOOPBACK, "port": 0, "health_port": 0}))
    async with grpc.aio.insecure_channel(f"{LOOPBACK}:{head.health_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert (
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        ).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Check(health_pb2.HealthCheckRequest(service="x" * (5 * 1024 * 1024)), timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with socket.socket() as intruder:  # SO_REUSEPORT off, as on the main port: no second process shares it
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        with pytest.raises(OSError, match="Address already in use"):
            intruder.bind((LOOPBACK, head.health_port))


# --- URL prefixes ------------------------------------------------------------------------------------------------


def test_an_unhashable_rollout_id_is_named_in_the_typed_error() -> None:
    with pytest.raises(InvalidRolloutIdError) as caught:
        rollout_path_prefix(["r"])  # type: ignore[arg-type]
    assert str(caught.value) == f"invalid rollout id ['r']: {RULE}"


@pytest.mark.parametrize(
    ("path", "split"),
    [("", ("", "")), ("/a", ("a", "")), ("/a/b/c", ("a", "/b/c")), ("//x", ("", "/x")), ("/ab/", ("ab", "/"))],
)
def test_the_first_segment_and_the_rest_keep_the_rests_slash(path: str, split: tuple[str, str]) -> None:
    assert _first_segment(path) == split


def test_a_long_malformed_traceparent_is_quoted_to_80_characters() -> None:
    segment = "z" * 100
    with pytest.raises(MalformedGymPrefixError) as caught:
        split_gym_prefixes(f"/ng-trace/{segment}/v1")
    assert (
        str(caught.value) == f"malformed traceparent segment {'z' * 80!r}: expected 00-<32 hex>-<16 hex>-<2 hex>"
    )


# --- the data-plane sessions -------------------------------------------------------------------------------------

POOLS = HttpClientSettings(
    max_connections=7,
    max_connections_per_host=3,
    control_max_connections=5,
    keepalive_timeout_seconds=4.5,
    connect_timeout_seconds=2.5,
    total_timeout_seconds=60.0,
    control_total_timeout_seconds=9.0,
)


async def test_the_data_and_control_sessions_are_built_from_the_settings() -> None:
    """LoopSessions: each setting reaches the pool it names; no proxies from the environment, no cookies."""
    sessions = LoopSessions(POOLS)
    try:
        assert sessions.loop is asyncio.get_running_loop() and sessions.is_closed is False
        for session, limit, per_host, total in ((sessions.data, 7, 3, 60.0), (sessions.control, 5, 0, 9.0)):
            connector = session.connector
            assert isinstance(connector, aiohttp.TCPConnector)
            assert (connector.limit, connector.limit_per_host, connector._keepalive_timeout) == (
                limit,
                per_host,
                4.5,
            )
            assert session.timeout == aiohttp.ClientTimeout(total=total, sock_connect=2.5)
            assert session.trust_env is False and isinstance(session.cookie_jar, aiohttp.DummyCookieJar)
    finally:
        await sessions.close()
    assert sessions.is_closed is True and sessions.data.closed and sessions.control.closed


async def test_pooled_connections_use_tcp_keepalive(http_server) -> None:
    """_keepalive_socket: a connection of the data pool has keepalive on, idle 60 s, every 10 s, 3 probes."""
    done = asyncio.Event()

    async def streaming(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first")
        await done.wait()  # the connection stays checked out while the test looks at its socket
        return response

    app = web.Application()
    app.router.add_get("/", streaming)
    port = await http_server(app)
    sessions = LoopSessions(POOLS)
    try:
        async with sessions.data.get(f"http://{LOOPBACK}:{port}/") as response:
            assert response.connection is not None and response.connection.transport is not None
            sock = response.connection.transport.get_extra_info("socket")
            options = tcp_keepalive_options(sock)
            done.set()
    finally:
        done.set()
        await sessions.close()
    assert options == [1, 60, 10, 3]  # NeMo Gym's global_aiohttp_tcp_keepalive_* defaults


async def test_one_loop_gets_the_same_sessions_until_they_are_closed() -> None:
    first = loop_sessions(POOLS)
    try:
        assert loop_sessions(POOLS) is first
    finally:
        await close_loop_sessions(POOLS)
    second = loop_sessions(POOLS)
    try:
        assert second is not first and not second.is_closed
    finally:
        await close_loop_sessions(POOLS)


def sessions_made_while_instrumented() -> LoopSessions:
    """Sessions made while opentelemetry-instrumentation-aiohttp-client is on (and off again at once)."""
    from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor

    instrumentor = AioHttpClientInstrumentor()
    instrumentor.instrument()
    try:
        return LoopSessions(POOLS)
    finally:
        instrumentor.uninstrument()


async def test_sessions_carry_our_trace_config_while_aiohttps_instrumentation_is_on() -> None:
    """_new_session: with opentelemetry-instrumentation-aiohttp-client active, every new session gets the
    TraceConfig that adds gym_rpc's attributes to the instrumentation's spans; without it, none."""

    def ours(session: aiohttp.ClientSession) -> bool:
        return any(_add_attributes in config.on_request_headers_sent for config in session.trace_configs)

    plain = LoopSessions(POOLS)
    traced = sessions_made_while_instrumented()
    try:
        assert not ours(plain.data) and ours(traced.data) and ours(traced.control)
    finally:
        await plain.close()
        await traced.close()


async def test_a_call_on_an_instrumented_session_tells_the_other_observer_everything() -> None:
    """A traced call on a session aiohttp's instrumentation traces: the call's attributes (the resend count among
    them) go to the instrumentation's span through `trace_request_ctx`, and the other observer (the worker
    metrics', first in the pair `observer_for` makes) hears each resend and the answer as from any traced call."""
    server, port, connections = await start_dropping_server(drops=1)
    base = f"http://{LOOPBACK}:{port}"
    policy = RetryPolicy(attempts=2, initial_backoff_seconds=0.01, max_backoff_seconds=0.02)
    observer = RecordingObserver()
    traced = sessions_made_while_instrumented()
    kwargs: Any = {"data": b"{}"}
    try:
        call = Call(traced.data, "POST", f"{base}/v1/x", kwargs, policy, server="srv")
        span = call_span(call, base)
        assert span is not None
        response = await send(
            Call(
                traced.data, "POST", call.url, kwargs, policy, server="srv", observer=ObserverPair(observer, span)
            )
        )
        async with response:
            assert response.status == 200
    finally:
        await traced.close()
        server.close()
        await server.wait_closed()
    assert (observer.told, connections) == (
        [("resent", 2, "dropped_after_write"), ("answered", response, 2)],
        [2],
    )
    assert kwargs["trace_request_ctx"][_ATTRIBUTES_KEY] == {
        "gym.server.name": "srv",
        "http.request.resend_count": 1,
    }


# --- probes ------------------------------------------------------------------------------------------------------


async def test_a_probe_reports_exactly_what_it_got(http_server, silent_server: int) -> None:
    """probe(): any HTTP answer is success with its status code and no detail; a refused connection says why,
    with no HTTP status; a silent server is a timeout naming the deadline."""
    answering, refused = await http_server(), closed_port()
    async with new_probe_session() as session:
        ok = await probe(session, "ok", f"http://{LOOPBACK}:{answering}", 5)
        down = await probe(session, "down", f"http://{LOOPBACK}:{refused}", 5)
        mute = await probe(session, "mute", f"http://{LOOPBACK}:{silent_server}", 0.2)
    assert (ok.status, ok.http_status, ok.detail) == ("success", 200, "")
    assert (down.status, down.http_status, down.detail) == (
        "connection_error",
        0,
        f"[Errno 111] Connect call failed ('{LOOPBACK}', {refused})",
    )
    assert (mute.status, mute.http_status, mute.detail) == ("timeout", 0, "no answer within 0.2s")
    assert 0 <= mute.latency_seconds < 1.0  # the deadline is the probe's own 0.2 s, not a floor above it


def test_probe_traceparents_are_unsampled_and_random() -> None:
    """unsampled_traceparent: W3C version 00, a random 128-bit trace id and 64-bit span id, sampled flag off."""
    seen = {unsampled_traceparent() for _ in range(200)}
    assert len(seen) == 200
    assert all(re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-00", header) for header in seen)
    assert len({header[3:35] for header in seen}) == 200 and len({header[36:52] for header in seen}) == 200


async def test_wait_for_change_is_true_on_a_change_and_false_after_its_timeout() -> None:
    config = GlobalConfig.from_document(document({"a": server_entry(1001)}))
    prober = StatusProber({})
    revision = prober.revision
    assert await prober.wait_for_change(revision, 0.05) is False

    async def change_soon() -> None:
        await asyncio.sleep(0.05)
        await prober.set_servers(config.servers)

    changing = asyncio.create_task(change_soon())
    assert await prober.wait_for_change(revision, 0.9) is True  # under a second left is still worth waiting
    await changing
    assert await prober.wait_for_change(revision, 0) is True  # already past it: no wait at all


def test_a_server_entrys_repr_redacts_its_config_only() -> None:
    """ServerEntry.__repr_args__: the config block is redacted; name, host and URL are shown as they are, even
    when they look like a secret-named pair."""
    entry = ServerEntry(
        name="token=abc",
        server_type="t",
        impl_name="i",
        host="h",
        port=1,
        url="http://h:1",
        config={"api_key": "sk-1"},
    )
    assert repr(entry) == (
        "ServerEntry(name='token=abc', server_type='t', impl_name='i', host='h', port=1, url='http://h:1', "
        "config={'api_key': '<redacted>'})"
    )


# --- the watch client --------------------------------------------------------------------------------------------

WatchFactory = Callable[..., Awaitable[list[WatchEvent]]]


async def _sync_events(address: str, count: int, **options: Any) -> list[WatchEvent]:
    """Up to `count` events of a SyncStatusWatch (in a thread); the error that ended it propagates."""

    def read() -> list[WatchEvent]:
        return list(itertools.islice(SyncStatusWatch(SyncControlClient(address), **options), count))

    return await asyncio.wait_for(asyncio.to_thread(read), 30)  # a hang guard, far past every bound used


async def _async_events(address: str, count: int, **options: Any) -> list[WatchEvent]:
    async def read() -> list[WatchEvent]:
        events: list[WatchEvent] = []
        async for event in StatusWatch(ControlClient(address), **options):
            events.append(event)
            if len(events) == count:
                break
        return events

    return await asyncio.wait_for(read(), 30)


FLAVOURS = pytest.mark.parametrize("events_of", [_sync_events, _async_events], ids=["sync", "async"])


@FLAVOURS
async def test_a_watch_from_the_current_revision_resumes_with_heartbeats(
    head_factory, events_of: WatchFactory
) -> None:
    """StatusWatch/SyncStatusWatch pass start_revision and heartbeat_seconds on: from the head's current revision
    the first events are heartbeats (nothing was missed), every 0.2 s; from the default the first is a plain
    (not compacted) snapshot."""
    head = await head_factory(document({"gone": server_entry(closed_port())}), probe_interval_seconds=3600)
    revision = (await ControlClient(head.address).list_server_statuses()).revision
    started = time.monotonic()
    resumed = await events_of(head.address, 2, start_revision=revision, heartbeat_seconds=0.2)
    assert [(event.kind, event.revision) for event in resumed] == [("heartbeat", revision)] * 2
    assert time.monotonic() - started < 4.0  # two at 0.2 s, where the head's default of 5 s would take 10 s
    fresh = await events_of(head.address, 1, heartbeat_seconds=0.2)
    assert (fresh[0].kind, fresh[0].compacted, fresh[0].revision) == ("snapshot", False, revision)


@FLAVOURS
async def test_a_watch_ends_at_until_connected_or_not(head_factory, events_of: WatchFactory) -> None:
    """`until`: a connected stream gets the time left as its deadline (DEADLINE_EXCEEDED, not retried)."""
    head = await head_factory(document({"gone": server_entry(closed_port())}), probe_interval_seconds=3600)
    with pytest.raises(ControlPlaneError) as ended:
        await events_of(head.address, 1000, heartbeat_seconds=0.1, until=time.monotonic() + 0.5)
    assert ended.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_a_watch_gives_up_at_until_while_the_head_is_unreachable() -> None:
    address = f"{LOOPBACK}:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(HeadUnreachableError):
        await _sync_events(address, 1, until=started + 0.5)
    assert time.monotonic() - started >= 0.45  # it waited for the head until then


async def test_the_view_follows_changes_and_a_fresh_snapshot_replaces_it(head_factory, http_server) -> None:
    """_apply: a change updates its servers and keeps the others; a snapshot (here after a reload removed a
    server) replaces the whole view; the revision is the last event's."""
    up, down = await http_server(), closed_port()
    head = await head_factory(document({"up": server_entry(up), "down": server_entry(down)}))
    watch = StatusWatch(ControlClient(head.address), heartbeat_seconds=60)
    events = watch.__aiter__()
    async with asyncio.timeout(30):
        while {name: report.status for name, report in watch.reports.items()} != {
            "up": "success",
            "down": "connection_error",
        }:
            await anext(events)
        assert head.config_path is not None
        head.config_path.write_text(
            yaml.safe_dump(document({"up": server_entry(up)}), sort_keys=False), encoding="utf-8"
        )
        assert await head.reload() is True
        event = await anext(events)
        while event.kind != "snapshot":
            event = await anext(events)
    assert set(watch.reports) == {"up"} and watch.revision == event.revision
    await events.aclose()  # type: ignore[attr-defined]  # an async generator


async def test_reconnect_pauses_back_off_from_the_first_after_every_event_and_stop_at_max_wait(
    head_factory,
) -> None:
    """_pause_after: the n-th failure in a row pauses backoff(n) (an event resets n), capped so that the pauses of
    one outage end at max_wait_seconds, when the last error is raised."""
    head = await head_factory(document({}), probe_interval_seconds=3600)
    pauses: list[float] = []
    policy = RetryPolicy(initial_backoff_seconds=0.1, multiplier=10.0, max_backoff_seconds=5.0)
    client = SyncControlClient(head.address)

    def read() -> list[WatchEvent]:
        watch = SyncStatusWatch(
            client,
            heartbeat_seconds=0.1,
            max_wait_seconds=3.0,
            retry=policy,
            on_retry=lambda _, p: pauses.append(p),
        )
        seen = []
        for event in watch:
            seen.append(event)
            if len(seen) == 2:
                asyncio.run_coroutine_threadsafe(head.stop(), loop).result(30)
        return seen

    loop = asyncio.get_running_loop()
    with pytest.raises(HeadUnreachableError):
        await asyncio.wait_for(asyncio.to_thread(read), 30)
    assert len(pauses) >= 3, pauses
    assert 0.05 <= pauses[0] <= 0.1 and 0.5 <= pauses[1] <= 1.0, pauses  # backoff(1), backoff(2)
    assert sum(pauses) <= 3.0, pauses  # the last pause ends where max_wait_seconds does


# Config checks whose exact lines only the CLI's subprocess tests pinned (outside `make mutate`'s selection).


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "the x must be a positive number of seconds, not True"),
        ("1", "the x must be a positive number of seconds, not '1'"),
        (float("nan"), "the x must be a positive number of seconds, not nan"),
        (float("inf"), "the x must be a positive number of seconds, not inf"),
        (0, "the x must be a positive number of seconds, not 0"),
        (-1.5, "the x must be a positive number of seconds, not -1.5"),
        (0.04, "the x must be at least 0.05 seconds, not 0.04"),
    ],
)
def test_a_refused_duration_gets_one_exact_line(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config_module.checked_seconds(value, "the x", 0.05)  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_a_duration_equal_to_its_minimum_is_accepted_and_the_probe_interval_has_one() -> None:
    assert config_module.checked_seconds(0.05, "the x", 0.05) == 0.05
    assert config_module.checked_seconds(3, "the x") == 3.0
    with pytest.raises(ConfigError) as refused:
        config_module.checked_probe_interval(0.01)
    assert str(refused.value) == "the probe interval (--probe-interval) must be at least 0.05 seconds, not 0.01"


@pytest.mark.parametrize("value", [True, "80", 65536, -1])
def test_a_refused_port_gets_one_exact_line(value: object) -> None:
    with pytest.raises(ConfigError) as refused:
        config_module.checked_port(value, "the port")  # type: ignore[arg-type]
    assert str(refused.value) == f"the port must be in 0..65535 (0 picks a free port), not {value!r}"


def test_every_port_from_0_to_65535_is_accepted() -> None:
    assert [config_module.checked_port(port, "the port") for port in (0, 1, 65535, None)] == [0, 1, 65535, None]


def test_only_the_zone_separator_of_an_ipv6_literal_is_escaped_in_a_base_url() -> None:
    assert config_module.base_url("fe80::1%eth0", 80) == "http://[fe80::1%25eth0]:80"
    assert config_module.base_url("fe80::1%25eth0", 80) == "http://[fe80::1%25eth0]:80"  # already escaped
    assert config_module.base_url("fe80::1%a%b", 80) == "http://[fe80::1%25a%b]:80"
    assert config_module.base_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"


def test_wildcard_hosts_are_exactly_the_bind_everything_addresses() -> None:
    wildcards = ["", " 0.0.0.0 ", "::", "[::]", "*"]
    assert [config_module.is_wildcard_host(host) for host in wildcards] == [True] * 5
    assert [config_module.is_wildcard_host(host) for host in ("127.0.0.1", "::1", "localhost")] == [False] * 3


def test_a_document_that_is_no_mapping_or_no_json_or_unresolvable_gets_one_exact_line() -> None:
    circular: dict[str, object] = {}
    circular["self"] = circular
    refusals = {
        "a global config must be a mapping, not list": [1],
        "config is not representable as JSON: Circular reference detected": circular,
        "cannot resolve config interpolations: Interpolation key 'nope' not found": {"a": "${nope}"},
        # JSON with `default=str` takes a date; OmegaConf, which resolves the interpolation, does not
        "cannot resolve config interpolations: Value 'date' is not a supported primitive type": {
            "d": datetime.date(2024, 1, 2),
            "x": "${y}",
        },
    }
    for message, refused_document in refusals.items():
        with pytest.raises(ConfigError) as refused:
            GlobalConfig.from_document(refused_document)  # type: ignore[arg-type]
        assert str(refused.value).splitlines()[0] == message


def test_a_key_with_two_server_types_is_malformed_with_one_exact_reason() -> None:
    two_types = {"t1": {"i": {"host": "h", "port": 1}}, "t2": {"i": {"host": "h", "port": 2}}}
    loaded = GlobalConfig.from_document({"a": two_types})
    assert loaded.servers == {}
    assert loaded.malformed_servers == {"a": "it has 2 server types (t1, t2); one server name holds one type"}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (42, "the head must be a mapping or an object with host and port (such as a BaseServerConfig), not int"),
        ({"port": 1}, "the head has no host: a server config needs host and port"),
        ({}, "the head has no host and no port: a server config needs host and port"),
        ({"host": "h", "port": "x"}, "the head: 1 validation error for BaseServerConfig"),
    ],
)
def test_a_server_config_of_no_usable_shape_is_named(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config_module.as_server_config(value, "the head")  # type: ignore[arg-type]
    assert str(refused.value).splitlines()[0] == message


def test_an_unreadable_file_is_named_with_the_systems_reason_only(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        config_module.read_file_bytes(str(tmp_path / "ca.pem"), "the CA file")
    assert str(refused.value) == f"cannot read the CA file {tmp_path / 'ca.pem'}: No such file or directory"


def test_a_lenient_document_keeps_what_it_cannot_resolve_as_written_and_says_why() -> None:
    server = {"t": {"i": {"host": "${nope}", "port": 1}}}
    loaded = GlobalConfig.from_document({"a": [1, "${nope}"], "n": "${a.0}", "s": server}, lenient=True)
    assert loaded.document == {"a": [1, "${nope}"], "n": 1, "s": server}
    assert loaded.unresolved_servers == {"s": "s.t.i.host = '${nope}' (Interpolation key 'nope' not found)"}


def test_a_lenient_document_that_is_no_mapping_or_no_json_gets_one_exact_line() -> None:
    circular: dict[str, object] = {}
    circular["self"] = circular
    refusals = {
        "a global config must be a mapping, not list": [1],
        "config is not representable as JSON: Circular reference detected": circular,
        # JSON with `default=str` takes a date; OmegaConf, which resolves the interpolation, does not
        "cannot read config interpolations: Value 'date' is not a supported primitive type": {
            "d": datetime.date(2024, 1, 2),
            "x": "${y}",
        },
    }
    for message, refused_document in refusals.items():
        with pytest.raises(ConfigError) as refused:
            GlobalConfig.from_document(refused_document, lenient=True)  # type: ignore[arg-type]
        assert str(refused.value).splitlines()[0] == message


@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
async def test_a_metered_call_is_sends_own_coroutine_to_its_url_and_in_flight_until_it_ends(
    monkeypatch: pytest.MonkeyPatch, traced: bool
) -> None:
    """A metered call (worker metrics on), traced or not: its observers chosen beforehand (`observer_for`, no
    coroutine), then `send`'s own coroutine (none of ours between the caller and aiohttp), to its URL under the
    caller's resend rule, counted in flight from its observer's making until its answer or its error."""
    monkeypatch.setattr(TRACING, "enabled", traced)
    monkeypatch.setattr(METRICS, "enabled", True)
    server, port, connections = await start_dropping_server(drops=1)
    base = f"http://{LOOPBACK}:{port}"
    policy = RetryPolicy(attempts=2, initial_backoff_seconds=0.01, max_backoff_seconds=0.02)
    in_flight = client_metrics._in_flight
    try:
        async with aiohttp.ClientSession() as session:
            call = Call(session, "POST", f"{base}/v1/x", {"data": b"{}"}, policy, server="srv")
            call.observer = observer_for(call, base)
            sending = send(call)
            assert inspect.iscoroutine(sending) and sending.cr_code is send.__code__
            assert in_flight[("srv", "POST")] == 1
            async with await sending as response:
                assert (response.status, str(response.url)) == (200, f"{base}/v1/x")
            assert (connections, in_flight[("srv", "POST")]) == ([2], 0)
            connections[0] = 0
            with pytest.raises(aiohttp.ServerDisconnectedError):
                call = Call(session, "POST", f"{base}/v1/x", {"data": b"{}"}, policy, server="srv", resend=False)
                call.observer = observer_for(call, base)
                await send(call)
            assert (connections, in_flight[("srv", "POST")]) == ([1], 0)
    finally:
        server.close()
        await server.wait_closed()


def test_a_server_without_a_config_of_its_own_takes_the_token_of_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GYM_RPC_TOKEN", " s3cret ")
    assert ServerSecurity.from_environment() == ServerSecurity(token="s3cret")
    monkeypatch.setenv("GYM_RPC_TOKEN", "")
    assert ServerSecurity.from_environment() == ServerSecurity(token=None)


async def _end_at_once(request: bytes, context: object) -> AsyncIterator[bytes]:
    """A status watch that a control plane other than gym_rpc's head (which never does) ends without an error."""
    return
    yield


@FLAVOURS
async def test_a_watch_the_head_ends_without_an_error_is_an_outage_named_as_such(events_of: WatchFactory) -> None:
    watch = grpc.unary_stream_rpc_method_handler(_end_at_once)  # bytes in and out: no message is ever sent
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("gym_rpc.v1.ControlPlaneService", {"WatchServerStatuses": watch}),)
    )
    address = f"{LOOPBACK}:{server.add_insecure_port(f'{LOOPBACK}:0')}"
    await server.start()
    retried: list[ControlPlaneError] = []
    try:
        with pytest.raises(HeadUnreachableError) as ended:
            await events_of(address, 1, max_wait_seconds=0.3, on_retry=lambda error, _: retried.append(error))
    finally:
        await server.stop(None)
    assert (str(ended.value), ended.value.address, ended.value.code) == (
        f"head server at {address} ended the status watch",
        address,
        grpc.StatusCode.UNAVAILABLE,
    )
    assert retried and {str(error) for error in retried} == {str(ended.value)}


def test_tls_files_the_head_cannot_serve_are_named_with_the_reason(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not pem")
    refusals = {
        f"cannot read head_server.tls.cert_file {tmp_path}/gone.pem: No such file or directory": HeadTlsConfig(
            cert_file=str(tmp_path / "gone.pem"), key_file=str(pki.server_key)
        ),
        f"cannot read head_server.tls.key_file {tmp_path}/gone.key: No such file or directory": HeadTlsConfig(
            cert_file=str(pki.server_cert), key_file=str(tmp_path / "gone.key")
        ),
        f"head_server.tls: {pki.server_cert} (cert_file) and {pki.client_key} (key_file) are not a PEM "
        "certificate chain and its unencrypted private key (KEY_VALUES_MISMATCH)": HeadTlsConfig(
            cert_file=str(pki.server_cert), key_file=str(pki.client_key)
        ),
        f"head_server.tls.client_ca_file {not_pem} is not a PEM CA certificate (NO_CERTIFICATE_OR_CRL_FOUND)": (
            HeadTlsConfig(
                cert_file=str(pki.server_cert), key_file=str(pki.server_key), client_ca_file=str(not_pem)
            )
        ),
    }
    for message, tls in refusals.items():
        with pytest.raises(ConfigError) as refused:
            check_tls_files(tls)
        assert str(refused.value) == message


def test_chosen_deadlines_and_bound_replace_the_default_options() -> None:
    options = server_options(max_connections=7, handshake_timeout_seconds=1.5, connection_idle_seconds=2.0)
    names = [name for name, _ in options]
    for name in ("grpc.server_handshake_timeout_ms", "grpc.max_connection_idle_ms"):
        assert names.count(name) == 1
    assert dict(options)["grpc.server_handshake_timeout_ms"] == 1500
    assert dict(options)["grpc.max_connection_idle_ms"] == 2000
    assert dict(options)["grpc.max_allowed_incoming_connections"] == 7


def test_http_client_must_be_a_mapping_and_each_upstream_pool_key_is_read() -> None:
    with pytest.raises(ConfigError) as refused:
        HttpClientSettings.from_document({"http_client": [1]})
    assert str(refused.value) == "http_client must be a mapping, not list"
    only_per_host = HttpClientSettings.from_document({"global_aiohttp_connector_limit_per_host": 7})
    assert only_per_host.max_connections_per_host == 7


async def test_a_probe_sends_an_unsampled_traceparent_and_names_an_unexpected_error(http_server) -> None:
    seen: list[str] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(request.headers.get("traceparent", ""))
        return web.Response()

    app = web.Application()
    app.router.add_get("/", record)
    port = await http_server(app)
    async with new_probe_session() as session:
        answered = await probe(session, "s", f"http://{LOOPBACK}:{port}/", 5)
        bad = await probe(session, "bad", "http://[::1", 5)
    assert len(seen) == 1 and re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-00", seen[0]), seen
    assert 0 < answered.latency_seconds < 5
    assert (bad.status, bad.detail) == ("unknown_error", "InvalidUrlClientError: http://[::1")


async def test_the_first_config_version_is_no_change_and_a_later_one_is() -> None:
    prober = StatusProber({})
    revision = prober.revision
    prober.set_config_version("a")
    assert prober.revision == revision
    prober.set_config_version("b")
    assert prober.revision == revision + 1


async def test_a_stored_probe_keeps_the_registration_and_counts_probes_in_a_row(caplog) -> None:
    servers = GlobalConfig.from_document(document({"s": server_entry(1)})).servers
    prober = StatusProber(servers)
    await prober.set_servers(servers)
    url = servers["s"].url
    ok = StatusReport(server_name="s", status="success", url=url, checked_at=time.time(), http_status=200)
    with caplog.at_level(logging.WARNING):
        instance_id = url_authority(url)
        for _ in range(3):
            await prober._store("s", instance_id, ok)
        await prober.set_instances("s", registered_as(servers["s"], None, "http://advertised:1"))
        failed = StatusReport(
            server_name="s", status="connection_error", url=url, checked_at=time.time(), detail="refused"
        )
        await prober._store("s", instance_id, failed)
        stored = prober.report("s")
        assert (stored.status, stored.advertised_url) == ("connection_error", "http://advertised:1")
        await prober._store("s", instance_id, failed)
        await prober._store(
            "s", instance_id, dataclasses.replace(failed, status="timeout", detail="no answer within 1s")
        )
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings == [
        "s: success -> connection_error after 3 probes (refused)",
        "s: connection_error -> timeout after 2 probes (no answer within 1s)",  # counted again from the change
    ]
    assert prober.fresh_report("s", 0) is None  # 0: no cached answer is fresh enough
    assert prober.fresh_report("s", 60) == prober.report("s")


async def test_every_probe_sent_is_counted_once(http_server) -> None:
    port = await http_server()
    servers = GlobalConfig.from_document(document({"s": server_entry(port)})).servers
    probed = asyncio.Event()

    async def on_change(report: StatusReport | None, name: str) -> None:
        if report is not None and report.status is not None:  # the first background round's probe
            probed.set()

    prober = StatusProber(servers, interval_seconds=3600, on_change=on_change)
    await prober.start()
    try:
        await asyncio.wait_for(probed.wait(), 10)
        await prober.probe_now("s", 5)
        await prober.probe_now("s", 5)
    finally:
        await prober.stop()
    assert (prober.probes_started, prober.probes_joined) == (3, 0)


async def test_a_method_nobody_serves_is_unimplemented_behind_the_token_check_too(head_factory) -> None:
    """The token interceptor passes a call no handler serves through untouched (gRPC answers UNIMPLEMENTED)."""
    head = await head_factory(document({}, head_server={"host": LOOPBACK, "port": 0, "auth_token": "s3cret-t0k"}))
    async with grpc.aio.insecure_channel(head.address) as channel:
        missing = channel.unary_unary("/gym_rpc.v1.ControlPlaneService/NoSuchMethod", None, None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await missing(b"", timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_pauses_before_any_event_start_at_the_first_backoff() -> None:
    """A head down from the start: the first pause is backoff(1) (the count of failures starts at 0)."""
    policy = RetryPolicy(initial_backoff_seconds=0.1, multiplier=10.0, max_backoff_seconds=5.0)
    pauses: list[float] = []
    with pytest.raises(HeadUnreachableError):
        await _async_events(
            f"{LOOPBACK}:{closed_port()}",
            1,
            max_wait_seconds=0.5,
            retry=policy,
            on_retry=lambda _, p: pauses.append(p),
        )
    assert 0.05 <= pauses[0] <= 0.1, pauses


async def test_a_port_in_use_is_named_with_grpcs_reason_and_the_likely_cause() -> None:
    taken = socket.socket()
    taken.bind((LOOPBACK, 0))
    taken.listen()
    port = taken.getsockname()[1]
    server = grpc.aio.server(options=(("grpc.so_reuseport", 0),))
    try:
        with pytest.raises(GymRpcError) as refused:
            ServerSecurity().add_port(server, LOOPBACK, port)
    finally:
        taken.close()
    assert str(refused.value) == (
        f"cannot listen on {LOOPBACK}:{port}: Failed to bind to address {LOOPBACK}:{port}; "
        "set GRPC_VERBOSITY=debug environment variable to see detailed error message.; "
        "is another process using the port?"
    )


async def test_each_caller_that_shares_a_probe_in_flight_counts_once(silent_server: int) -> None:
    servers = GlobalConfig.from_document(document({"s": server_entry(silent_server)})).servers
    prober = StatusProber(servers, interval_seconds=3600, probe_timeout_seconds=0.3)
    await prober.start()
    try:
        await asyncio.gather(*(prober.probe_now("s", 5) for _ in range(3)))
    finally:
        await prober.stop()
    assert (prober.probes_started, prober.probes_joined) == (1, 3)  # the background round's probe, joined by all 3


_PLACEHOLDER_TOKEN_REFUSAL = (
    "auth_token is a placeholder (such as <redacted>, which `gym-rpc config` prints in place of the token), not a "
    "token; set the real token, or remove the key to run without one"
)


def test_a_blank_head_token_is_refused_with_the_exact_reason() -> None:
    with pytest.raises(ConfigError) as refused:
        head_token("  ", "auth_token")
    assert str(refused.value) == (
        "auth_token is empty, which would run the head without authentication; set a real token, or remove "
        "the key to run without one"
    )


@pytest.mark.parametrize(
    "value",
    ["none", " Changeme ", "TOKEN", "[token]", "{set}", "*****", "()", "<your token here>", "<x", "<redacted>"],
)
def test_a_placeholder_head_token_is_refused_whatever_its_case_and_brackets(value: str) -> None:
    """Every placeholder rule on its own: a word in any case, a word in brackets, only brackets, a leading '<'."""
    with pytest.raises(ConfigError) as refused:
        head_token(value, "auth_token")
    assert str(refused.value) == _PLACEHOLDER_TOKEN_REFUSAL


@pytest.mark.parametrize(
    ("value", "token"),
    [(" XsetX ", "XsetX"), ("t0ken>", "t0ken>"), ("tokens", "tokens"), ("x<none>", "x<none>"), (None, None)],
)
def test_a_real_head_token_is_kept_without_its_outer_spaces(value: str | None, token: str | None) -> None:
    """Only the listed brackets are stripped before the word check; a token that merely contains one is kept."""
    assert head_token(value, "auth_token") == token


_Seen = tuple[int, tuple[tuple[bytes, bytes], ...]]  # the client's port and the raw request headers


async def _probe_recorder(http_server: Callable[..., Awaitable[int]]) -> tuple[int, list[_Seen]]:
    """A real aiohttp server that records each request's client port and raw headers and sets a cookie."""
    seen: list[_Seen] = []

    async def answer(request: web.Request) -> web.Response:
        assert request.transport is not None
        seen.append((request.transport.get_extra_info("peername")[1], request.raw_headers))
        response = web.Response(text="ok")
        response.set_cookie("session", "abc")
        return response

    app = web.Application()
    app.router.add_get("/", answer)
    return await http_server(app), seen


async def test_a_probe_session_opens_a_fresh_connection_per_probe_with_our_user_agent_and_no_cookies(
    http_server: Callable[..., Awaitable[int]],
) -> None:
    """new_probe_session: force_close (two probes, two client ports), the probe User-Agent spelled as written, and
    no cookie sent back (to a hostname: aiohttp's default jar would ignore cookies for an IP address anyway)."""
    port, seen = await _probe_recorder(http_server)
    async with new_probe_session() as session:
        for _ in range(2):
            report = await probe(session, "s", f"http://localhost:{port}", 5)
            assert (report.status, report.http_status) == ("success", 200)
    assert len(seen) == 2 and seen[0][0] != seen[1][0]
    for _, raw_headers in seen:
        names = [name for name, _ in raw_headers]
        assert [value for name, value in raw_headers if name.lower() == b"user-agent"] == [b"gym-rpc-probe/0.1.0"]
        assert b"User-Agent" in names and b"Cookie" not in names and b"cookie" not in names


async def test_a_probe_session_ignores_proxy_settings_in_the_environment(
    http_server: Callable[..., Awaitable[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """trust_env=False: an HTTP_PROXY that refuses connections does not turn a live server into an error."""
    monkeypatch.setenv("HTTP_PROXY", f"http://{LOOPBACK}:{closed_port()}")
    for name in ("NO_PROXY", "no_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    port, seen = await _probe_recorder(http_server)
    async with new_probe_session() as session:
        report = await probe(session, "s", f"http://{LOOPBACK}:{port}", 5)
    assert (report.status, report.http_status, report.detail, len(seen)) == ("success", 200, "", 1)


async def test_a_probe_session_has_the_connection_limit_it_is_given() -> None:
    async with new_probe_session() as default, new_probe_session(3) as three:
        assert default.connector is not None and three.connector is not None
        assert (default.connector.limit, three.connector.limit) == (100, 3)


async def test_a_probe_session_is_not_traced_while_aiohttps_instrumentation_is_on(
    http_server: Callable[..., Awaitable[int]],
) -> None:
    """The instrumentation's trace config is removed from the probe session: no span for a probe."""
    from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    port, seen = await _probe_recorder(http_server)
    instrumentor = AioHttpClientInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        async with new_probe_session() as session:
            report = await probe(session, "s", f"http://{LOOPBACK}:{port}", 5)
            assert session.trace_configs == []
    finally:
        instrumentor.uninstrument()
    assert (report.status, len(seen), exporter.get_finished_spans()) == ("success", 1, ())


def test_server_config_block_resolves_a_dictconfig_into_plain_dicts() -> None:
    """Kills server_config_block mutants 3-6, 10, 11: a DictConfig is turned into plain, resolved dicts."""
    from omegaconf import OmegaConf

    block = config_module.server_config_block(
        OmegaConf.create({"host": "127.0.0.1", "port": "${p}", "p": 5, "tls": {"cert": "c"}})
    )
    assert block == {"host": "127.0.0.1", "port": 5, "p": 5, "tls": {"cert": "c"}}
    assert type(block["tls"]) is dict


def test_server_config_block_takes_an_object_with_only_host_or_only_port() -> None:
    """Kills server_config_block mutants 13, 14, 18-20, 24, 25: either attribute alone makes it a server config."""
    assert config_module.server_config_block(types.SimpleNamespace(host="h")) == {"host": "h"}
    assert config_module.server_config_block(types.SimpleNamespace(port=5)) == {"port": 5}


def test_from_document_names_the_first_unresolvable_global_key_read_at_once() -> None:
    """Kills from_document mutants 7, 8, 12, 13, 15, 17-19: the exact line for a global key needed at once."""
    reason = "'${oops}' (Interpolation key 'oops' not found)"
    documents: dict[str, dict[str, Any]] = {
        f"cannot resolve head_server.port: {reason}": {"head_server": {"host": "127.0.0.1", "port": "${oops}"}},
        f"cannot resolve head_server.tls.cert: {reason}": {
            "head_server": {"host": "127.0.0.1", "port": 1, "tls": {"cert": "${oops}"}}
        },
        f"cannot resolve observability_enabled: {reason}": {"observability_enabled": "${oops}"},
    }
    for message, unresolvable in documents.items():
        with pytest.raises(ConfigError) as caught:
            GlobalConfig.from_document(unresolvable, lenient=True)
        assert str(caught.value) == message


def test_from_document_refuses_a_non_mapping_head_or_a_non_json_value_with_one_exact_line() -> None:
    """Kills from_document mutants 29 and 62."""
    with pytest.raises(ConfigError) as caught:
        GlobalConfig.from_document({"head_server": 5})
    assert str(caught.value) == "head_server must be a mapping with host and port"
    with pytest.raises(ConfigError) as caught:
        GlobalConfig.from_document({"x": b"ab"}, lenient=True)
    not_json = "config is not representable as JSON: Object of type bytes is not JSON serializable"
    assert str(caught.value) == not_json


# --- URL hosts and badly shaped server entries -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("fe80::1%ethX", "[fe80::1%ethX]"),  # the zone is kept as written, whatever its letters
        ("fe80::1%a%b%c", "[fe80::1%a%b%c]"),  # only what comes before the first '%' must be an address
        ("[::1", "[::1]"),  # a stray bracket on either side is mended, not doubled
        ("::1]", "[::1]"),
    ],
)
def test_url_host_brackets_what_is_an_ipv6_address_before_its_zone(host: str, expected: str) -> None:
    """Kills url_host mutants 2, 3 and 9: the brackets stripped (and only they), the address split at the first
    '%'."""
    assert config_module.url_host(host) == expected


def test_a_server_entry_with_neither_host_nor_port_names_both() -> None:
    """Kills _malformed_server mutants 43 and 44: the missing keys are joined by ' and no '."""
    config = GlobalConfig.from_document(
        {"no_address": {"responses_api_models": {"impl": {"entrypoint": "app.py"}}}}
    )
    assert config.malformed_servers == {"no_address": "responses_api_models.impl has no host and no port"}


# --- the status prober: its defaults, its task, its log lines ----------------------------------------------------


async def test_a_prober_made_without_settings_has_the_heads_defaults() -> None:
    """Kills StatusProber.__init__ mutants 1-3: a 2 s interval, a 1 s probe timeout, results fresh for half the
    interval, and a watch history of 1024 changes (a watcher 1024 changes behind resumes, one more behind does
    not), as HeadOptions has them."""
    options = HeadOptions()
    assert (options.probe_interval_seconds, options.probe_timeout_seconds, options.watch_history_size) == (
        2.0,
        1.0,
        1024,
    )
    servers = GlobalConfig.from_document(document({"a": server_entry(1001)})).servers
    prober = StatusProber(servers)
    assert (prober.interval_seconds, prober.probe_timeout_seconds, prober.default_max_age_seconds) == (
        2.0,
        1.0,
        1.0,
    )
    await prober.set_servers(servers)
    start = prober.revision
    for port in range(1, 1025):
        await prober.set_instances("a", registered_as(servers["a"], "registered", f"http://10.0.0.1:{port}"))
    assert prober.revision == start + 1024
    assert prober.changes_since(start) == Changes(start + 1024, [prober.report("a")], compacted=False)
    assert prober.changes_since(start - 1).compacted is True


def test_a_new_probers_revision_is_the_wall_clock_in_milliseconds() -> None:
    """Kills StatusProber.__init__ mutant 21: revisions start at the wall clock in ms (so they keep rising across
    head restarts), not at some other fraction of it."""
    before = time.time_ns() // 1_000_000
    revision = StatusProber({}).revision
    assert before <= revision <= time.time_ns() // 1_000_000


async def test_a_moved_config_instance_restarts_unprobed_and_its_process_stays_an_instance() -> None:
    """A server whose config address changes has a new config instance, unprobed at the new URL; the process that
    registered at the old address is still an instance (a registered one, there); the listener is told each
    change (never None: the server did not leave)."""
    told: list[tuple[StatusReport | None, str]] = []

    async def on_change(report: StatusReport | None, name: str) -> None:
        told.append((report, name))

    config = {"servers": GlobalConfig.from_document(document({"a": server_entry(1001)})).servers}
    prober = StatusProber(config["servers"], on_change=on_change)
    registry = InstanceRegistry(lambda: config["servers"])
    await prober.set_servers(config["servers"])
    await registry.register(
        InstanceRegistration("a", 7, 0.0, LOOPBACK, 1001, LOOPBACK, registered_at=0.0, peer_host=LOOPBACK)
    )
    await registry.update_prober(prober, ["a"])
    config["servers"] = GlobalConfig.from_document(document({"a": server_entry(1002)})).servers
    await registry.update_prober(prober)
    report = prober.report("a")
    assert (report.status, report.url, report.registration, report.advertised_url) == (
        None,
        f"http://{LOOPBACK}:1002",
        None,
        "",
    )
    assert [(i.instance_id, i.origin, i.registration, i.pid) for i in report.instances] == [
        (f"{LOOPBACK}:1002", "config", None, 0),
        (f"{LOOPBACK}:1001", "registered", "registered", 7),
    ]
    assert [(report and (report.url, report.registration), name) for report, name in told] == [
        ((f"http://{LOOPBACK}:1001", None), "a"),
        ((f"http://{LOOPBACK}:1001", "registered"), "a"),
        ((f"http://{LOOPBACK}:1002", None), "a"),
    ]


async def test_the_first_probe_line_says_no_probe_had_given_pending(http_server, caplog) -> None:
    """Kills set_servers mutant 32: `gym.probes` (the probes in a row that gave the old status) is 0 on the line
    of a server's first probe: a new server starts counting at 0."""
    port = await http_server()
    servers = GlobalConfig.from_document(document({"s": server_entry(port)})).servers
    prober = StatusProber(servers, interval_seconds=3600)
    caplog.set_level(logging.INFO, logger="gym_rpc.head")
    await prober.start()
    try:
        if prober.report("s").status is None:
            assert await prober.wait_for_change(prober.revision, 10)
    finally:
        await prober.stop()
    [line] = [record for record in caplog.records if record.name == "gym_rpc.head"]
    assert line.getMessage() == "s: pending -> success on the first probe"
    assert line.__dict__["gym.probes"] == 0


async def test_the_probers_task_is_named_and_ends_with_stop() -> None:
    """Kills start mutants 5, 8, 9 and stop mutant 1: one background task, named "gym_rpc status prober" (what a
    dump of a hung head's tasks shows), and stop() cancels it and waits for it to end."""
    prober = StatusProber({}, interval_seconds=3600)
    before = asyncio.all_tasks()
    await prober.start()
    tasks = asyncio.all_tasks() - before
    await prober.stop()
    assert [task.get_name() for task in tasks] == ["gym_rpc status prober"]
    assert all(task.cancelled() for task in tasks)


async def test_a_failed_probe_round_is_logged_by_name(http_server) -> None:
    """Kills _run mutants 11 and 12: a round that fails (here the change listener raises) is logged as
    "status probe round failed", with the exception."""
    port = await http_server()
    servers = GlobalConfig.from_document(document({"s": server_entry(port)})).servers
    broken = RuntimeError("the listener broke")

    async def on_change(report: StatusReport | None, name: str) -> None:
        if report is not None and report.status is not None:  # a probe result, not the server's arrival
            raise broken

    class Kept(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.ERROR)
            self.records: list[logging.LogRecord] = []
            self.logged = asyncio.Event()

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)
            self.logged.set()

    kept = Kept()
    prober_logger = logging.getLogger("gym_rpc.server._prober")
    prober_logger.addHandler(kept)
    prober = StatusProber(servers, interval_seconds=3600, on_change=on_change)
    await prober.start()
    try:
        await asyncio.wait_for(kept.logged.wait(), 10)
    finally:
        await prober.stop()
        prober_logger.removeHandler(kept)
    assert [(r.getMessage(), r.exc_info and r.exc_info[1]) for r in kept.records] == [
        ("status probe round failed", broken)
    ]


async def _probes_of_a_round_at_age(
    prober: StatusProber, name: str, age: float, within: tuple[float, float]
) -> int:
    """The probes a background round (probe_all) starts when the server's cached result is `age` s old.

    The round is run only when the loop woke with the result's age inside `within` and nothing in flight; a loaded
    machine that woke too late gets a fresh result and another try."""
    for _ in range(5):
        cached = prober.report(name)
        await asyncio.sleep(max(0.0, cached.checked_at + age - time.time()))
        started, waited = prober.probes_started, time.time() - cached.checked_at
        if prober.report(name) is cached and not prober.waiting_on_probe(name) and within[0] < waited < within[1]:
            await prober.probe_all()  # decides at once (no await before it looks at the age)
            return prober.probes_started - started
        await prober.probe_now(name, 5)
    raise AssertionError(f"the loop never woke with the result {within[0]} to {within[1]} s old")


async def test_a_round_asks_again_after_half_the_interval_even_with_a_longer_max_age(http_server) -> None:
    """Kills probe_all mutants 6 and 7: the background round's freshness window is half the interval when the
    stated default max age is longer (a 3 s interval: a 1.25 s old result is kept, a 2 s old one is asked
    again)."""
    port = await http_server()
    servers = GlobalConfig.from_document(document({"s": server_entry(port)})).servers
    prober = StatusProber(servers, interval_seconds=3.0, default_max_age_seconds=3600)
    await prober.start()
    try:
        if prober.report("s").status is None:
            assert await prober.wait_for_change(prober.revision, 10)
        assert await _probes_of_a_round_at_age(prober, "s", 1.25, (1.0, 1.5)) == 0
        assert await _probes_of_a_round_at_age(prober, "s", 2.0, (1.5, 3.0)) == 1
    finally:
        await prober.stop()


async def test_a_client_without_a_token_sends_no_authorization_at_all() -> None:
    """Kills ClientSecurity.metadata mutant 2: with no token (none, or empty) a call carries no `authorization`
    metadata (not a "Bearer None"); with one it carries "Bearer <token>"."""
    seen: list[list[tuple[str, str | bytes]]] = []

    async def list_statuses(
        request: pb.ListServerStatusesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListServerStatusesResponse:
        seen.append([(key, value) for key, value in context.invocation_metadata() or () if key == "authorization"])
        return pb.ListServerStatusesResponse()

    handler = grpc.unary_unary_rpc_method_handler(
        list_statuses,
        request_deserializer=pb.ListServerStatusesRequest.FromString,
        response_serializer=pb.ListServerStatusesResponse.SerializeToString,
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("gym_rpc.v1.ControlPlaneService", {"ListServerStatuses": handler}),)
    )
    port = server.add_insecure_port(f"{LOOPBACK}:0")
    await server.start()
    try:
        for security in (ClientSecurity(), ClientSecurity(token=""), ClientSecurity(token="s3cret-t0k")):
            await ControlClient(f"{LOOPBACK}:{port}", security=security).list_server_statuses()
    finally:
        await server.stop(None)
    assert seen == [[], [], [("authorization", "Bearer s3cret-t0k")]]
