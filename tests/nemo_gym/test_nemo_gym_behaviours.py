"""Behaviours where upstream NeMo Gym (`nemo_gym/server_utils.py`, `rollout_correlation.py`) is the spec: each
one a NeMo Gym user relies on without knowing it, so gym_rpc's ServerClient must do the same (issue 12)."""

from __future__ import annotations

import asyncio
import datetime
import importlib
import json
import logging
import pickle
import subprocess
import sys
import textwrap
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from omegaconf import OmegaConf
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler
from pydantic import BaseModel

from gym_rpc import telemetry
from gym_rpc.client import server_client
from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.data._http_settings import HttpClientSettings
from gym_rpc.client.server_client import (
    ServerClient,
    _connectable_client_host,
    apply_rollout_prefix,
    get_server_url,
    rollout_context,
    rollout_path_prefix,
    setup_server_client,
    trace_context_path_segment,
)
from gym_rpc.config import BaseServerConfig, ServerConfigLike
from gym_rpc.errors import ConfigError, ControlPlaneError, HeadUnreachableError, UnknownServerError
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port

CONFIG_ENV = "NEMO_GYM_CONFIG_DICT"
MODEL_URL_ENV, MODEL_NAME_ENV = "NEMO_GYM_MODEL_SERVER_BASE_URL", "NEMO_GYM_MODEL_SERVER_NAME"
UNSET_ENV = "GYM_RPC_TEST_NEVER_SET"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (CONFIG_ENV, MODEL_URL_ENV, MODEL_NAME_ENV, UNSET_ENV, "GYM_RPC_HEAD", "GYM_RPC_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(server_client, "_clients", {})


@pytest.fixture(autouse=True)
async def _close_sessions() -> AsyncIterator[None]:
    yield
    await close_http_sessions()


class Seen:
    """An aiohttp server that records the raw path, Content-Type and body of every request it answers."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, bytes]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append((request.raw_path, request.headers.get("Content-Type", ""), await request.read()))
        return web.json_response({"reward": 1.0})

    @property
    def paths(self) -> list[str]:
        return [path for path, _, _ in self.requests]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app


def client_for(doc: dict[str, Any], head_port: int | None = None) -> ServerClient:
    head = BaseServerConfig(host=LOOPBACK, port=head_port or closed_port())
    return ServerClient(head_server_config=head, global_config_dict=OmegaConf.create(doc))


# --- head and server configs of any shape ---


class ForeignServerConfig(BaseModel):
    """Another library's server model, shaped like NeMo Gym's `nemo_gym.config_types.BaseServerConfig`."""

    host: str
    port: int
    num_workers: int | None = None


class ForeignSecureHeadConfig(ForeignServerConfig):
    auth_token: str | None = None


def head_shapes(port: int) -> dict[str, Any]:
    return {
        "gym_rpc model": BaseServerConfig(host=LOOPBACK, port=port),
        "another pydantic model": ForeignServerConfig(host=LOOPBACK, port=port),
        "plain object": types.SimpleNamespace(host=LOOPBACK, port=port),
        "mapping": {"host": LOOPBACK, "port": port},
        "DictConfig": OmegaConf.create({"host": LOOPBACK, "port": port}),
    }


async def test_every_entry_point_takes_a_head_config_of_any_shape(head_factory) -> None:
    doc = document({"policy": server_entry(8000)})
    head = await head_factory(doc)
    for shape, config in head_shapes(head.port).items():
        loaded = await asyncio.to_thread(ServerClient.load_from_global_config, head_server_config=config)
        assert loaded.head_server_config == BaseServerConfig(host=LOOPBACK, port=head.port), shape
        assert loaded._resolve_base_url("policy") == "http://127.0.0.1:8000", shape
        server_client._clients.clear()
        made = await asyncio.to_thread(setup_server_client, config)
        assert made.head_server_config.port == head.port, shape
        built = ServerClient(head_server_config=config, global_config_dict=OmegaConf.create(doc))
        assert built.head_server_config == BaseServerConfig(host=LOOPBACK, port=head.port), shape
        assert await asyncio.to_thread(built.poll_for_status, "head_server") == "success", shape


@pytest.mark.parametrize("shape", ["another pydantic model", "plain object", "mapping"])
async def test_a_head_config_of_any_shape_carries_its_token(head_factory, shape: str) -> None:
    doc = document({"policy": server_entry(8000, api_key="sk-secret")}, head_server={"host": LOOPBACK, "port": 0})
    head = await head_factory({**doc, "head_server": {"host": LOOPBACK, "port": 0, "auth_token": "t0ken"}})
    fields: dict[str, Any] = {"host": LOOPBACK, "port": head.port, "auth_token": "t0ken"}
    shapes: dict[str, ServerConfigLike] = {
        "another pydantic model": ForeignSecureHeadConfig(**fields),
        "plain object": types.SimpleNamespace(**fields),
        "mapping": fields,
    }
    config = shapes[shape]
    client = await asyncio.to_thread(ServerClient.load_from_global_config, head_server_config=config)
    entry = client.global_config_dict.policy.responses_api_models.responses_api_models_impl
    assert entry.api_key == "sk-secret"  # only an authenticated caller gets the secrets
    anonymous = {"host": LOOPBACK, "port": head.port}
    with pytest.raises(ControlPlaneError, match="token"):  # the head refuses a caller without its token
        await asyncio.to_thread(ServerClient.load_from_global_config, head_server_config=anonymous)


@pytest.mark.parametrize(
    ("config", "missing"),
    [({"host": LOOPBACK}, "port"), (types.SimpleNamespace(port=1), "host"), ("127.0.0.1:11000", "host")],
)
def test_a_head_config_without_host_or_port_is_a_clear_error(config: Any, missing: str) -> None:
    with pytest.raises(ConfigError, match=missing):
        ServerClient.load_from_global_config(head_server_config=config)


# --- NeMo Gym's rollout context and the /verify body rule ---


def observed_doc(resources_port: int, model_port: int, observability: bool = True) -> dict[str, Any]:
    return document(
        {
            "policy": server_entry(model_port),
            "tools": server_entry(resources_port, "resources_servers"),
            "agent": server_entry(closed_port(), "responses_api_agents"),
        },
        observability_enabled=observability,
    )


async def test_nemo_gym_rollout_context_prefixes_calls(
    nemo_gym_path: Path, monkeypatch: pytest.MonkeyPatch, http_server
) -> None:
    monkeypatch.syspath_prepend(str(nemo_gym_path))
    monkeypatch.delitem(sys.modules, "nemo_gym", raising=False)
    monkeypatch.delitem(sys.modules, "nemo_gym.rollout_correlation", raising=False)
    nemo_rollouts = importlib.import_module("nemo_gym.rollout_correlation")

    resources, model = Seen(), Seen()
    client = client_for(observed_doc(await http_server(resources.app()), await http_server(model.app())))
    with nemo_rollouts.rollout_context("7-2"):
        await client.post("tools", "/seed_session", json={})
        await client.post("policy", "/v1/responses", json={})
        with rollout_context("own-1"):  # gym_rpc's own binding wins over NeMo Gym's
            await client.post("tools", "/verify", json={})
    await client.post("tools", "/verify", json={})  # nothing bound, no body rule: no prefix
    assert resources.paths == ["/ng-rollout/7-2/seed_session", "/ng-rollout/own-1/verify", "/verify"]
    assert model.paths == ["/ng-rollout/7-2/v1/responses"]


def test_nemo_gym_is_never_imported_by_gym_rpc(nemo_gym_path: Path) -> None:
    script = f"""
        import asyncio, sys
        sys.path.insert(0, {str(nemo_gym_path)!r})
        from omegaconf import OmegaConf
        from gym_rpc.client.server_client import ServerClient
        from gym_rpc.config import BaseServerConfig, ServerConfigLike
        entry = {{"host": "127.0.0.1", "port": 1}}
        doc = {{"observability_enabled": True, "tools": {{"resources_servers": {{"x": entry}}}}}}
        client = ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=1),
                              global_config_dict=OmegaConf.create(doc))
        async def call():
            try:
                await client.post("tools", "/verify", json={{"_ng_task_index": 1, "_ng_rollout_index": 2}},
                                  _resend_after_disconnect=False)
            except Exception:
                pass
            await client.aclose()
        asyncio.run(call())
        print(sorted(name for name in sys.modules if name.startswith("nemo_gym")))
    """
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60, check=True
    )
    assert run.stdout.strip() == "[]"


class RunBody(BaseModel):
    model_config = {"extra": "allow"}
    responses_create_params: dict[str, Any] = {}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"_ng_task_index": 3, "_ng_rollout_index": 1}, "/ng-rollout/3-1/verify"),
        ({"_ng_task_index": 3, "_ng_rollout_index": 1, "_ng_attempt_index": 2}, "/ng-rollout/3-1-a2/verify"),
        ({"_ng_task_index": 3, "_ng_rollout_index": 1, "_ng_attempt_index": 0}, "/ng-rollout/3-1/verify"),
        (
            {"_ng_rollout_id": "task.a_b-9", "_ng_task_index": 3, "_ng_rollout_index": 1},
            "/ng-rollout/task.a_b-9/verify",
        ),
        ({"_ng_task_index": 3}, "/verify"),
        ({"response": {}}, "/verify"),
        (RunBody.model_validate({"_ng_task_index": 4, "_ng_rollout_index": 0}), "/ng-rollout/4-0/verify"),
    ],
)
async def test_verify_takes_its_rollout_id_from_the_body(http_server, body: Any, expected: str) -> None:
    resources = Seen()
    client = client_for(observed_doc(await http_server(resources.app()), closed_port()))
    await client.post("tools", "/verify", json=body)
    assert resources.paths == [expected]


async def test_the_body_rule_applies_only_to_verify_with_observability(http_server) -> None:
    body = {"_ng_task_index": 3, "_ng_rollout_index": 1}
    resources = Seen()
    port = await http_server(resources.app())
    observed = client_for(observed_doc(port, closed_port()))
    await observed.post("tools", "/seed_session", json=body)
    with rollout_context("ctx"):
        await observed.post("tools", "/verify", json=body)  # a bound id wins over the body
    await client_for(observed_doc(port, closed_port(), observability=False)).post("tools", "/verify", json=body)
    assert resources.paths == ["/seed_session", "/ng-rollout/ctx/verify", "/verify"]


@pytest.mark.parametrize("bad", ["../x", "", ".hidden", 7])
async def test_a_malformed_explicit_rollout_id_is_refused(http_server, bad: Any) -> None:
    resources = Seen()
    client = client_for(observed_doc(await http_server(resources.app()), closed_port()))
    with pytest.raises(ValueError, match="_ng_rollout_id"):
        await client.post("tools", "/verify", json={"_ng_rollout_id": bad})
    assert resources.paths == []


# --- prefixes and trace context ---


def test_an_empty_rollout_id_means_no_rollout() -> None:
    assert rollout_path_prefix("") == ""
    assert rollout_path_prefix("", token_capture=True) == ""
    assert apply_rollout_prefix("http://h:1/", "") == "http://h:1/"
    assert apply_rollout_prefix("http://h:1/", None) == "http://h:1/"
    assert apply_rollout_prefix("http://h:1/v1/", None, token_capture=True) == "http://h:1/v1/"
    assert apply_rollout_prefix("http://h:1/", "r-1") == "http://h:1/ng-rollout/r-1"


async def test_an_empty_bound_rollout_id_adds_no_prefix(http_server) -> None:
    resources, model = Seen(), Seen()
    client = client_for(observed_doc(await http_server(resources.app()), await http_server(model.app())))
    with rollout_context(""):
        await client.post("tools", "/seed_session", json={})
        await client.post("policy", "/v1/responses", json={})
    assert resources.paths == ["/seed_session"]
    assert model.paths == ["/v1/responses"]


@pytest.mark.parametrize(
    ("gym_rpc_traces", "sampler", "segment"),
    [
        pytest.param(False, ALWAYS_ON, True, id="the application's sampled span, gym_rpc's tracing off"),
        pytest.param(False, ALWAYS_OFF, False, id="the application's unsampled span, gym_rpc's tracing off"),
        pytest.param(True, ALWAYS_ON, True, id="a sampled span, gym_rpc tracing"),
        pytest.param(True, ALWAYS_OFF, True, id="an unsampled span, gym_rpc tracing: carried on unsampled"),
    ],
)
def test_the_trace_segment_is_there_while_the_current_spans_trace_exports(
    monkeypatch: pytest.MonkeyPatch, gym_rpc_traces: bool, sampler: Sampler, segment: bool
) -> None:
    """NeMo Gym's rule, "while traces export": a span the application started under its own SDK TracerProvider
    puts its trace in the URL whenever it is sampled, even with gym_rpc's own call instrumentation off; an
    unsampled one only while gym_rpc traces (its "not sampled" carried on, as gym_rpc's calls carry it)."""
    monkeypatch.setattr(telemetry.TRACING, "enabled", gym_rpc_traces)
    provider = TracerProvider(sampler=sampler)
    with provider.get_tracer("application").start_as_current_span("the application's own span") as span:
        context = span.get_span_context()
        expected = f"/ng-trace/00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
        assert trace_context_path_segment() == (expected if segment else "")
        assert apply_rollout_prefix("http://h:1", "r") == "http://h:1/ng-rollout/r" + (expected if segment else "")
        assert apply_rollout_prefix("http://h:1", "r", trace_context=False) == "http://h:1/ng-rollout/r"
    assert trace_context_path_segment() == ""  # no span current: none, whatever else
    provider.shutdown()


# --- NEMO_GYM_MODEL_SERVER_BASE_URL in request() ---


async def test_request_honours_the_model_server_base_url(monkeypatch: pytest.MonkeyPatch, http_server) -> None:
    capture, resources = Seen(), Seen()
    capture_port = await http_server(capture.app())
    doc = observed_doc(await http_server(resources.app()), closed_port())  # the config's model port is dead
    client = client_for(doc)
    monkeypatch.setenv(MODEL_URL_ENV, f"http://{LOOPBACK}:{capture_port}/ng-rollout/sub-1/")
    monkeypatch.setenv(MODEL_NAME_ENV, "policy")
    await client.post("policy", "/v1/responses", json={})
    await client.post("tools", "/seed_session", json={})  # another server: from the config as before
    assert capture.paths == ["/ng-rollout/sub-1/v1/responses"]
    assert resources.paths == ["/seed_session"]
    assert get_server_url("policy") == f"http://{LOOPBACK}:{capture_port}/ng-rollout/sub-1/"


async def test_a_client_unpickled_in_a_harness_uses_its_model_server_base_url(
    monkeypatch: pytest.MonkeyPatch, http_server
) -> None:
    config_model, capture = Seen(), Seen()
    client = client_for(observed_doc(closed_port(), await http_server(config_model.app())))
    await client.post("policy", "/v1/responses", json={})  # the sender resolved (and cached) the config's URL
    monkeypatch.setenv(MODEL_URL_ENV, f"http://{LOOPBACK}:{await http_server(capture.app())}/ng-rollout/h-1")
    monkeypatch.setenv(MODEL_NAME_ENV, "policy")
    harness_copy = pickle.loads(pickle.dumps(client))
    await harness_copy.post("policy", "/v1/responses", json={})
    assert config_model.paths == ["/v1/responses"]
    assert capture.paths == ["/ng-rollout/h-1/v1/responses"]


# --- errors that are also the builtin types NeMo Gym raises ---


def test_an_unreachable_head_is_a_value_error() -> None:
    with pytest.raises(ValueError) as caught:
        ServerClient.load_from_global_config(
            head_server_config=BaseServerConfig(host=LOOPBACK, port=closed_port())
        )
    assert isinstance(caught.value, HeadUnreachableError)


async def test_an_unknown_server_is_a_key_error() -> None:
    client = client_for(document({"policy": server_entry(8000)}))
    with pytest.raises(KeyError) as caught:
        await client.post("nope", "/v1/responses", json={})
    assert isinstance(caught.value, UnknownServerError)
    with pytest.raises(KeyError):
        client._resolve_base_url("nope")


@pytest.mark.parametrize(
    ("host", "expected"),
    [("::", "[::1]"), ("[::]", "[::1]"), ("0.0.0.0", "127.0.0.1"), ("", "127.0.0.1"), ("node-7", "node-7")],
)
def test_connectable_client_host_is_ready_for_a_url(host: str, expected: str) -> None:
    assert _connectable_client_host(host) == expected
    assert ServerClient._client_host(host) == expected


# --- interpolations the client does not need ---


def interpolated_doc() -> dict[str, Any]:
    return document(
        {
            "policy": server_entry(8000, api_key=f"${{oc.env:{UNSET_ENV}}}"),
            "judge": server_entry(f"${{oc.env:{UNSET_ENV}}}"),  # type: ignore[arg-type]
            "copy": server_entry("${policy.responses_api_models.responses_api_models_impl.port}"),  # type: ignore[arg-type]
        },
        judge_settings={"key": f"${{oc.env:{UNSET_ENV}}}"},
    )


def test_unused_unresolvable_interpolations_do_not_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    client = client_for(interpolated_doc())
    assert client._resolve_base_url("policy") == "http://127.0.0.1:8000"
    assert client._resolve_base_url("copy") == "http://127.0.0.1:8000"  # a resolvable one is resolved
    with pytest.raises(ConfigError, match=rf"judge.*{UNSET_ENV}"):
        client._resolve_base_url("judge")  # needed and unresolvable: a clear error naming the server
    monkeypatch.setenv(CONFIG_ENV, yaml.safe_dump(interpolated_doc()))
    injected = ServerClient.load_from_global_config()
    assert injected._resolve_base_url("policy") == "http://127.0.0.1:8000"


# --- the upstream pool keys ---


def test_pool_defaults_match_upstream() -> None:
    settings = HttpClientSettings.from_document({})
    assert (settings.max_connections, settings.max_connections_per_host) == (102400, 1024)


async def test_upstream_pool_keys_are_honoured() -> None:
    doc = document(
        {"policy": server_entry(8000)},
        global_aiohttp_connector_limit=300,
        global_aiohttp_connector_limit_per_host=20,
    )
    client = client_for(doc)
    connector = client._http.sessions().data.connector
    assert connector is not None
    assert (connector.limit, connector.limit_per_host) == (300, 20)


def test_upstream_pool_keys_that_contradict_http_client_are_refused() -> None:
    doc = {"global_aiohttp_connector_limit": 300, "http_client": {"max_connections": 200}}
    with pytest.raises(ConfigError, match="global_aiohttp_connector_limit"):
        HttpClientSettings.from_document(doc)


# --- json= bodies as NeMo Gym sends them ---


async def test_json_bodies_are_serialised_as_nemo_gym_does(http_server) -> None:
    model = Seen()
    client = client_for(observed_doc(closed_port(), await http_server(model.app())))
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    await client.post("policy", "/v1/responses", json={"when": when, "score": float("nan"), "text": "é"})
    await client.post("policy", "/v1/responses", json={"a": 1}, headers={"X-Extra": "kept"})
    await client.post("policy", "/v1/responses", json=[])
    assert [(ctype, body) for _, ctype, body in model.requests] == [
        ("application/json", '{"when":"2026-01-02T03:04:05+00:00","score":null,"text":"é"}'.encode()),
        ("application/json", b'{"a":1}'),
        ("application/json", b"[]"),
    ]


async def test_json_and_data_together_are_refused() -> None:
    client = client_for(document({"policy": server_entry(closed_port())}))
    with pytest.raises(ValueError, match="data and json"):
        await client.post("policy", "/v1/responses", json={}, data=b"{}")


# --- setup_server_client never serves a stale config ---


async def test_setup_server_client_follows_a_head_reload(head_factory) -> None:
    doc = document({"policy": server_entry(8000)})
    head = await head_factory(doc)
    config = BaseServerConfig(host=LOOPBACK, port=head.port)
    first = await asyncio.to_thread(setup_server_client, config)
    assert await asyncio.to_thread(setup_server_client, config) is first  # unchanged: the same client
    assert head.config_path is not None
    head.config_path.write_text(yaml.safe_dump(document({"policy": server_entry(8001)})), encoding="utf-8")
    assert await head.reload()
    fresh = await asyncio.to_thread(setup_server_client, config)
    assert fresh._resolve_base_url("policy") == "http://127.0.0.1:8001"


def test_setup_server_client_follows_the_injected_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONFIG_ENV, json.dumps(document({"policy": server_entry(8000)})))
    assert setup_server_client()._resolve_base_url("policy") == "http://127.0.0.1:8000"
    monkeypatch.setenv(CONFIG_ENV, json.dumps(document({"policy": server_entry(8002)})))
    assert setup_server_client()._resolve_base_url("policy") == "http://127.0.0.1:8002"


def test_an_injected_config_without_head_server_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONFIG_ENV, json.dumps({"policy": server_entry(8000)}))
    with pytest.raises(ConfigError, match=f"head_server.*{CONFIG_ENV}|{CONFIG_ENV}.*head_server"):
        ServerClient.load_from_global_config()
    with pytest.raises(ConfigError, match="head_server"):
        ServerClient.load_head_server_config()
    explicit = ServerClient.load_from_global_config(BaseServerConfig(host=LOOPBACK, port=1))
    assert explicit._resolve_base_url("policy") == "http://127.0.0.1:8000"  # a given head needs no head_server


# --- poll_for_status with the head down ---


async def test_poll_for_status_probes_directly_when_the_head_is_down(
    http_server, silent_server: int, caplog: pytest.LogCaptureFixture
) -> None:
    doc = document(
        {
            "up": server_entry(await http_server()),
            "down": server_entry(closed_port()),
            "silent": server_entry(silent_server),
        }
    )
    client = client_for(doc)  # its head port is closed
    with caplog.at_level(logging.WARNING, logger="gym_rpc.client.server_client"):
        assert await asyncio.to_thread(client.poll_for_status, "up") == "success"
    assert "head" in caplog.text and "directly" in caplog.text
    assert await asyncio.to_thread(client.poll_for_status, "down") == "connection_error"
    assert await asyncio.to_thread(client.poll_for_status, "silent", 0.5) == "timeout"
    assert await asyncio.to_thread(client.poll_for_status, "head_server") == "connection_error"
    with pytest.raises(KeyError):
        await asyncio.to_thread(client.poll_for_status, "nope")
