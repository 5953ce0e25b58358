"""Errors quote at most a few hundred characters of what the caller sent (issue 26, point 9), against a real
`gym-rpc head`: a 4 MiB server name (it came back twice before, 8.4 MB of trailers) on the gRPC port, a 60 KiB one
on the Connect port (whose requests stop at 64 KiB), and the other names a caller can choose (a health service, a
model server, a registration's host, a JSON field). A config with hundreds of long server names still answers an
unknown name with a NOT_FOUND every client can read.
"""

from __future__ import annotations

import http.client
import json
import re
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.errors import UnknownServerError
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.v1 import control_plane_pb2_grpc as pb_grpc
from tests.support.cli import running_head
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port

HUGE = "x" * (4 * 1024 * 1024 - 1024)  # just inside the head's 4 MiB request bound
ANSWER_BOUND = 4096  # bytes of details and trailers an error may come back with


def answer_size(error: grpc.aio.AioRpcError) -> int:
    trailers: Any = error.trailing_metadata() or ()
    return len((error.details() or "").encode()) + sum(len(key) + len(value) for key, value in trailers)


def write_config(tmp_path: Path, servers: dict[str, dict]) -> Path:
    path = tmp_path / "gym.yaml"
    path.write_text(yaml.safe_dump(document(servers)), encoding="utf-8")
    return path


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def test_a_4_mib_name_comes_back_as_a_few_hundred_bytes_on_the_grpc_port(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"policy": server_entry(closed_port(), host="0.0.0.0")})
    with running_head(config) as head:
        async with grpc.aio.insecure_channel(head.address) as channel:
            stub = pb_grpc.ControlPlaneServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            register = pb.RegisterServerInstanceRequest(
                server_name="policy", listen_port=8001, advertise_host=HUGE
            )
            calls = {
                "GetServerStatus": stub.GetServerStatus(pb.GetServerStatusRequest(server_name=HUGE), timeout=30),
                "GetAssistantMessageHeader": stub.GetAssistantMessageHeader(
                    pb.GetAssistantMessageHeaderRequest(model_server_name=HUGE), timeout=30
                ),
                "RegisterServerInstance": stub.RegisterServerInstance(register, timeout=30),
                "DeregisterServerInstance": stub.DeregisterServerInstance(
                    pb.DeregisterServerInstanceRequest(server_name=HUGE, pid=1), timeout=30
                ),
                "Health/Check": health.Check(health_pb2.HealthCheckRequest(service=HUGE), timeout=30),
            }
            for method, call in calls.items():
                error = await refused(call)
                assert error.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), method
                assert answer_size(error) < ANSWER_BOUND, (method, answer_size(error))
                assert f"({len(HUGE)} characters)" in (error.details() or ""), method  # says it was cut
        # The typed error still names what was asked for, as far as it was quoted.
        with pytest.raises(UnknownServerError) as unknown:
            await ControlClient(head.address).get_server_status(HUGE, timeout=30)
        assert unknown.value.server_name == HUGE[:200] and sorted(unknown.value.known) == ["head_server", "policy"]


def connect_port(banner: str) -> int:
    match = re.search(r"Connect on http://127\.0\.0\.1:(\d+)", banner)
    assert match, banner
    return int(match.group(1))


def connect_call(port: int, method: str, body: dict[str, Any]) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=30)
    try:
        connection.request(
            "POST",
            f"/gym_rpc.v1.ControlPlaneService/{method}",
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        answer = connection.getresponse()
        return answer.status, answer.read() + str(answer.headers).encode()
    finally:
        connection.close()


def test_a_long_name_comes_back_as_a_few_hundred_bytes_on_the_connect_port(tmp_path: Path) -> None:
    long_name = "y" * (60 * 1024)
    config = write_config(tmp_path, {"policy": server_entry(closed_port())})
    with running_head(config, "--connect-port", "0") as head:
        port = connect_port(head.banner)
        calls: list[tuple[str, dict[str, Any]]] = [
            ("GetServerStatus", {"serverName": long_name}),
            ("GetAssistantMessageHeader", {"modelServerName": long_name}),
            ("GetServerStatus", {long_name: 1}),  # an unknown JSON field: the parser's error names it
        ]
        for method, body in calls:
            status, answer = connect_call(port, method, body)
            assert status in (400, 404), (method, status, answer[:300])
            assert len(answer) < ANSWER_BOUND, (method, len(answer))


async def test_hundreds_of_long_server_names_still_make_a_readable_not_found(tmp_path: Path) -> None:
    port = closed_port()
    servers = {f"server_{i:03d}_{'n' * 100}": server_entry(port) for i in range(300)}  # 300 x 110 characters
    with running_head(write_config(tmp_path, servers)) as head:
        with pytest.raises(UnknownServerError) as unknown:
            await ControlClient(head.address).get_server_status("nope", timeout=30)
        message = str(unknown.value)
        assert "unknown server 'nope'" in message and len(message) < 2_000
        assert 1 <= len(unknown.value.known) < 20 and set(unknown.value.known) < {*servers, "head_server"}
