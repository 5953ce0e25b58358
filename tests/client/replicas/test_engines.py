"""Engines and routers as server entries (`session_affinity_header`, issue 39 point 1): calls to them carry no
`/ng-rollout/` or `/ng-trace/` path segment; the rollout id travels in the named header, the trace context in
`traceparent`. Gym servers beside them keep the path form exactly. Real aiohttp engines on loopback."""

from __future__ import annotations

import importlib
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from gym_rpc.client.data import _call_paths
from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.server_client import ServerClient, apply_rollout_prefix, rollout_context
from gym_rpc.config import BaseServerConfig, GlobalConfig, config_from_bytes
from gym_rpc.errors import ConfigError, InvalidRolloutIdError
from gym_rpc.wire import TRACEPARENT_RE
from tests.support.documents import document, server_entry
from tests.support.engines import FakeEngine, engine_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.tracing import Traced


@pytest.fixture(autouse=True)
async def _close_sessions() -> AsyncIterator[None]:
    yield
    await close_http_sessions()


def make_client(servers: dict[str, dict], **global_keys: Any) -> ServerClient:
    head = BaseServerConfig(host=LOOPBACK, port=closed_port())  # the data plane never needs the head
    return ServerClient(
        head_server_config=head, global_config_dict=OmegaConf.create(document(servers, **global_keys))
    )


async def post(client: ServerClient, server: str, path: str, **kwargs: Any) -> int:
    async with await client.post(server, path, **kwargs) as response:
        await response.read()
        return response.status


# --- the config key ----------------------------------------------------------------------------------------------


def _header_of(value: Any) -> str | None:
    config = GlobalConfig.from_document(document({"policy": engine_entry(8000, value)}))
    return config.servers["policy"].session_affinity_header


def test_the_key_names_the_header_true_meaning_x_session_id() -> None:
    assert _header_of(True) == "X-Session-ID"
    assert _header_of("X-SMG-Routing-Key") == "X-SMG-Routing-Key"
    assert _header_of("X-Dynamo-Session-ID") == "X-Dynamo-Session-ID"


@pytest.mark.parametrize("value", [None, False])
def test_null_or_false_is_the_path_form(value: Any) -> None:
    assert _header_of(value) is None


def test_an_entry_without_the_key_is_the_path_form() -> None:
    config = GlobalConfig.from_document(document({"policy": server_entry(8000)}))
    assert config.servers["policy"].session_affinity_header is None


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (1, "must be true (the X-Session-ID header), a header name such as X-SMG-Routing-Key, or false, not int"),
        (["X-Session-ID"], "not list"),
        ("", "'' is not an HTTP header name"),
        ("X Session", "'X Session' is not an HTTP header name"),
        ("X-Id\r\nInjected: 1", "is not an HTTP header name"),
        ("x" * 129, "at most 128"),
        ("traceparent", "'traceparent' is a header the call itself sends"),
        ("Cookie", "'Cookie' is a header the call itself sends"),
        ("Content-Length", "is a header the call itself sends"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_server_and_the_key(value: Any, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        GlobalConfig.from_document(document({"policy": engine_entry(8000, value)}))
    message = str(caught.value)
    assert message.startswith("server 'policy': session_affinity_header")
    assert says in message
    assert "\n" not in message


def test_the_head_refuses_a_config_file_with_a_bad_value() -> None:
    entry = b"{host: 127.0.0.1, port: 8000, session_affinity_header: 7}"
    text = b"policy:\n  responses_api_models:\n    vllm: " + entry + b"\n"
    with pytest.raises(ConfigError, match="session_affinity_header must be true"):
        config_from_bytes(text, "gym.yaml")


# --- calls to an engine ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("observability", [True, False])
async def test_calls_to_an_engine_carry_the_rollout_in_x_session_id_not_the_path(
    http_server, observability: bool
) -> None:
    engine = FakeEngine("e")
    client = make_client(
        {"policy": engine_entry(await http_server(engine.app()))}, observability_enabled=observability
    )
    with rollout_context("7-3"):
        assert await post(client, "policy", "/v1/responses", json={"input": "hi"}) == 200
        assert await post(client, "policy", "/v1/chat/completions", json={"messages": []}) == 200
    assert await post(client, "policy", "/v1/responses", json={"input": "no rollout"}) == 200
    assert engine.paths() == ["/v1/responses", "/v1/chat/completions", "/v1/responses"]
    assert engine.header_values("X-Session-ID") == ["7-3", "7-3", None]


async def test_another_router_reads_the_header_its_entry_names(http_server) -> None:
    engine = FakeEngine("e")
    port = await http_server(engine.app())
    client = make_client({"policy": engine_entry(port, "X-SMG-Routing-Key")}, observability_enabled=True)
    with rollout_context("r-1"):
        await post(client, "policy", "/v1/responses", json={})
    assert engine.paths() == ["/v1/responses"]
    assert engine.header_values("X-SMG-Routing-Key") == ["r-1"]
    assert engine.header_values("X-Session-ID") == [None]


async def test_the_callers_headers_are_kept_untouched_and_their_own_session_key_wins(http_server) -> None:
    engine = FakeEngine("e")
    client = make_client({"policy": engine_entry(await http_server(engine.app()))}, observability_enabled=True)
    given = {"Authorization": "Bearer k"}
    mine = [("x-session-id", "chosen-by-caller")]
    with rollout_context("r-2"):
        await post(client, "policy", "/v1/responses", json={}, headers=given)
        await post(client, "policy", "/v1/responses", json={}, headers=mine)
    assert given == {"Authorization": "Bearer k"}  # never written to
    assert engine.header_values("Authorization") == ["Bearer k", None]
    assert engine.header_values("X-Session-ID") == ["r-2", "chosen-by-caller"]


async def test_gym_servers_beside_an_engine_keep_the_path_form_exactly(http_server) -> None:
    """Existing configs behave as today: with observability on a Gym model server and a resources server get
    `/ng-rollout/<id>` and no session header; with it off, nothing."""
    engine, gym = FakeEngine("engine"), FakeEngine("gym")
    engine_port, gym_port = await http_server(engine.app()), await http_server(gym.app())
    for observability in (True, False):
        client = make_client(
            {
                "policy": engine_entry(engine_port),
                "gym_model": server_entry(gym_port),
                "tools": server_entry(gym_port, "resources_servers"),
            },
            observability_enabled=observability,
        )
        with rollout_context("r-9"):
            await post(client, "gym_model", "/v1/responses", json={})
            await post(client, "tools", "/verify", json={})
            await post(client, "policy", "/v1/responses", json={})
    assert gym.paths() == ["/ng-rollout/r-9/v1/responses", "/ng-rollout/r-9/verify", "/v1/responses", "/verify"]
    assert gym.header_values("X-Session-ID") == [None] * 4
    assert engine.paths() == ["/v1/responses", "/v1/responses"]
    assert engine.header_values("X-Session-ID") == ["r-9", "r-9"]


async def test_without_the_key_an_engine_answers_404_to_the_rollout_path(http_server) -> None:
    """What the key fixes: a config naming an engine as a Gym server sends `/ng-rollout/` to it."""
    engine = FakeEngine("e")
    client = make_client(
        {"policy": engine_entry(await http_server(engine.app()), None)}, observability_enabled=True
    )
    with rollout_context("r-1"):
        assert await post(client, "policy", "/v1/responses", json={}) == 404
    assert engine.paths() == ["/ng-rollout/r-1/v1/responses"]


async def test_engines_as_replicas_of_one_entry_keep_each_rollout_on_one_engine(
    http_server, slowness_rule_off
) -> None:
    """gym_rpc in front of the engines directly: the entry's instances are engines, the client pins each rollout
    to one of them, and every call carries the header and no prefix. A model server's rollout also leaves an
    engine that answers slowly (test_replicas_client.py tests that). Here that is the only rule that can move one
    (no head: no engine figures; sequential calls: no load; every answer a 200: no ejection), and one rollout
    moved in a CI run at load 6: one call stalled a few hundred ms. This test, about pins and headers, has no
    slowness rule."""
    engines = [FakeEngine(f"e{index}") for index in range(3)]
    ports = [await http_server(engine.app()) for engine in engines]
    entry = engine_entry(ports[0], replicas=[f"{LOOPBACK}:{port}" for port in ports[1:]])
    head = BaseServerConfig(host=LOOPBACK, port=closed_port())
    client = ServerClient._from_global_config(
        head, GlobalConfig.from_document(document({"policy": entry}, observability_enabled=True))
    )
    client.follow_instances(False)  # the config's instances only: no head here
    for rollout in range(12):
        with rollout_context(f"0-{rollout}"):
            for _turn in range(3):
                assert await post(client, "policy", "/v1/responses", json={}) == 200
    seen: dict[str, set[str]] = {}
    for engine in engines:
        assert set(engine.paths()) <= {"/v1/responses"}
        for key in engine.header_values("X-Session-ID"):
            assert key is not None
            seen.setdefault(key, set()).add(engine.name)
    assert len(seen) == 12 and all(len(names) == 1 for names in seen.values())
    assert sum(1 for engine in engines if engine.requests) >= 2  # spread, not all on one


def test_the_path_rule_is_decided_once_per_client_and_absent_without_engines() -> None:
    """The hot path's cost for configs without the key is what it was: no rule at all with observability off, the
    path form's own rule with it on; the engine-aware rule only when an entry has the key."""
    rule = _call_paths.path_rule
    plain = GlobalConfig.from_document(document({"policy": server_entry(8000)}))
    observed = GlobalConfig.from_document(document({"policy": server_entry(8000)}, observability_enabled=True))
    engines = GlobalConfig.from_document(document({"policy": engine_entry(8000), "gym": server_entry(8001)}))
    assert rule(plain) is None
    assert rule(observed) is _call_paths.observed_path
    assert rule(engines) is _call_paths.engine_aware_path


async def test_nemo_gym_rollout_context_goes_in_the_header_and_a_hostile_id_is_refused(
    nemo_gym_path: Path, monkeypatch: pytest.MonkeyPatch, http_server
) -> None:
    """An id NeMo Gym's own context binds (its agents bind it around `/run`) travels as gym_rpc's does, and is held
    to the rule the path form holds it to: nothing but a plain id reaches a router's header."""
    monkeypatch.syspath_prepend(str(nemo_gym_path))
    monkeypatch.delitem(sys.modules, "nemo_gym", raising=False)
    monkeypatch.delitem(sys.modules, "nemo_gym.rollout_correlation", raising=False)
    nemo_rollouts = importlib.import_module("nemo_gym.rollout_correlation")
    engine = FakeEngine("e")
    client = make_client({"policy": engine_entry(await http_server(engine.app()))})
    with nemo_rollouts.rollout_context("7-2"):
        await post(client, "policy", "/v1/responses", json={})
    with nemo_rollouts.rollout_context("7-2\r\nX-Injected: 1"), pytest.raises(InvalidRolloutIdError):
        await post(client, "policy", "/v1/responses", json={})
    assert engine.header_values("X-Session-ID") == ["7-2"]
    assert engine.header_values("X-Injected") == [None]


async def test_traced_calls_to_an_engine_carry_traceparent_and_no_trace_segment(
    http_server, traced: Callable[..., Traced]
) -> None:
    tracing = traced()
    engine = FakeEngine("e")
    client = make_client({"policy": engine_entry(await http_server(engine.app()))}, observability_enabled=True)
    with rollout_context("r-5", span=True):
        await post(client, "policy", "/v1/responses", json={})
    assert engine.paths() == ["/v1/responses"]
    [traceparent] = engine.header_values("traceparent")
    assert traceparent is not None and TRACEPARENT_RE.fullmatch(traceparent)
    [call_span] = tracing.clients()
    assert traceparent.split("-")[1] == f"{call_span.context.trace_id:032x}"
    assert engine.header_values("X-Session-ID") == ["r-5"]


# --- URLs and headers handed to clients Gym does not instrument --------------------------------------------------


def test_rollout_target_of_a_gym_server_is_apply_rollout_prefix_of_its_url() -> None:
    client = make_client({"gym": server_entry(8001)})
    target = client.rollout_target("gym", "r-1", token_capture=True)
    assert target.url == apply_rollout_prefix(client._resolve_base_url("gym"), "r-1", token_capture=True)
    assert target.url == "http://127.0.0.1:8001/ng-rollout/r-1/training-token-capture"
    assert target.headers == {}


def test_rollout_target_of_an_engine_is_its_url_and_the_session_header() -> None:
    client = make_client({"policy": engine_entry(8000, "X-Dynamo-Session-ID")})
    assert client.rollout_target("policy", "r-1") == ("http://127.0.0.1:8000", {"X-Dynamo-Session-ID": "r-1"})
    assert client.rollout_target("policy", None) == ("http://127.0.0.1:8000", {})
    with pytest.raises(ValueError, match="has no training-token-capture path"):
        client.rollout_target("policy", "r-1", token_capture=True)
    with pytest.raises(InvalidRolloutIdError):
        client.rollout_target("policy", "r/1")


def test_rollout_target_inside_a_span_puts_the_trace_context_in_traceparent(traced: Callable[..., Traced]) -> None:
    tracing = traced()
    client = make_client({"policy": engine_entry(8000), "gym": server_entry(8001)})
    with tracing.tracer.start_as_current_span("rollout") as span:
        engine = client.rollout_target("policy", "r-1")
        gym = client.rollout_target("gym", "r-1")
        untraced = client.rollout_target("policy", "r-1", trace_context=False)
    context = span.get_span_context()
    expected = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    assert engine == ("http://127.0.0.1:8000", {"X-Session-ID": "r-1", "traceparent": expected})
    assert gym.url == f"http://127.0.0.1:8001/ng-rollout/r-1/ng-trace/{expected}"  # the path form's same context
    assert untraced.headers == {"X-Session-ID": "r-1"}
