"""`gym-rpc bridge` in front of an HTTP head speaking exactly NeMo Gym's wire format (written here with aiohttp):
the config as a JSON string literal of YAML, the /server_instances list, `{"status": "ok"}` at `/`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omegaconf import OmegaConf

from gym_rpc.client.control._channel import aio_channel
from gym_rpc.client.control._clients import ControlClient
from gym_rpc.client.control._credentials import ClientSecurity
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import HEAD_SERVER_KEY, REDACTED, BaseServerConfig
from gym_rpc.errors import ControlPlaneError, HeadUnreachableError
from gym_rpc.server._bridge import BridgeHead, BridgeOptions
from tests.support.bridge import (
    UPSTREAM_PID,
    UPSTREAM_START,
    upstream_document,
)
from tests.support.cli import STARTUP_SECONDS, run_cli, running_cli
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.security import Pki, tls_block, tls_client
from tests.support.waiting import eventually

T = TypeVar("T")
CALL_TIMEOUT = 2.0


def as_served_by(bridge: BridgeHead, doc: dict[str, Any]) -> dict[str, Any]:
    """The document the bridge serves for an upstream `doc`, written out: head_server is the bridge, and the one
    secret (policy_model's api_key) is redacted."""
    policy = doc["policy_model"]["responses_api_models"]["responses_api_models_impl"]
    assert policy["api_key"] == "sk-live-123"
    return {
        **doc,
        HEAD_SERVER_KEY: {"host": LOOPBACK, "port": bridge.port},
        "policy_model": {
            "responses_api_models": {"responses_api_models_impl": {**policy, "api_key": "<redacted>"}}
        },
    }


async def refusal(client: ControlClient) -> str:
    """The error message of GetGlobalConfig, "" when it succeeds."""
    try:
        await client.get_global_config(timeout=CALL_TIMEOUT)
    except HeadUnreachableError as exc:
        return str(exc)
    return ""


async def health_status(bridge: BridgeHead, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(aio_channel(bridge.address))
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT)
    return int(response.status)


async def test_bridge_serves_the_upstream_config_with_secrets_redacted(nemo_head, bridge_factory):
    upstream = await nemo_head(upstream_document(closed_port(), closed_port()))
    bridge = await bridge_factory(upstream.url)
    client = ControlClient(bridge.address)

    config = await client.get_global_config()
    head = await client.get_head_server_config()

    assert config.document == as_served_by(bridge, upstream.doc)
    assert config.version == bridge.config.version
    assert set(config.servers) == {"policy_model", "simple_agent"}
    assert config.checkpoint_enabled and config.observability_enabled
    assert config.document["policy_model"]["responses_api_models"]["responses_api_models_impl"]["api_key"] == (
        REDACTED
    )
    assert (head.host, head.port) == (LOOPBACK, bridge.port)
    assert await client.get_assistant_message_header("policy_model") == b"<|assistant|>"
    assert await health_status(bridge) == health_pb2.HealthCheckResponse.SERVING


async def test_bridge_probes_servers_itself_and_lists_upstream_processes(nemo_head, bridge_factory, http_server):
    live_port, dead_port = await http_server(), closed_port()
    upstream = await nemo_head(upstream_document(live_port, dead_port))
    bridge = await bridge_factory(upstream.url)
    client = ControlClient(bridge.address)

    snapshot = await eventually(
        client.list_server_statuses,
        lambda s: (
            {r.server_name: r.status for r in s.reports}
            == {"policy_model": "success", "simple_agent": "connection_error"}
        ),
        within=8.0,
    )
    instances = {i.name: i for i in await client.list_server_instances()}

    assert {r.url for r in snapshot.reports} == {
        f"http://{LOOPBACK}:{live_port}",
        f"http://{LOOPBACK}:{dead_port}",
    }
    assert (await client.get_server_status("policy_model")).status == "success"
    model = instances["policy_model"]
    assert (model.pid, model.start_time, model.status) == (UPSTREAM_PID, UPSTREAM_START, "success")
    assert model.impl_name == "responses_api_models_impl"
    assert instances[HEAD_SERVER_KEY].pid == os.getpid()  # the bridge answers for itself
    assert await health_status(bridge, "policy_model") == health_pb2.HealthCheckResponse.SERVING
    assert await health_status(bridge, "simple_agent") == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_upstream_down_is_unavailable_naming_it_then_recovers_on_restart(nemo_head, bridge_factory):
    upstream = await nemo_head(upstream_document(closed_port(), closed_port()))
    bridge = await bridge_factory(upstream.url)
    client = ControlClient(bridge.address)
    version = (await client.get_global_config()).version

    await upstream.stop()
    message = await eventually(lambda: refusal(client), bool, within=8.0)

    assert f"NeMo Gym head at {upstream.url} is unavailable" in message
    with pytest.raises(HeadUnreachableError, match=re.escape(upstream.url)):
        await client.list_server_instances(timeout=CALL_TIMEOUT)
    with pytest.raises(HeadUnreachableError, match=re.escape(upstream.url)):
        async for _ in client.watch_server_statuses(timeout=CALL_TIMEOUT):
            pass
    assert await health_status(bridge) == health_pb2.HealthCheckResponse.NOT_SERVING

    await upstream.start(upstream.port)  # the same head back on the same port
    await eventually(lambda: refusal(client), lambda m: m == "", within=8.0)

    assert (await client.get_global_config()).version == version
    assert await health_status(bridge) == health_pb2.HealthCheckResponse.SERVING


async def test_before_the_first_fetch_every_call_is_unavailable_not_a_crash(nemo_head, bridge_factory):
    port = closed_port()
    bridge = await bridge_factory(f"http://{LOOPBACK}:{port}")
    client = ControlClient(bridge.address)

    message = await refusal(client)

    assert f"NeMo Gym head at http://{LOOPBACK}:{port} is unavailable (no config fetched yet)" in message
    with pytest.raises(HeadUnreachableError, match="no config fetched yet"):
        await client.get_server_status("policy_model", timeout=CALL_TIMEOUT)

    upstream = await nemo_head(upstream_document(closed_port(), closed_port()), port=port)
    await eventually(lambda: refusal(client), lambda m: m == "", within=8.0)

    assert (await client.get_global_config()).document == as_served_by(bridge, upstream.doc)


async def test_a_changed_upstream_config_gives_a_new_version(nemo_head, bridge_factory, http_server):
    upstream = await nemo_head(upstream_document(closed_port(), closed_port()))
    bridge = await bridge_factory(upstream.url)
    client = ControlClient(bridge.address)
    before = await client.get_global_config()
    extra_port = await http_server()

    upstream.doc = {**upstream.doc, "example_resources": server_entry(extra_port, "resources_servers")}
    after = await eventually(client.get_global_config, lambda c: c.version != before.version, within=8.0)

    assert "example_resources" in after.servers
    assert after.document == as_served_by(bridge, upstream.doc)
    await eventually(
        lambda: client.get_server_status("example_resources", timeout=CALL_TIMEOUT),
        lambda r: r.status == "success",
        within=8.0,
    )


async def test_reload_fetches_from_the_upstream_at_once(nemo_head, bridge_factory):
    upstream = await nemo_head(upstream_document(closed_port(), closed_port()))
    bridge = await bridge_factory(upstream.url, refresh_interval_seconds=60.0)
    client = ControlClient(bridge.address)
    before = (await client.get_global_config()).version

    assert await client.reload_global_config() == (before, False)
    upstream.doc = {**upstream.doc, "checkpoint": {"enabled": False}}
    version, changed = await client.reload_global_config()

    assert changed and version != before
    assert not (await client.get_global_config()).checkpoint_enabled


async def test_a_malformed_upstream_answer_is_unavailable_with_the_reason(http_server, bridge_factory):
    async def not_yaml_text(request: web.Request) -> web.Response:
        return web.json_response(42)

    app = web.Application()
    app.router.add_get("/global_config_dict_yaml", not_yaml_text)
    bridge = await bridge_factory(f"http://{LOOPBACK}:{await http_server(app)}")

    message = await refusal(ControlClient(bridge.address))

    assert "answered a JSON int, not the config's YAML text" in message


async def test_a_silent_upstream_is_unavailable_within_the_fetch_timeout(silent_server, bridge_factory):
    started = time.monotonic()
    bridge = await bridge_factory(f"http://{LOOPBACK}:{silent_server}", fetch_timeout_seconds=0.3)

    assert time.monotonic() - started < 2.0  # start() waited one bounded fetch, not forever
    message = await refusal(ControlClient(bridge.address))

    assert "no answer in time" in message


def test_a_bridge_stopped_as_its_fetch_times_out_stops() -> None:
    """The teardown hang of the silent-upstream test (soak run B1, past pytest's 120 s): stop() cancelled the
    refresher in the loop iteration where aiohttp's fetch timeout fired, aiohttp took the cancel back (a
    TimeoutError instead: gym_rpc._tasks says how), the refresher counted a failed round and fetched on, and stop()
    waited for it forever. Here the loop is held still past the fetch's deadline (as pytest holds it between a test
    and its teardown), so the timeout fires in the iteration that runs stop()'s cancel."""
    fetch_timeout = 1.0
    loop = asyncio.new_event_loop()
    try:
        requests: asyncio.Queue[bytes] = asyncio.Queue()
        held: list[asyncio.StreamWriter] = []

        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            held.append(writer)  # never answered
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                await requests.put(await reader.readuntil(b"\r\n\r\n"))

        async def start() -> tuple[asyncio.Server, BridgeHead]:
            upstream = await asyncio.start_server(hold, LOOPBACK, 0)
            url = f"http://{LOOPBACK}:{upstream.sockets[0].getsockname()[1]}"
            options = BridgeOptions(
                upstream_url=url,
                host=LOOPBACK,
                port=0,
                refresh_interval_seconds=0.05,
                fetch_timeout_seconds=fetch_timeout,
            )
            bridge = BridgeHead(options)
            await bridge.start()  # its own first fetch, timed out
            await requests.get()
            await requests.get()  # the refresher's fetch is in flight: its timeout is 1 s away
            return upstream, bridge

        upstream, bridge = loop.run_until_complete(start())
        time.sleep(fetch_timeout + 0.2)  # the loop still: the fetch's timer is due when it turns again

        async def stop() -> None:
            try:
                # A hang guard only: stop() returns at once, or (before the fix) never.
                await asyncio.wait_for(asyncio.shield(bridge.stop()), 30)
            finally:
                for writer in held:
                    writer.close()
                upstream.close()

        loop.run_until_complete(stop())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def test_a_bridge_pointed_at_a_grpc_port_says_so_in_one_line(head_factory, bridge_factory, caplog):
    """Issue 14, item 13: the HTTP/2 bytes a gRPC port answers are never quoted raw."""
    head = await head_factory(document({}))
    bridge = await bridge_factory(f"http://{head.address}")

    message = await refusal(ControlClient(bridge.address))

    assert "the answer is not HTTP/1.1 (a gRPC port answers HTTP/2)" in message
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("gym_rpc") and r.levelno >= 30]
    assert warnings and all("not HTTP/1.1" in w for w in warnings), warnings
    assert not [t for t in [message, *warnings] if "\\x00" in t or "\n" in t]


async def test_server_client_loads_its_config_through_the_bridge(nemo_head, bridge_factory, http_server):
    live_port = await http_server()
    upstream = await nemo_head(upstream_document(live_port, closed_port()))
    bridge = await bridge_factory(upstream.url)
    head = BaseServerConfig(host=LOOPBACK, port=bridge.port)

    client = await asyncio.to_thread(ServerClient.load_from_global_config, head)
    try:
        status = await asyncio.to_thread(client.poll_for_status, "policy_model")
        response = await client.get("policy_model", "/")
        body = await response.json()
        response.release()
    finally:
        await client.aclose()

    loaded = OmegaConf.to_container(client.global_config_dict, resolve=True)
    assert loaded == as_served_by(bridge, upstream.doc)
    assert status == "success"
    assert body == {"status": "ok"}  # the data plane reached the server the bridge's config names
    assert client.checkpoint_enabled()
    assert client.assistant_message_header("policy_model") == b"<|assistant|>"


async def test_bridge_in_front_of_our_own_heads_http_endpoints(head_factory, bridge_factory):
    doc = upstream_document(closed_port(), closed_port())
    doc[HEAD_SERVER_KEY] = {"host": LOOPBACK, "port": 0}
    head = await head_factory(doc, http_port=0)
    bridge = await bridge_factory(f"http://{LOOPBACK}:{head.http_port}")

    config = await ControlClient(bridge.address).get_global_config()

    assert config.document == as_served_by(bridge, head.config.document)


async def test_cli_bridge_serves_gym_rpc_status_and_names_a_down_upstream(nemo_head, http_server):
    upstream = await nemo_head(upstream_document(await http_server(), closed_port()))
    args = ["bridge", "--upstream", upstream.url, "--listen", f"{LOOPBACK}:0", "--refresh-interval", "0.1"]
    args += ["--probe-interval", "0.1", "--probe-timeout", "0.5"]
    banner = re.compile(
        rf"^gym-rpc bridge listening on ({re.escape(LOOPBACK)}:\d+) \({re.escape(upstream.url)}, [^)]+\)$"
    )

    with running_cli(args) as bridge:
        address = (await asyncio.to_thread(bridge.wait_for_line, banner, STARTUP_SECONDS)).group(1)

        async def status_rows() -> dict[str, str]:
            args = ["status", "--head", address, "--json", "--allow-down", "simple_agent"]
            result = await asyncio.to_thread(run_cli, args)
            assert result.returncode == 0, result.stderr
            return {row["name"]: row["status"] for row in json.loads(result.stdout)}

        rows = await eventually(status_rows, lambda r: r.get("policy_model") == "success", within=8.0)
        assert rows["simple_agent"] == "connection_error"

        await upstream.stop()
        refused = await asyncio.to_thread(run_cli, ["status", "--head", address, "--timeout", "2"])
        assert refused.returncode == 3  # the control plane cannot answer: as if the head were unreachable
        assert f"NeMo Gym head at {upstream.url} is unavailable" in refused.stderr

        bridge.process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(bridge.wait, 10) == 0


# --- the bridge is the head's server: token, TLS, health port and watch bounds come with it ---


async def test_bridge_serves_tls_and_a_token_from_its_head_server_settings(
    nemo_head, bridge_factory, http_server, pki: Pki
):
    upstream = await nemo_head(upstream_document(await http_server(), closed_port()))
    own = {"auth_token": "bridge-token-0123456789", "tls": tls_block(pki), "health_port": 0}
    bridge = await bridge_factory(upstream.url, head_server=own)
    assert bridge.security.describe() == "TLS, token required"
    trusted = ControlClient(bridge.address, security=tls_client(pki, token="bridge-token-0123456789"))
    config = await trusted.get_global_config(timeout=CALL_TIMEOUT)
    assert set(config.servers) == {"policy_model", "simple_agent"}
    with pytest.raises(ControlPlaneError) as refused:  # TLS but no token
        await ControlClient(bridge.address, security=tls_client(pki)).list_server_statuses(timeout=CALL_TIMEOUT)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(HeadUnreachableError):  # plaintext to a TLS port
        await ControlClient(bridge.address, security=ClientSecurity()).list_server_statuses(timeout=CALL_TIMEOUT)

    assert bridge.health_port not in (None, 0, bridge.port)
    async with grpc.aio.insecure_channel(f"{LOOPBACK}:{bridge.health_port}") as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_bridge_bounds_its_watches(nemo_head, bridge_factory, http_server):
    upstream = await nemo_head(upstream_document(await http_server(), closed_port()))
    bridge = await bridge_factory(upstream.url, max_concurrent_watches=1)
    client = ControlClient(bridge.address)
    first = client.watch_server_statuses(heartbeat_seconds=0.1)
    assert (await asyncio.wait_for(anext(first), 5)).kind == "snapshot"
    with pytest.raises(ControlPlaneError) as refused:
        await asyncio.wait_for(anext(client.watch_server_statuses()), 5)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    await first.aclose()


def test_cli_bridge_takes_where_and_how_it_serves_from_a_config_file(tmp_path: Path) -> None:
    own = tmp_path / "bridge.yaml"
    own.write_text(f"head_server: {{host: {LOOPBACK}, port: 0, auth_token: bridge-file-token-42}}\n", "utf-8")
    upstream = f"http://{LOOPBACK}:{closed_port()}"
    args = [
        "bridge",
        "--upstream",
        upstream,
        "--listen",
        f"{LOOPBACK}:0",
        "--config",
        str(own),
        "--max-watches",
        "3",
    ]
    with running_cli(args) as bridge:
        line = bridge.wait_for_line(re.compile(r"listening on"), STARTUP_SECONDS)
    assert re.fullmatch(
        rf"gym-rpc bridge listening on {LOOPBACK}:\d+ \({upstream}, plaintext, token required\)", line.string
    )


async def test_sighup_makes_the_bridge_fetch_at_once(nemo_head, http_server):
    """README: "ReloadGlobalConfig or SIGHUP fetch at once": with an hour between scheduled fetches, a changed
    upstream config is served right after SIGHUP."""
    upstream = await nemo_head(upstream_document(await http_server(), closed_port()))
    args = ["bridge", "--upstream", upstream.url, "--listen", f"{LOOPBACK}:0", "--refresh-interval", "3600"]
    banner = re.compile(rf"^gym-rpc bridge listening on ({re.escape(LOOPBACK)}:\d+) ")

    with running_cli(args) as bridge:
        address = (await asyncio.to_thread(bridge.wait_for_line, banner, STARTUP_SECONDS)).group(1)
        client = ControlClient(address)
        before = await client.get_global_config()
        assert "example_resources" not in before.servers
        upstream.doc = {
            **upstream.doc,
            "example_resources": server_entry(await http_server(), "resources_servers"),
        }

        bridge.process.send_signal(signal.SIGHUP)

        after = await eventually(client.get_global_config, lambda c: c.version != before.version, within=8.0)
        assert list(after.servers) == ["policy_model", "simple_agent", "example_resources"]
        bridge.process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(bridge.wait, 10) == 0
