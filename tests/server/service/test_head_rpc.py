"""The head's unary RPCs against a real head on loopback: config, reload, statuses, instances, headers, errors."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from gym_rpc.client.control._clients import ControlClient, SyncControlClient
from gym_rpc.config import REDACTED
from gym_rpc.errors import ControlPlaneError, UnknownServerError
from gym_rpc.server._head import HeadServer
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import SERVER_STATUSES
from tests.support.documents import document, server_entry
from tests.support.heads import raw_stub, rewrite_config, wait_until_probed
from tests.support.loopback import LOOPBACK, closed_port

# --- helpers ---------------------------------------------------------------------------------------------------


async def answer_500(request: web.Request) -> web.Response:
    return web.Response(status=500, text="boom")


# --- config ----------------------------------------------------------------------------------------------------

SECRETS = ("sk-live-123", "tok-456", "hunter2", "shh-789", "sk-entry-000")


def rich_document(port: int) -> dict[str, Any]:
    """Every JSON shape a config holds, in a deliberately unsorted key order, with secrets sprinkled in."""
    return document(
        {
            "policy_model": server_entry(
                port,
                model="Qwen/Qwen3-8B",
                max_tokens=4096,
                openai_api_key=SECRETS[4],
                sampling={"temperature": 0.7, "top_p": 1.0, "stop": ["</s>", "<|im_end|>"]},
            )
        },
        zeta=1,
        alpha={"int": 7, "big": 2**53 + 1, "negative": -3, "zero": 0},
        floats={"tenth": 0.1, "pi": 3.141592653589793, "tiny": 1e-07, "whole": 2.0},
        flags={"yes": True, "no": False, "nothing": None},
        nested=[[1, [2, [3]]], {"b": [{"c": 1}], "a": []}, "text"],
        ключ="значение",
        日本語={"値": "テスト ✓", "emoji": "🚀"},
        checkpoint={"enabled": True},
        observability_enabled=True,
        max_tokens=512,
        tokenizer="Qwen/Qwen3-8B",
        api_key=SECRETS[0],
        database={"token": SECRETS[1], "password": SECRETS[2], "client_secret": SECRETS[3], "user": "gym"},
    )


def expected_served(doc: dict[str, Any], head: HeadServer) -> dict[str, Any]:
    """What the head serves: the document with the bound head port and secret values redacted."""
    served: dict[str, Any] = json.loads(json.dumps(doc))
    served["head_server"] = {"host": LOOPBACK, "port": head.port}
    served["api_key"] = REDACTED
    served["database"].update(token=REDACTED, password=REDACTED, client_secret=REDACTED)
    served["policy_model"]["responses_api_models"]["responses_api_models_impl"]["openai_api_key"] = REDACTED
    return served


async def test_config_round_trip_is_exact(head_factory, http_server):
    doc = rich_document(await http_server())
    head = await head_factory(doc)
    expected = expected_served(doc, head)

    response = await raw_stub(head).GetGlobalConfig(pb.GetGlobalConfigRequest(), timeout=5)
    # Byte-exact JSON: same values, same types (ints stay ints), same key order at every level, unicode as is.
    assert response.config_json == json.dumps(expected, ensure_ascii=False)
    assert response.version == head.config.version
    assert response.checkpoint_enabled and response.observability_enabled
    assert (response.head_server.host, response.head_server.port) == (LOOPBACK, head.port)

    config = await ControlClient(head.address).get_global_config()
    assert config.document == expected
    assert json.dumps(config.document, ensure_ascii=False) == response.config_json  # order survives the client
    alpha = config.document["alpha"]
    assert type(alpha["int"]) is int and type(alpha["big"]) is int and alpha["big"] == 2**53 + 1
    assert type(config.document["floats"]["whole"]) is float
    assert config.document["max_tokens"] == 512  # "token" inside a word is not a secret
    assert config.document["日本語"]["emoji"] == "🚀"
    assert config.checkpoint_enabled and config.observability_enabled
    entry = config.servers["policy_model"]
    assert (entry.server_type, entry.impl_name, entry.port) == (
        "responses_api_models",
        "responses_api_models_impl",
        doc["policy_model"]["responses_api_models"]["responses_api_models_impl"]["port"],
    )
    assert entry.config["sampling"]["stop"] == ["</s>", "<|im_end|>"]


async def test_secrets_are_redacted_everywhere(head_factory, http_server):
    head = await head_factory(rich_document(await http_server()))
    response = await raw_stub(head).GetGlobalConfig(pb.GetGlobalConfigRequest(), timeout=5)

    served = json.loads(response.config_json)
    assert served["api_key"] == REDACTED
    assert served["database"] == {
        "token": REDACTED,
        "password": REDACTED,
        "client_secret": REDACTED,
        "user": "gym",
    }
    (entry,) = response.servers
    entry_config = json.loads(entry.config_json)
    assert entry_config["openai_api_key"] == REDACTED
    assert entry_config["max_tokens"] == 4096
    assert (entry.name, entry.url) == ("policy_model", head.config.servers["policy_model"].url)
    for secret in SECRETS:
        assert secret not in response.config_json
        assert secret not in entry.config_json
        assert secret not in response.SerializeToString().decode("utf-8", "replace")


async def test_head_server_config_reports_the_bound_port(head_factory):
    head = await head_factory(document({}))
    assert head.port != 0
    head_config = await ControlClient(head.address).get_head_server_config()
    assert (head_config.host, head_config.port) == (LOOPBACK, head.port)
    sync_config = await asyncio.to_thread(SyncControlClient(head.address).get_head_server_config)
    assert sync_config.port == head.port


# --- reload ----------------------------------------------------------------------------------------------------


async def test_version_changes_on_reload_and_not_otherwise(head_factory, http_server):
    doc = document({"live": server_entry(await http_server())}, setting=1)
    head = await head_factory(doc)
    client = ControlClient(head.address)
    first = (await client.get_global_config()).version

    await wait_until_probed(head)  # statuses changing is not a config change
    assert (await client.get_global_config()).version == first
    assert await client.reload_global_config() == (first, False)  # same file, same version
    assert (await client.get_global_config()).version == first

    rewrite_config(head, {**doc, "setting": 2})
    version, changed = await client.reload_global_config()
    assert changed and version != first
    config = await client.get_global_config()
    assert (config.version, config.document["setting"]) == (version, 2)
    assert config.document["head_server"]["port"] == head.port  # the bound port survives a reload


async def test_malformed_reload_is_refused_and_old_config_kept(head_factory):
    doc = document({}, setting=1)
    head = await head_factory(doc)
    client = ControlClient(head.address)
    before = await client.get_global_config()

    assert head.config_path is not None
    head.config_path.write_text("setting: 2\nbroken: [1, 2\n", encoding="utf-8")
    with pytest.raises(ControlPlaneError) as refused:
        await client.reload_global_config()
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(head.config_path) in str(refused.value)
    assert head.address in str(refused.value)

    after = await client.get_global_config()
    assert (after.version, after.document["setting"]) == (before.version, 1)


async def test_reload_adds_and_removes_servers(head_factory, http_server):
    live = await http_server()
    doc = document({"first": server_entry(live)})
    head = await head_factory(doc)
    client = ControlClient(head.address)
    assert [r.server_name for r in (await client.list_server_statuses()).reports] == ["first"]

    rewrite_config(
        head, document({"first": server_entry(live), "second": server_entry(live, "resources_servers")})
    )
    assert (await client.reload_global_config())[1] is True
    await wait_until_probed(head)
    statuses = {r.server_name: r.status for r in (await client.list_server_statuses()).reports}
    assert statuses == {"first": "success", "second": "success"}
    assert "second" in (await client.get_global_config()).servers

    rewrite_config(head, document({"second": server_entry(live, "resources_servers")}))
    assert (await client.reload_global_config())[1] is True
    assert [r.server_name for r in (await client.list_server_statuses()).reports] == ["second"]
    with pytest.raises(UnknownServerError):
        await client.get_server_status("first")


# --- statuses --------------------------------------------------------------------------------------------------


async def test_every_status_value_is_reached(head_factory, http_server, silent_server, malformed_server):
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer_500)
    doc = document(
        {
            "live": server_entry(await http_server()),
            "failing": server_entry(await http_server(app), "resources_servers"),
            "closed": server_entry(closed_port(), "resources_servers"),
            "silent": server_entry(silent_server, "responses_api_agents"),
            "malformed": server_entry(malformed_server, "resources_servers"),
        }
    )
    head = await head_factory(doc)
    client = ControlClient(head.address)

    live = await client.get_server_status("live")
    assert (live.status, live.http_status) == ("success", 200)
    assert live.checked_at > 0 and live.latency_seconds > 0
    failing = await client.get_server_status("failing")
    assert (failing.status, failing.http_status) == ("success", 500)  # any HTTP answer is success
    closed = await client.get_server_status("closed")
    closed_port_number = doc["closed"]["resources_servers"]["resources_servers_impl"]["port"]
    assert (closed.status, closed.detail) == (
        "connection_error",
        f"[Errno 111] Connect call failed ('127.0.0.1', {closed_port_number})",
    )
    malformed = await client.get_server_status("malformed")
    assert (malformed.status, malformed.http_status) == ("unknown_error", 0)
    assert malformed.detail.startswith('ClientResponseError: 400, message="Bad status line'), malformed.detail
    assert "NOT-HTTP nonsense" in malformed.detail  # what the server sent, for the operator
    own = await client.get_server_status("head_server")
    assert (own.status, own.url) == ("success", f"http://{LOOPBACK}:{head.port}")

    # An answer at all proves the head answered within the caller's 1 s deadline: gRPC would have raised
    # DEADLINE_EXCEEDED instead of returning a report (no wall-clock bound needed, none to flake).
    silent = await client.get_server_status("silent", timeout=1.0)
    assert silent.status == "timeout"
    reached = {report.status for report in (live, failing, closed, malformed, silent)}
    assert reached == set(SERVER_STATUSES) == {"success", "connection_error", "timeout", "unknown_error"}

    report = await asyncio.to_thread(SyncControlClient(head.address).get_server_status, "closed")
    assert report.status == "connection_error"


async def test_max_age_serves_the_cached_report(head_factory, http_server):
    # A long interval: one probe round at start, then the cache only changes when a call probes.
    head = await head_factory(document({"live": server_entry(await http_server())}), probe_interval_seconds=60)
    (cached,) = await wait_until_probed(head)
    client = ControlClient(head.address)

    from_cache = await client.get_server_status("live", max_age_seconds=60)
    assert from_cache.checked_at == pytest.approx(cached.checked_at, abs=1e-6)
    assert head.prober.report("live") is cached

    within_window = await client.get_server_status("live")  # no bound: the head's window, half of 60 s
    assert within_window.checked_at == pytest.approx(cached.checked_at, abs=1e-6)

    fresh = await client.get_server_status("live", max_age_seconds=0)  # zero: a probe now
    assert fresh.status == "success"
    assert fresh.checked_at > cached.checked_at
    assert head.prober.report("live").checked_at == pytest.approx(fresh.checked_at, abs=1e-6)

    await asyncio.sleep(0.05)
    too_old = await client.get_server_status("live", max_age_seconds=0.01)  # cache older than allowed: probe
    assert too_old.checked_at > fresh.checked_at


async def test_list_server_statuses_with_200_servers(head_factory, http_server):
    live_ports = [await http_server() for _ in range(4)]
    dead_port = closed_port()
    servers = {f"live_{i:03d}": server_entry(live_ports[i % 4]) for i in range(150)}
    servers |= {f"dead_{i:03d}": server_entry(dead_port, "resources_servers") for i in range(50)}
    head = await head_factory(document(servers), probe_interval_seconds=60, probe_timeout_seconds=3.0)
    await wait_until_probed(head, deadline_seconds=10.0)  # the one round the long interval allows

    snapshot = await ControlClient(head.address).list_server_statuses()
    assert [r.server_name for r in snapshot.reports] == list(servers)  # all 200, in config order
    statuses = {r.server_name: r.status for r in snapshot.reports}
    assert {statuses[n] for n in servers if n.startswith("live_")} == {"success"}
    assert {statuses[n] for n in servers if n.startswith("dead_")} == {"connection_error"}
    assert all(r.checked_at > 0 for r in snapshot.reports)
    assert snapshot.revision == head.prober.revision


# --- errors ----------------------------------------------------------------------------------------------------


async def test_unknown_server_is_not_found_naming_it(head_factory, http_server):
    head = await head_factory(document({"policy": server_entry(await http_server())}))
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await raw_stub(head).GetServerStatus(pb.GetServerStatusRequest(server_name="nonexistent"), timeout=5)
    assert raw.value.code() == grpc.StatusCode.NOT_FOUND
    details = raw.value.details() or ""
    assert "nonexistent" in details and "policy" in details and "head_server" in details
    # The known names travel as a standard google.rpc.Status detail, readable by any gRPC client.
    rich = rpc_status.from_call(raw.value)  # type: ignore[arg-type]  # an AioRpcError has what a Call has
    assert rich is not None and rich.code == grpc.StatusCode.NOT_FOUND.value[0]
    info = error_details_pb2.ErrorInfo()
    assert rich.details[0].Unpack(info)
    assert (info.domain, info.reason) == ("gym-rpc", "UNKNOWN_SERVER")
    assert dict(info.metadata) == {"server_name": "nonexistent", "known_servers": "policy,head_server"}

    client = ControlClient(head.address)
    with pytest.raises(UnknownServerError) as typed:
        await client.get_server_status("nonexistent")
    assert typed.value.server_name == "nonexistent"
    assert typed.value.known == ["policy", "head_server"]
    assert isinstance(typed.value.__cause__, grpc.aio.AioRpcError)  # the original error is kept
    with pytest.raises(UnknownServerError) as header_typed:
        await client.get_assistant_message_header("nonexistent")
    assert header_typed.value.known == ["policy", "head_server"]
    with pytest.raises(UnknownServerError):
        await asyncio.to_thread(SyncControlClient(head.address).get_server_status, "nonexistent")


async def test_empty_server_name_is_invalid_argument(head_factory):
    head = await head_factory(document({}))
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await raw_stub(head).GetServerStatus(pb.GetServerStatusRequest(), timeout=5)
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ControlPlaneError) as typed:
        await ControlClient(head.address).get_server_status("")
    assert typed.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert not isinstance(typed.value, UnknownServerError)


# --- instances -------------------------------------------------------------------------------------------------


async def test_list_server_instances_head_first(head_factory, http_server):
    doc = document(
        {
            "policy": server_entry(await http_server()),
            "env": server_entry(closed_port(), "resources_servers"),
        }
    )
    head = await head_factory(doc)
    await wait_until_probed(head)
    instances = await ControlClient(head.address).list_server_instances()

    own, *servers = instances
    assert (own.name, own.server_type, own.pid) == ("head_server", "head_server", os.getpid())
    assert own.start_time == pytest.approx(head.start_time, abs=1e-6)
    assert 0 < own.start_time <= time.time()
    assert own.url == f"http://{LOOPBACK}:{head.port}" and own.status == "success"
    rows = [(i.name, i.server_type, i.impl_name, i.url, i.status) for i in servers]
    assert rows == [
        (
            "policy",
            "responses_api_models",
            "responses_api_models_impl",
            head.config.servers["policy"].url,
            "success",
        ),
        ("env", "resources_servers", "resources_servers_impl", head.config.servers["env"].url, "connection_error"),
    ]


# --- assistant message header ----------------------------------------------------------------------------------


def harness(model_server: str, **extra: Any) -> dict:
    """An agent entry whose model_server names `model_server` (a closed port: it is never called)."""
    ref = {"type": "responses_api_models", "name": model_server}
    return server_entry(closed_port(), "responses_api_agents", model_server=ref, **extra)


async def test_assistant_message_header_from_agent_entry(head_factory):
    doc = document(
        {
            "policy": server_entry(closed_port()),
            "judge": server_entry(closed_port()),
            "math_agent": harness("policy", assistant_message_header="<|im_start|>assistant\n"),
            "code_agent": harness("policy", assistant_message_header="<|im_start|>assistant\n"),
            "judge_agent": harness("judge"),
        }
    )
    head = await head_factory(doc)
    client = ControlClient(head.address)
    assert await client.get_assistant_message_header("policy") == b"<|im_start|>assistant\n"
    assert await client.get_assistant_message_header("judge") is None
    sync = SyncControlClient(head.address)
    assert await asyncio.to_thread(sync.get_assistant_message_header, "policy") == b"<|im_start|>assistant\n"


async def test_assistant_message_header_disagreement_is_failed_precondition(head_factory):
    doc = document(
        {
            "policy": server_entry(closed_port()),
            "math_agent": harness("policy", assistant_message_header="<|im_start|>assistant\n"),
            "code_agent": harness("policy", assistant_message_header="<|assistant|>"),
        }
    )
    head = await head_factory(doc)
    with pytest.raises(ControlPlaneError) as refused:
        await ControlClient(head.address).get_assistant_message_header("policy")
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "math_agent" in str(refused.value) and "code_agent" in str(refused.value)


async def test_assistant_message_header_from_harness_package(head_factory, tmp_path: Path, monkeypatch):
    module_name = "gym_rpc_test_light_harness"
    package_dir = tmp_path / "harnesses"
    package_dir.mkdir()
    (package_dir / f"{module_name}.py").write_text('ASSISTANT_MESSAGE_HEADER = b"<start_of_turn>model\\n"\n')
    monkeypatch.syspath_prepend(str(package_dir))
    doc = document(
        {
            "policy": server_entry(closed_port()),
            "light_agent": harness("policy", harness_package=module_name),
        }
    )
    head = await head_factory(doc)
    try:
        assert (
            await ControlClient(head.address).get_assistant_message_header("policy") == b"<start_of_turn>model\n"
        )
    finally:
        sys.modules.pop(module_name, None)
