"""Standard grpc.health.v1 and server reflection on a real head, through the stock stubs (as grpcurl would)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gym_rpc.server._head import HeadServer
from gym_rpc.v1 import control_plane_pb2 as pb
from tests.support.documents import document, server_entry
from tests.support.loopback import closed_port
from tests.support.servers import start_stoppable_server
from tests.support.waiting import eventually

SERVICE = "gym_rpc.v1.ControlPlaneService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
async def channels() -> AsyncIterator[list[grpc.aio.Channel]]:
    """Plain channels (no gym_rpc options), closed after the test."""
    opened: list[grpc.aio.Channel] = []
    yield opened
    for channel in opened:
        await channel.close(None)


def open_channel(channels: list[grpc.aio.Channel], head: HeadServer) -> grpc.aio.Channel:
    channel = grpc.aio.insecure_channel(head.address)
    channels.append(channel)
    return channel


async def check(stub: health_pb2_grpc.HealthStub, service: str) -> int:
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(response.status)


async def wait_for_health(
    stub: health_pb2_grpc.HealthStub, service: str, status: int, timeout: float = 5.0
) -> None:
    await eventually(
        lambda: check(stub, service),
        lambda current: current == status,
        within=timeout,
        what=f"{service!r} {status}",
        every=0.02,
    )


async def read_until_status(
    responses: AsyncIterator[health_pb2.HealthCheckResponse], status: int, timeout: float = 5.0
) -> list[int]:
    """Statuses a health Watch sends, up to and including `status`."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while not seen or seen[-1] != status:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"health watch never reported {status}; saw {seen}"
        response = await asyncio.wait_for(anext(responses), remaining)
        seen.append(response.status)
    return seen


# --- health ----------------------------------------------------------------------------------------------------


async def test_check_serves_the_head_and_follows_the_prober(head_factory, http_server, channels):
    head = await head_factory(
        document({"live": server_entry(await http_server()), "closed": server_entry(closed_port())})
    )
    stub = health_pb2_grpc.HealthStub(open_channel(channels, head))
    assert await check(stub, "") == SERVING
    assert await check(stub, SERVICE) == SERVING
    await wait_for_health(stub, "live", SERVING)
    await wait_for_health(stub, "closed", NOT_SERVING)
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await check(stub, "no_such_server")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_watch_on_a_server_sees_it_stop(head_factory, channels):
    runner, port = await start_stoppable_server()
    try:
        head = await head_factory(document({"live": server_entry(port)}))
        stub = health_pb2_grpc.HealthStub(open_channel(channels, head))
        call = stub.Watch(health_pb2.HealthCheckRequest(service="live"), timeout=10)
        responses = aiter(call)
        await read_until_status(responses, SERVING)  # possibly UNKNOWN first, before the first probe
        await runner.cleanup()
        assert await read_until_status(responses, NOT_SERVING) == [NOT_SERVING]
        call.cancel()
    finally:
        await runner.cleanup()


async def test_shutdown_reports_not_serving_then_refuses(head_factory, channels):
    head = await head_factory(document({}))
    stub = health_pb2_grpc.HealthStub(open_channel(channels, head))
    responses = aiter(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10))
    assert await read_until_status(responses, SERVING) == [SERVING]

    stopping = asyncio.create_task(head.stop())
    assert await read_until_status(responses, NOT_SERVING, timeout=2.0) == [NOT_SERVING]  # within the grace
    await asyncio.wait_for(stopping, 5.0)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await check(stub, "")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


# --- reflection ------------------------------------------------------------------------------------------------


async def reflect(
    channel: grpc.aio.Channel, request: reflection_pb2.ServerReflectionRequest
) -> reflection_pb2.ServerReflectionResponse:
    """One request/response exchange on the reflection stream."""
    call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=5)
    await call.write(request)
    await call.done_writing()
    async for response in call:
        return response
    raise AssertionError("the reflection stream ended without an answer")


async def test_reflection_lists_and_describes_the_service(head_factory, channels):
    head = await head_factory(document({}))
    channel = open_channel(channels, head)

    listed = await reflect(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {service.name for service in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names

    found = await reflect(channel, reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE))
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in found.file_descriptor_response.file_descriptor_proto
    ]
    (control_plane,) = [f for f in files if f.package == "gym_rpc.v1"]
    (service,) = control_plane.service
    expected = pb.DESCRIPTOR.services_by_name["ControlPlaneService"]
    assert service.name == expected.name
    assert [m.name for m in service.method] == [m.name for m in expected.methods]


async def test_reflection_can_be_turned_off(head_factory, channels):
    head = await head_factory(document({}), reflection=False)
    channel = open_channel(channels, head)
    with pytest.raises(grpc.aio.AioRpcError) as off:
        await reflect(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
    assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert await check(health_pb2_grpc.HealthStub(channel), SERVICE) == SERVING  # the rest is still served
