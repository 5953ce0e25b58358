"""Every RPC of the generated ControlPlaneService has a servicer handler and a wrapper on both control clients.

Adding an RPC to the .proto and regenerating must fail here until the head serves it and the clients expose it.
"""

from __future__ import annotations

import inspect
import re

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message_factory import GetMessageClass

from gym_rpc.client._control import ControlClient, SyncControlClient
from gym_rpc.server._servicer import ControlPlaneServicer
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.v1 import control_plane_pb2_grpc as pb_grpc
from tests.conftest import document

SERVICE = pb.DESCRIPTOR.services_by_name["ControlPlaneService"]
METHODS: list[MethodDescriptor] = list(SERVICE.methods)


def snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def unimplemented_handlers(servicer: type) -> list[str]:
    """RPCs whose handler on `servicer` is still the generated base's UNIMPLEMENTED one."""
    base = pb_grpc.ControlPlaneServiceServicer
    return [m.name for m in METHODS if getattr(servicer, m.name) is getattr(base, m.name)]


def missing_wrappers(client: type) -> list[str]:
    return [snake_case(m.name) for m in METHODS if not callable(getattr(client, snake_case(m.name), None))]


def test_the_service_has_rpcs():
    assert len(METHODS) >= 8
    assert snake_case("GetHeadServerConfig") == "get_head_server_config"


def test_every_rpc_has_a_servicer_handler():
    assert unimplemented_handlers(ControlPlaneServicer) == []
    # The check itself can fail: the generated base implements nothing.
    assert unimplemented_handlers(pb_grpc.ControlPlaneServiceServicer) == [m.name for m in METHODS]


def test_servicer_has_no_handler_outside_the_service():
    """A misspelt handler would never be called; every public CamelCase method must be an RPC."""
    handlers = {
        name for name, _ in inspect.getmembers(ControlPlaneServicer, inspect.isfunction) if name[0].isupper()
    }
    assert handlers == {m.name for m in METHODS}


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_handler_kind_matches_the_rpc(method: MethodDescriptor):
    handler = getattr(ControlPlaneServicer, method.name)
    if method.server_streaming:
        assert inspect.isasyncgenfunction(handler), method.name
    else:
        assert inspect.iscoroutinefunction(handler), method.name


@pytest.mark.parametrize("client", [SyncControlClient, ControlClient])
def test_every_rpc_has_a_client_wrapper(client: type):
    assert missing_wrappers(client) == []
    assert missing_wrappers(object) == [snake_case(m.name) for m in METHODS]  # the check can fail


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_wrapper_kind_matches_the_rpc(method: MethodDescriptor):
    """Streaming RPCs are iterated, unary ones called (and awaited on the asyncio client)."""
    sync_wrapper = getattr(SyncControlClient, snake_case(method.name))
    aio_wrapper = getattr(ControlClient, snake_case(method.name))
    if method.server_streaming:
        assert inspect.isgeneratorfunction(sync_wrapper)
        assert inspect.isasyncgenfunction(aio_wrapper)
    else:
        assert not inspect.isgeneratorfunction(sync_wrapper) and not inspect.iscoroutinefunction(sync_wrapper)
        assert inspect.iscoroutinefunction(aio_wrapper)


async def test_a_real_head_answers_every_rpc(head_factory):
    """Each RPC, sent with an empty request over the wire, gets anything but UNIMPLEMENTED."""
    head = await head_factory(document({}))
    async with grpc.aio.insecure_channel(head.address) as channel:
        for method in METHODS:
            path = f"/{SERVICE.full_name}/{method.name}"
            request_class = GetMessageClass(method.input_type)
            encode, decode = request_class.SerializeToString, GetMessageClass(method.output_type).FromString
            request = request_class()  # empty: every field at its default
            try:
                if method.server_streaming:
                    call = channel.unary_stream(path, encode, decode)(request, timeout=5)
                    async for _ in call:  # one message is enough
                        break
                    call.cancel()
                else:
                    await channel.unary_unary(path, encode, decode)(request, timeout=5)
            except grpc.aio.AioRpcError as error:
                assert error.code() != grpc.StatusCode.UNIMPLEMENTED, method.name
