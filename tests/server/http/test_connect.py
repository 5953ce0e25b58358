"""The control plane over the Connect protocol: a real head with `connect_port`, called over real HTTP/1.1 by
aiohttp and curl. JSON and binary bodies, unary and server-streaming calls (envelopes and the end-of-stream
message), errors as Connect's JSON with code names, the same token, TLS and redaction rules as the gRPC port.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from google.rpc import error_details_pb2

from gym_rpc.errors import GymRpcError
from gym_rpc.server import HeadServer, ServerSecurity
from gym_rpc.server.http._connect import SERVICE, ConnectServer, endpoints
from gym_rpc.server.security._auth import UNAUTHENTICATED_MESSAGE
from gym_rpc.server.service._servicer import ControlPlaneServicer
from gym_rpc.v1 import control_plane_pb2 as pb
from tests.support import REPO_ROOT
from tests.support.bridge import BridgeFactory, NemoHeadFactory, upstream_document
from tests.support.cli import running_head
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.security import API_KEY, Pki, tls_block

PREFIX = "/gym_rpc.v1.ControlPlaneService"
TOKEN = "connect-token-8a7b"
JSON = {"Content-Type": "application/json"}
STREAM_JSON = {"Content-Type": "application/connect+json"}
STREAM_PROTO = {"Content-Type": "application/connect+proto"}
END_OF_STREAM = 0x02
CALL_SECONDS = 10.0

needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")

HeadFactory = Callable[..., Awaitable[HeadServer]]


def connect_url(head: HeadServer) -> str:
    assert head.connect_url is not None, "the head serves no Connect port"
    return head.connect_url


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=CALL_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        yield session


async def call_json(
    http: aiohttp.ClientSession, head: HeadServer, method: str, body: dict[str, Any], **headers: str
) -> tuple[int, dict[str, Any]]:
    async with http.post(
        f"{connect_url(head)}{PREFIX}/{method}", json=body, headers={**JSON, **headers}
    ) as answer:
        return answer.status, await answer.json()


def envelope(payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">BI", flags, len(payload)) + payload


async def read_envelope(stream: aiohttp.StreamReader) -> tuple[int, bytes]:
    flags, size = struct.unpack(">BI", await stream.readexactly(5))
    return flags, await stream.readexactly(size)


async def wait_for_statuses(
    http: aiohttp.ClientSession, head: HeadServer, expected: dict[str, str], **headers: str
) -> dict[str, Any]:
    """Poll ListServerStatuses over Connect until the prober reports the expected statuses (bounded)."""
    async with asyncio.timeout(CALL_SECONDS):
        while True:
            status, answer = await call_json(http, head, "ListServerStatuses", {}, **headers)
            assert status == 200, answer
            if {r["serverName"]: r.get("status") for r in answer.get("reports", [])} == expected:
                return answer
            await asyncio.sleep(0.05)


async def run_curl(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        "curl", "--silent", "--show-error", "--max-time", "10", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=20)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


def two_servers(answering_port: int, refused_port: int, **head_keys: Any) -> dict[str, Any]:
    doc = document(
        {
            "policy": server_entry(answering_port, api_key=API_KEY),
            "tools": server_entry(refused_port, "resources_servers"),
        }
    )
    doc["head_server"].update(head_keys)
    return doc


EXPECTED = {"policy": "SERVER_STATUS_SUCCESS", "tools": "SERVER_STATUS_CONNECTION_ERROR"}


def test_every_rpc_of_the_contract_is_routed_to_the_servicer_method_of_its_name() -> None:
    routes = endpoints(ControlPlaneServicer(head=None))  # type: ignore[arg-type]
    assert sorted(routes) == sorted(f"{PREFIX}/{method.name}" for method in SERVICE.methods)
    watch = routes[f"{PREFIX}/WatchServerStatuses"]
    assert (watch.method.input, watch.method.output) == (
        pb.WatchServerStatusesRequest,
        pb.WatchServerStatusesResponse,
    )
    assert watch.method.stream_type.name == "SERVER_STREAM"
    assert routes[f"{PREFIX}/GetGlobalConfig"].method.stream_type.name == "UNARY"


README = REPO_ROOT / "docs" / "other-languages.md"  # "curl, over Connect"
README_CONNECT_ADDRESS = "http://127.0.0.1:11002"  # the docs' example head_server.connect_port


@needs_curl
def test_curl_lists_server_statuses_with_the_readme_command(tmp_path: Path) -> None:
    """`gym-rpc head --connect-port 0` announces its Connect URL; the README's curl line, pointed there, answers
    the statuses as JSON."""
    command = next(
        line
        for line in README.read_text().splitlines()
        if line.startswith("curl ") and "ListServerStatuses" in line
    )
    assert command == (
        f"curl -H 'Content-Type: application/json' -d '{{}}' "
        f"{README_CONNECT_ADDRESS}/gym_rpc.v1.ControlPlaneService/ListServerStatuses"
    )
    tools_port = closed_port()
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(document({"tools": server_entry(tools_port, "resources_servers")})))
    with running_head(config, "--connect-port", "0") as head:
        url = head.banner.split("; Connect on ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        shell_line = command.replace(README_CONNECT_ADDRESS, url) + " --silent --max-time 10"
        for _ in range(200):  # until the first probe round has reported the refused server (bounded)
            answer = json.loads(
                subprocess.run(
                    shell_line, shell=True, capture_output=True, text=True, timeout=20, check=True
                ).stdout
            )
            if answer.get("reports"):
                break
            time.sleep(0.05)
    assert [(r["serverName"], r["status"]) for r in answer["reports"]] == [
        ("tools", "SERVER_STATUS_CONNECTION_ERROR")
    ]
    assert int(answer["revision"]) > 0


async def test_unary_json_answers_in_the_protobuf_json_mapping(
    head_factory: HeadFactory, http_server, http
) -> None:
    head = await head_factory(two_servers(await http_server(), closed_port()), connect_port=0)
    listed = await wait_for_statuses(http, head, EXPECTED)
    assert int(listed["revision"]) > 0
    status, config = await call_json(http, head, "GetGlobalConfig", {"includeSecrets": True})
    assert status == 200
    policy = json.loads(config["configJson"])["policy"]["responses_api_models"]["responses_api_models_impl"]
    assert policy["api_key"] == "<redacted>"  # no token configured: nobody is authenticated, nobody gets secrets
    assert config["headServer"] == {"host": LOOPBACK, "port": head.port}
    assert [s["name"] for s in config["servers"]] == ["policy", "tools"]
    assert config["version"] == head.config.version


async def test_binary_protobuf_unary_call(head_factory: HeadFactory, http_server, http) -> None:
    head = await head_factory(two_servers(await http_server(), closed_port()), connect_port=0)
    request = pb.GetServerStatusRequest(server_name="tools").SerializeToString()
    url = f"{connect_url(head)}{PREFIX}/GetServerStatus"
    async with http.post(url, data=request, headers={"Content-Type": "application/proto"}) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Type"] == "application/proto"
        report = pb.GetServerStatusResponse.FromString(await answer.read()).report
    assert (report.server_name, report.status) == ("tools", pb.SERVER_STATUS_CONNECTION_ERROR)


async def test_errors_are_connect_json_with_code_names(head_factory: HeadFactory, http) -> None:
    head = await head_factory(document({"tools": server_entry(closed_port())}), connect_port=0)
    status, error = await call_json(http, head, "GetServerStatus", {"serverName": "nope"})
    assert status == 404
    message = "unknown server 'nope'; known servers: head_server, tools"
    assert (error["code"], error["message"]) == ("not_found", message)
    # The known names as the gRPC port sends them: a google.rpc.ErrorInfo detail, here Connect's own.
    (detail,) = error["details"]
    assert detail["type"] == "google.rpc.ErrorInfo"
    info = error_details_pb2.ErrorInfo.FromString(base64.b64decode(detail["value"] + "=="))
    assert (info.reason, dict(info.metadata)) == (
        "UNKNOWN_SERVER",
        {"server_name": "nope", "known_servers": "tools,head_server"},
    )
    status, error = await call_json(http, head, "GetServerStatus", {})
    assert (status, error) == (400, {"code": "invalid_argument", "message": "server_name is required"})
    status, error = await call_json(http, head, "RegisterServerInstance", {"serverName": "tools", "listenPort": 0})
    assert (status, error) == (400, {"code": "invalid_argument", "message": "listen_port must be in 1..65535"})
    url = f"{connect_url(head)}{PREFIX}/GetGlobalConfig"
    async with http.post(url, data=b"{not json", headers=JSON) as answer:
        assert answer.status == 400
        assert (await answer.json())["code"] == "invalid_argument"
    async with http.post(f"{connect_url(head)}{PREFIX}/NoSuchMethod", data=b"{}", headers=JSON) as answer:
        assert answer.status == 404


async def test_register_over_connect_advertises_the_callers_address(head_factory: HeadFactory, http) -> None:
    """The servicer reads the caller's address (gRPC's peer) through the Connect context too; a registration that
    asks for no lease gets the head's default one (issue 43: "forever" is no default)."""
    head = await head_factory(document({"tools": server_entry(closed_port(), host="0.0.0.0")}), connect_port=0)
    status, answer = await call_json(
        http,
        head,
        "RegisterServerInstance",
        {"serverName": "tools", "pid": 42, "listenHost": "0.0.0.0", "listenPort": 8123},
    )
    assert (status, answer) == (
        200,
        {"advertisedUrl": "http://127.0.0.1:8123", "instanceId": "127.0.0.1:8123", "leaseTtl": "300s"},
    )


async def test_watch_stream_json_envelopes_then_end_of_stream(head_factory: HeadFactory, http) -> None:
    head = await head_factory(document({"tools": server_entry(closed_port())}), connect_port=0)
    request = envelope(json.dumps({"heartbeatInterval": "0.05s"}).encode())
    url = f"{connect_url(head)}{PREFIX}/WatchServerStatuses"
    headers = {**STREAM_JSON, "Connect-Timeout-Ms": "1500"}
    messages: list[dict[str, Any]] = []
    async with http.post(url, data=request, headers=headers) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Type"] == "application/connect+json"
        while True:
            flags, payload = await read_envelope(answer.content)
            if flags & END_OF_STREAM:
                end = json.loads(payload)
                break
            messages.append(json.loads(payload))
    assert messages[0]["type"] == "WATCH_EVENT_TYPE_SNAPSHOT"
    assert {m["type"] for m in messages[1:]} <= {"WATCH_EVENT_TYPE_HEARTBEAT", "WATCH_EVENT_TYPE_CHANGE"}
    assert "WATCH_EVENT_TYPE_HEARTBEAT" in {m["type"] for m in messages[1:]}
    assert end["error"]["code"] == "deadline_exceeded"


async def test_watch_stream_binary_frees_its_slot_when_the_caller_leaves(head_factory: HeadFactory, http) -> None:
    """With one watch allowed, a second is refused in its end-of-stream message; once the first caller goes
    away, the servicer's clean-up runs and a new watch is served."""
    head = await head_factory(
        document({"tools": server_entry(closed_port())}), connect_port=0, max_concurrent_watches=1
    )
    url = f"{connect_url(head)}{PREFIX}/WatchServerStatuses"
    request = envelope(pb.WatchServerStatusesRequest().SerializeToString())
    async with http.post(url, data=request, headers=STREAM_PROTO) as first:
        flags, payload = await read_envelope(first.content)
        assert flags == 0
        assert pb.WatchServerStatusesResponse.FromString(payload).type == pb.WATCH_EVENT_TYPE_SNAPSHOT
        async with http.post(url, data=request, headers=STREAM_PROTO) as second:
            flags, payload = await read_envelope(second.content)
        assert flags == END_OF_STREAM
        assert json.loads(payload)["error"]["code"] == "resource_exhausted"
        first.close()  # the caller goes away mid-stream
    async with asyncio.timeout(CALL_SECONDS):
        while True:  # the head notices the closed connection on its own schedule
            async with http.post(url, data=request, headers=STREAM_PROTO) as third:
                flags, payload = await read_envelope(third.content)
            if flags == 0:
                break
            await asyncio.sleep(0.05)
    assert pb.WatchServerStatusesResponse.FromString(payload).type == pb.WATCH_EVENT_TYPE_SNAPSHOT


async def test_token_rules_and_redaction_are_the_grpc_ports(head_factory: HeadFactory, http_server, http) -> None:
    head = await head_factory(two_servers(await http_server(), closed_port(), auth_token=TOKEN), connect_port=0)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        status, error = await call_json(http, head, "ListServerStatuses", {}, **headers)
        assert (status, error) == (401, {"code": "unauthenticated", "message": UNAUTHENTICATED_MESSAGE})
    url = f"{connect_url(head)}{PREFIX}/WatchServerStatuses"
    async with http.post(url, data=envelope(b"{}"), headers=STREAM_JSON) as answer:
        flags, payload = await read_envelope(answer.content)
    assert (flags, json.loads(payload)["error"]["code"]) == (END_OF_STREAM, "unauthenticated")

    bearer = {"Authorization": f"bearer {TOKEN}"}  # the scheme's case does not matter, as on the gRPC port
    status, redacted = await call_json(http, head, "GetGlobalConfig", {"includeSecrets": False}, **bearer)
    assert status == 200
    assert (
        json.loads(redacted["configJson"])["policy"]["responses_api_models"]["responses_api_models_impl"][
            "api_key"
        ]
        == "<redacted>"
    )
    status, full = await call_json(http, head, "GetGlobalConfig", {"includeSecrets": True}, **bearer)
    document_with_secrets = json.loads(full["configJson"])
    assert (
        document_with_secrets["policy"]["responses_api_models"]["responses_api_models_impl"]["api_key"] == API_KEY
    )
    assert document_with_secrets["head_server"]["auth_token"] == "<redacted>"  # never handed out


@needs_curl
async def test_tls_and_mutual_tls_from_head_server_tls(head_factory: HeadFactory, pki: Pki) -> None:
    head = await head_factory(
        document({}, head_server={"host": LOOPBACK, "port": 0, "tls": tls_block(pki), "auth_token": TOKEN}),
        connect_port=0,
    )
    url = f"{connect_url(head)}{PREFIX}/GetHeadServerConfig"
    assert url.startswith("https://127.0.0.1:")
    auth = ["-H", f"Authorization: Bearer {TOKEN}", "-H", "Content-Type: application/json", "-d", "{}"]
    code, out, err = await run_curl("--cacert", str(pki.ca), *auth, url)
    assert code == 0, err
    assert json.loads(out) == {"headServer": {"host": LOOPBACK, "port": head.port}}
    code, _, _ = await run_curl("--cacert", str(pki.other_ca), *auth, url)
    assert code == 60  # curl: the server's certificate is not trusted
    code, out, _ = await run_curl(*auth, url.replace("https://", "http://"))
    assert (code != 0, out) == (True, "")  # no plaintext answer on the TLS port

    mutual = await head_factory(
        document({}, head_server={"host": LOOPBACK, "port": 0, "tls": tls_block(pki, mutual=True)}), connect_port=0
    )
    url = f"{connect_url(mutual)}{PREFIX}/GetHeadServerConfig"
    json_body = ["-H", "Content-Type: application/json", "-d", "{}"]
    code, out, err = await run_curl("--cacert", str(pki.ca), *json_body, url)
    assert (code != 0, out) == (True, "")  # no client certificate: refused in the handshake
    client_cert = ["--cert", str(pki.client_cert), "--key", str(pki.client_key)]
    code, out, err = await run_curl("--cacert", str(pki.ca), *client_cert, *json_body, url)
    assert code == 0, err
    assert json.loads(out)["headServer"]["port"] == mutual.port


async def test_the_bridge_serves_connect_with_its_own_token(
    nemo_head: NemoHeadFactory, bridge_factory: BridgeFactory, http_server, http
) -> None:
    """`gym-rpc bridge --connect-port`: the upstream's servers over Connect, guarded by the bridge's own token,
    redacted, and watched as a stream, as on the bridge's gRPC port."""
    upstream = await nemo_head(upstream_document(await http_server(), closed_port()))
    bridge = await bridge_factory(upstream.url, connect_port=0, head_server={"auth_token": TOKEN})
    status, error = await call_json(http, bridge, "ListServerStatuses", {})
    assert (status, error["code"]) == (401, "unauthenticated")
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    expected = {"policy_model": "SERVER_STATUS_SUCCESS", "simple_agent": "SERVER_STATUS_CONNECTION_ERROR"}
    await wait_for_statuses(http, bridge, expected, **bearer)
    api_keys = []
    for include_secrets in (False, True):  # only a caller with the token gets secrets, and only when it asks
        status, config = await call_json(
            http, bridge, "GetGlobalConfig", {"includeSecrets": include_secrets}, **bearer
        )
        assert (status, config["headServer"]) == (200, {"host": LOOPBACK, "port": bridge.port})
        served = json.loads(config["configJson"])
        api_keys.append(served["policy_model"]["responses_api_models"]["responses_api_models_impl"]["api_key"])
    assert api_keys == ["<redacted>", "sk-live-123"]
    url = f"{connect_url(bridge)}{PREFIX}/WatchServerStatuses"
    async with http.post(url, data=envelope(b"{}"), headers={**STREAM_JSON, **bearer}) as answer:
        flags, payload = await read_envelope(answer.content)
    snapshot = json.loads(payload)
    assert (flags, snapshot["type"]) == (0, "WATCH_EVENT_TYPE_SNAPSHOT")
    assert {r["serverName"]: r["status"] for r in snapshot["reports"]} == expected


async def test_uvicorn_logs_only_its_warnings(head_factory: HeadFactory, caplog: pytest.LogCaptureFixture) -> None:
    """The head's startup line announces the Connect port; uvicorn's own INFO lines ("Started server process",
    "Shutting down", under the logger "uvicorn.error") would only mislead an operator."""
    caplog.set_level(logging.INFO)
    head = await head_factory(document({"tools": server_entry(closed_port())}), connect_port=0)
    await head.stop()
    assert [record.getMessage() for record in caplog.records if record.name.startswith("uvicorn")] == []


async def test_stop_ends_open_watch_streams_within_the_grace_period(head_factory: HeadFactory, http) -> None:
    head = await head_factory(document({"tools": server_entry(closed_port())}), connect_port=0)
    url = f"{connect_url(head)}{PREFIX}/WatchServerStatuses"
    async with http.post(url, data=envelope(b"{}"), headers=STREAM_JSON) as answer:
        flags, _ = await read_envelope(answer.content)
        assert flags == 0
        async with asyncio.timeout(CALL_SECONDS):  # grace 0.5 s, then uvicorn cancels; never a hang
            await head.stop()
            with pytest.raises((aiohttp.ClientPayloadError, asyncio.IncompleteReadError, ConnectionError)):
                while True:
                    flags, _ = await read_envelope(answer.content)
                    if flags & END_OF_STREAM:
                        raise ConnectionError("ended with end-of-stream")


async def test_a_busy_connect_port_fails_the_start_with_a_clear_error(head_factory: HeadFactory) -> None:
    with socket.socket() as listening:
        listening.bind((LOOPBACK, 0))
        listening.listen()
        busy = listening.getsockname()[1]
        with pytest.raises(GymRpcError, match=rf"cannot serve Connect on 127.0.0.1:{busy}: .*connect_port"):
            await head_factory(document({}), connect_port=busy)


async def test_connect_server_stop_before_start_is_harmless() -> None:
    servicer = ControlPlaneServicer(head=None)  # type: ignore[arg-type]
    await ConnectServer(servicer, ServerSecurity(), shutdown_grace_seconds=0.1).stop()
