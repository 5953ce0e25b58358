"""Every RPC of the generated ControlPlaneService has a servicer handler, a row in the control clients' table,
and a wrapper on both control clients.

Adding an RPC to the .proto and regenerating must fail here until the head serves it and the clients expose it.
"""

from __future__ import annotations

import inspect
import re

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message_factory import GetMessageClass

from gym_rpc.client.control._clients import ControlClient, ControlRpcs, SyncControlClient
from gym_rpc.client.control._rpc import Rpc, StreamRpc
from gym_rpc.server.service._servicer import ControlPlaneServicer
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.v1 import control_plane_pb2_grpc as pb_grpc
from gym_rpc.wire import HEALTH_SERVICE_NAME, SERVICE_NAME
from tests.support.documents import document

SERVICE = pb.DESCRIPTOR.services_by_name["ControlPlaneService"]
METHODS: list[MethodDescriptor] = list(SERVICE.methods)


def snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def unimplemented_handlers(servicer: type) -> list[str]:
    """RPCs whose handler on `servicer` is still the generated base's UNIMPLEMENTED one."""
    base = pb_grpc.ControlPlaneServiceServicer
    return [m.name for m in METHODS if getattr(servicer, m.name) is getattr(base, m.name)]


def missing_wrappers(client: object) -> list[str]:
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


def table_rows(table: type = ControlRpcs) -> dict[str, Rpc]:
    """Attribute name -> row, for every RPC the table declares."""
    return {name: row for name, row in vars(table).items() if isinstance(row, Rpc)}


def rpcs_without_a_row(table: type = ControlRpcs) -> list[str]:
    served = {row.method for row in table_rows(table).values() if row.service == SERVICE_NAME}
    return [m.name for m in METHODS if m.name not in served]


def test_every_rpc_has_a_row_in_the_table():
    assert rpcs_without_a_row() == []
    assert rpcs_without_a_row(object) == [m.name for m in METHODS]  # the check can fail


def test_every_row_names_a_real_rpc_of_its_service():
    health = {"Check", "Watch", "List"}
    for name, row in table_rows().items():
        if row.service == HEALTH_SERVICE_NAME:
            assert row.method in health, name
        else:
            assert row.service == SERVICE_NAME, name
            assert row.method in SERVICE.methods_by_name, name


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_the_row_kind_matches_the_rpc(method: MethodDescriptor):
    """A streaming RPC has a StreamRpc row (iterated, no default deadline), a unary one a plain Rpc row."""
    for row in table_rows().values():
        if row.service == SERVICE_NAME and row.method == method.name:
            assert isinstance(row, StreamRpc) == method.server_streaming, method.name
            if method.server_streaming:
                assert row.deadline is None


@pytest.mark.parametrize("client", [SyncControlClient, ControlClient])
def test_every_rpc_has_a_client_wrapper(client: type):
    assert missing_wrappers(client("127.0.0.1:1")) == []
    assert missing_wrappers(object()) == [snake_case(m.name) for m in METHODS]  # the check can fail


@pytest.mark.parametrize("client", [SyncControlClient, ControlClient])
def test_both_clients_are_made_from_the_table(client: type):
    """Every row is an attribute of both flavours, the same object: one cannot have an RPC the other lacks."""
    for name, row in table_rows().items():
        assert getattr(client, name) is row, name
    assert "head_status" in table_rows()


def bound(client_class: type, name: str) -> object:
    return getattr(client_class("127.0.0.1:1"), name)


@pytest.mark.parametrize("name", sorted(table_rows()))
def test_wrapper_kind_matches_the_row(name: str):
    """Streaming rows are iterated, unary ones called (and awaited on the asyncio client)."""
    sync_wrapper, aio_wrapper = bound(SyncControlClient, name), bound(ControlClient, name)
    if isinstance(table_rows()[name], StreamRpc):
        assert inspect.isgeneratorfunction(sync_wrapper)
        assert inspect.isasyncgenfunction(aio_wrapper)
    else:
        assert not inspect.isgeneratorfunction(sync_wrapper) and not inspect.iscoroutinefunction(sync_wrapper)
        assert inspect.iscoroutinefunction(aio_wrapper)


def test_a_row_shows_its_builders_signature():
    """help() and inspect show the call's real parameters, not *args, **kwargs."""
    for client in (SyncControlClient("127.0.0.1:1"), ControlClient("127.0.0.1:1")):
        parameters = list(inspect.signature(client.get_server_status).parameters)
        assert parameters == ["server_name", "max_age_seconds", "timeout"]
        assert "probe now" in (client.get_server_status.__doc__ or "")


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
