"""The head under attack and careless operation, on loopback: no silent open door, no traceback for a client's bad
bytes, reloads validated exactly as start-up, and every refusal one line (issue 14, items 1, 4, 6, 9, 11, 12, 13).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_rpc.client.control._clients import ControlClient, SyncControlClient
from gym_rpc.client.control._credentials import ClientSecurity
from gym_rpc.errors import ConfigError, ControlPlaneError
from gym_rpc.server._head import HeadServer
from gym_rpc.wire import TOKEN_ENV_VAR
from tests.support.cli import STARTUP_SECONDS, run_cli, running_head
from tests.support.documents import BILLION_LAUGHS, document, server_entry
from tests.support.loopback import LOOPBACK

TOKEN = "tok-9d1e-hardening-never-printed"
SERVICE = "/gym_rpc.v1.ControlPlaneService/"
GARBAGE = b"\xff\xff\xff\xff\x0f"  # a varint that never ends: no protobuf message decodes from it


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def config_path(head: HeadServer) -> Path:
    assert head.config_path is not None
    return head.config_path


def rewrite(head: HeadServer, doc: dict[str, Any] | str) -> None:
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False)
    config_path(head).write_text(text, encoding="utf-8")


async def reload_refused(head: HeadServer, token: str | None = None) -> str:
    """ReloadGlobalConfig answers FAILED_PRECONDITION; the message it gives."""
    client = ControlClient(head.address, security=ClientSecurity(token=token))
    with pytest.raises(ControlPlaneError) as caught:
        await client.reload_global_config(timeout=10)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION, str(caught.value)
    return str(caught.value)


# --- item 1: a blank or placeholder token never opens the head ---


@pytest.mark.parametrize(
    "auth_token", ["", "   ", "<redacted>", "${oc.env:GYM_RPC_TEST_UNSET_TOKEN,''}", "<token>"]
)
def test_blank_or_placeholder_auth_token_stops_the_head(tmp_path: Path, auth_token: str) -> None:
    path = tmp_path / "head.yaml"
    path.write_text(
        yaml.safe_dump({"head_server": {"host": LOOPBACK, "port": 0, "auth_token": auth_token}}), encoding="utf-8"
    )
    result = run_cli(["head", "--config", str(path), "--port", "0"])
    line = assert_one_line_error(result, str(path), "head_server.auth_token", "remove the key")
    assert "<token>" not in line  # the value itself is never echoed


def test_placeholder_token_in_the_environment_stops_the_head() -> None:
    result = run_cli(["head", "--port", "0"], env={TOKEN_ENV_VAR: "<redacted>"})
    assert_one_line_error(result, TOKEN_ENV_VAR, "placeholder")


async def test_a_reload_to_a_placeholder_token_is_refused_and_the_token_still_guards(head_factory) -> None:
    doc = document({}, head_server={"host": LOOPBACK, "port": 0, "auth_token": TOKEN})
    head = await head_factory(doc)
    rewrite(head, {**doc, "head_server": {"host": LOOPBACK, "port": 0, "auth_token": "<redacted>"}, "x": 1})
    message = await reload_refused(head, token=TOKEN)
    assert "head_server.auth_token is a placeholder" in message and str(config_path(head)) in message
    with pytest.raises(ControlPlaneError, match="UNAUTHENTICATED"):
        await ControlClient(head.address).get_global_config(timeout=5)


# --- item 4: undecodable requests ---


async def raw_call(address: str, method: str, payload: bytes, token: str | None) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    async with grpc.aio.insecure_channel(address) as channel:
        if method.endswith("WatchServerStatuses"):
            call = channel.unary_stream(method, None, None)(payload, metadata=metadata, timeout=5)
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK
        try:
            await channel.unary_unary(method, None, None)(payload, metadata=metadata, timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK


async def test_malformed_protobuf_is_unauthenticated_or_invalid_argument_without_a_traceback(
    head_factory, caplog
) -> None:
    head = await head_factory(document({}, head_server={"host": LOOPBACK, "port": 0, "auth_token": TOKEN}))
    caplog.set_level(logging.INFO)
    methods = [SERVICE + "GetServerStatus", SERVICE + "WatchServerStatuses", SERVICE + "ReloadGlobalConfig"]
    for method in methods:
        assert await raw_call(head.address, method, GARBAGE, None) == grpc.StatusCode.UNAUTHENTICATED
        assert await raw_call(head.address, method, GARBAGE, TOKEN) == grpc.StatusCode.INVALID_ARGUMENT
    assert await raw_call(head.address, "/grpc.health.v1.Health/Check", GARBAGE, None) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    # 200 bad calls (in bursts below the 128 streams a connection may carry) cost at most one short INFO line
    # each, and not one ERROR or traceback.
    codes = []
    async with grpc.aio.insecure_channel(head.address) as channel:
        bad = channel.unary_unary(SERVICE + "GetServerStatus", None, None)
        for _ in range(4):
            codes += await asyncio.gather(
                *(bad(GARBAGE, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10) for _ in range(50)),
                return_exceptions=True,
            )
    assert {c.code() if isinstance(c, grpc.aio.AioRpcError) else c for c in codes} == {
        grpc.StatusCode.INVALID_ARGUMENT
    }
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert all("\n" not in r.getMessage() for r in caplog.records)
    assert TOKEN not in caplog.text
    # And the head still answers well-formed calls.
    check = health_pb2.HealthCheckRequest(service="")
    async with grpc.aio.insecure_channel(head.address) as channel:
        answer = await channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )(check, timeout=5)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


# --- items 6, 9, 11, 12: reloads are bounded and validated as start-up ---


async def test_reload_of_a_billion_laughs_is_refused_in_bounded_time(head_factory) -> None:
    head = await head_factory(document({}))
    old_version = head.config.version
    rewrite(head, BILLION_LAUGHS)
    message = await reload_refused(head)
    assert "aliases expanded" in message
    assert head.config.version == old_version
    assert (await ControlClient(head.address).get_global_config(timeout=5)).version == old_version


def test_sighup_with_a_billion_laughs_keeps_the_head_answering(tmp_path: Path) -> None:
    """The bomb through SIGHUP, to a real `gym-rpc head`: refused in one log line, the control plane answering."""
    path = tmp_path / "head.yaml"
    path.write_text(yaml.safe_dump({"head_server": {"host": LOOPBACK, "port": 0}}), encoding="utf-8")
    with running_head(path) as head:
        client = SyncControlClient(head.address, timeout_seconds=10.0)
        version = client.get_global_config().version
        path.write_text(BILLION_LAUGHS, encoding="utf-8")
        head.process.send_signal(signal.SIGHUP)
        head.wait_for_stderr("aliases expanded", STARTUP_SECONDS)
        assert client.get_global_config().version == version
        assert client.head_status() == "success"
        assert head.process.poll() is None
    (refused,) = [line for line in head.stderr_text.splitlines() if "reload" in line]
    assert f"config reload from {path} refused, old config kept" in refused
    assert "Traceback" not in head.stderr_text


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("model_name: café\n".encode("latin-1"), ":1: not UTF-8 text"),
        (("a: " + "[" * 3000 + "]" * 3000 + "\n").encode(), "nested more than 100 levels deep"),
    ],
    ids=["non-utf8", "deep"],
)
async def test_reload_of_a_non_utf8_or_deep_file_is_one_clear_line(
    head_factory, caplog, content: bytes, needle: str
) -> None:
    head = await head_factory(document({}))
    config_path(head).write_bytes(content)
    message = await reload_refused(head)
    assert str(config_path(head)) in message and needle in message
    assert "Unexpected" not in message and "\n" not in message
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_reload_validates_tls_exactly_as_start_up(head_factory, tmp_path: Path) -> None:
    head = await head_factory(document({}))
    rewrite(head, document({}, head_server={"host": LOOPBACK, "port": 0, "tls": {}}))
    message = await reload_refused(head)
    assert "head_server.tls needs cert_file and key_file" in message
    with pytest.raises(ConfigError, match=r"head_server\.tls needs cert_file and key_file"):
        await head_factory(document({}, head_server={"host": LOOPBACK, "port": 0, "tls": {}}))


async def test_a_reload_that_would_drop_a_live_server_by_a_typo_is_refused(head_factory, http_server) -> None:
    port = await http_server()
    doc = document({"policy": server_entry(port), "other": server_entry(port)})
    head = await head_factory(doc)
    typo = {**doc, "policy": {"responses_api_models": {"impl": {"hots": LOOPBACK, "port": port}}}}
    rewrite(head, typo)
    message = await reload_refused(head)
    assert "server 'policy' is served but its new entry is malformed (responses_api_models.impl has no host)" in (
        message
    )
    assert set(head.config.servers) == {"policy", "other"}
    # Deleting the key is explicit: that reload goes through.
    rewrite(head, document({"other": server_entry(port)}))
    _, changed = await ControlClient(head.address).reload_global_config(timeout=10)
    assert changed and set(head.config.servers) == {"other"}


async def test_malformed_entries_are_warned_about_at_start(head_factory, caplog) -> None:
    caplog.set_level(logging.WARNING)
    await head_factory(document({"two": {"responses_api_models": {"a": {"port": 1}, "b": {"port": 2}}}}))
    assert "config entry 'two' is not served: responses_api_models has 2 implementations (a, b)" in caplog.text


# --- item 13: TLS files that are not what they claim ---


def test_a_garbage_certificate_stops_the_head_with_one_line_naming_the_files(tmp_path: Path) -> None:
    cert, key = tmp_path / "head.pem", tmp_path / "head.key"
    cert.write_text("not a certificate\n")
    key.write_text("not a key\n")
    path = tmp_path / "tls.yaml"
    tls = {"cert_file": str(cert), "key_file": str(key)}
    path.write_text(yaml.safe_dump({"head_server": {"host": LOOPBACK, "port": 0, "tls": tls}}), encoding="utf-8")
    result = run_cli(["head", "--config", str(path), "--port", "0"])
    assert_one_line_error(result, str(path), str(cert), str(key), "not a PEM certificate chain")


# --- item 15: grpc.health.v1.Health/List ---


async def test_health_list_names_every_server_and_the_head(head_factory, http_server, caplog) -> None:
    live = await http_server()
    head = await head_factory(document({"policy": server_entry(live)}))
    serving = health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(head.address) as channel:
        for _ in range(100):  # the prober probes every 0.1 s; wait (at most 10 s) until it saw the server up
            listed = await health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=5)
            if listed.statuses["policy"].status == serving:
                break
            await asyncio.sleep(0.1)
    assert {name: answer.status for name, answer in listed.statuses.items()} == {
        "": serving,
        "gym_rpc.v1.ControlPlaneService": serving,
        "policy": serving,
    }
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
