"""Typed wrappers of every ControlPlaneService RPC, blocking (`SyncControlClient`) and asyncio (`ControlClient`).

Each call has a deadline (DEFAULT_TIMEOUT_SECONDS unless given), carries the bearer token when one is configured,
and turns gRPC failures into gym_rpc errors that name the head's address and what to check.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_rpc.client._channel import DEFAULT_TIMEOUT_SECONDS, aio_channel, default_head_address, sync_channel
from gym_rpc.client._security import ClientSecurity, client_security
from gym_rpc.config import BaseServerConfig, GlobalConfig
from gym_rpc.errors import ControlPlaneError, HeadUnreachableError, UnknownServerError
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.v1 import control_plane_pb2_grpc as pb_grpc
from gym_rpc.wire import KNOWN_SERVERS_METADATA_KEY, TLS_CA_ENV_VAR, ServerInstance, ServerStatus, StatusReport
from gym_rpc.wire import _convert as convert

Request = TypeVar("Request")
Response = TypeVar("Response")


@dataclass(frozen=True)
class StatusSnapshot:
    revision: int
    reports: list[StatusReport]


@dataclass(frozen=True)
class WatchEvent:
    """One message of a status watch: kind is "snapshot", "change" or "heartbeat"."""

    kind: str
    revision: int
    reports: list[StatusReport]
    compacted: bool
    config_version: str = ""  # the head's config version when sent; a change means: fetch the config again


_EVENT_KINDS = {
    pb.WATCH_EVENT_TYPE_SNAPSHOT: "snapshot",
    pb.WATCH_EVENT_TYPE_CHANGE: "change",
    pb.WATCH_EVENT_TYPE_HEARTBEAT: "heartbeat",
}


def _watch_event(message: pb.WatchServerStatusesResponse) -> WatchEvent:
    return WatchEvent(
        kind=_EVENT_KINDS.get(message.type, "unknown"),
        revision=message.revision,
        reports=[convert.report_from_pb(r) for r in message.reports],
        compacted=message.compacted,
        config_version=message.config_version,
    )


def _watch_request(start_revision: int, heartbeat_seconds: float | None) -> pb.WatchServerStatusesRequest:
    request = pb.WatchServerStatusesRequest(start_revision=start_revision)
    if heartbeat_seconds is not None:
        request.heartbeat_interval.CopyFrom(convert.seconds_to_duration(heartbeat_seconds))
    return request


def _status_request(server_name: str, max_age_seconds: float | None) -> pb.GetServerStatusRequest:
    """None leaves max_age unset (the head's default freshness window); 0 asks for a probe now."""
    request = pb.GetServerStatusRequest(server_name=server_name)
    if max_age_seconds is not None:
        if not max_age_seconds >= 0:  # NaN included
            raise ValueError(f"max_age_seconds must be a number >= 0, got {max_age_seconds!r}")
        request.max_age.CopyFrom(convert.seconds_to_duration(max_age_seconds))
    return request


def _changed_config(response: pb.GetGlobalConfigResponse) -> GlobalConfig | None:
    return None if response.unchanged else convert.global_config_from_pb(response)


# grpc.aio's AioRpcError is no grpc.Call, yet carries the same code, details and trailing metadata.
_CALL_ERRORS = (grpc.Call, grpc.aio.AioRpcError)


def raise_control_error(error: grpc.RpcError, address: str, subject: str = "") -> NoReturn:
    """Turn a failed call into a typed gym_rpc error naming the head and what to check."""
    code = error.code() if isinstance(error, _CALL_ERRORS) else grpc.StatusCode.UNKNOWN
    details = (error.details() if isinstance(error, _CALL_ERRORS) else None) or str(error)
    if code == grpc.StatusCode.UNAVAILABLE:
        raise HeadUnreachableError(
            f"head server at {address} is unreachable ({details}); check that `gym-rpc head` runs there, that "
            f"the address (--head or GYM_RPC_HEAD) is right, and, with TLS, that the CA ({TLS_CA_ENV_VAR}) "
            f"signed the head's certificate",
            address=address,
            code=code.name,
        ) from None
    if code == grpc.StatusCode.UNAUTHENTICATED:
        raise ControlPlaneError(
            f"head server at {address} refused the call: UNAUTHENTICATED: {details}",
            address=address,
            code=code.name,
        ) from None
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        raise HeadUnreachableError(
            f"head server at {address} did not answer in time; check that it runs and is not overloaded",
            address=address,
            code=code.name,
        ) from None
    if code == grpc.StatusCode.NOT_FOUND and subject and isinstance(error, _CALL_ERRORS):
        metadata: Any = error.trailing_metadata() or ()  # sync: (key, value) pairs; aio: a Mapping
        trailing = dict(metadata)
        known = str(trailing.get(KNOWN_SERVERS_METADATA_KEY, ""))
        raise UnknownServerError(subject, [n for n in known.split(",") if n]) from None
    raise ControlPlaneError(f"head server at {address}: {code.name}: {details}", address=address, code=code.name)


class SyncControlClient:
    """Blocking control-plane calls over the process's shared channel to one head.

    `security` (token, TLS) defaults to what the environment says (GYM_RPC_TOKEN, GYM_RPC_TLS_CA, ...).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        security: ClientSecurity | None = None,
    ) -> None:
        self.address = address or default_head_address()
        self.timeout_seconds = timeout_seconds
        self.security = security if security is not None else client_security()
        self._metadata = self.security.metadata()
        self._channel = sync_channel(self.address, self.security.tls)
        self._stub = pb_grpc.ControlPlaneServiceStub(self._channel)

    def _call(
        self,
        method: grpc.UnaryUnaryMultiCallable[Request, Response],
        request: Request,
        timeout: float | None,
        subject: str = "",
    ) -> Response:
        try:
            return method(request, timeout=timeout or self.timeout_seconds, metadata=self._metadata)
        except grpc.RpcError as error:
            raise_control_error(error, self.address, subject)

    def get_head_server_config(self, *, timeout: float | None = None) -> BaseServerConfig:
        request = pb.GetHeadServerConfigRequest()
        response = self._call(self._stub.GetHeadServerConfig, request, timeout)
        return convert.head_server_from_pb(response.head_server)

    def get_global_config(self, *, include_secrets: bool = False, timeout: float | None = None) -> GlobalConfig:
        """The global config; secrets only with include_secrets and the head's token (else redacted)."""
        request = pb.GetGlobalConfigRequest(include_secrets=include_secrets)
        response = self._call(self._stub.GetGlobalConfig, request, timeout)
        return convert.global_config_from_pb(response)

    def get_global_config_if_changed(
        self, known_version: str, *, include_secrets: bool = False, timeout: float | None = None
    ) -> GlobalConfig | None:
        """The global config when its version is not `known_version`; None (no document sent) when unchanged."""
        request = pb.GetGlobalConfigRequest(include_secrets=include_secrets, known_version=known_version)
        return _changed_config(self._call(self._stub.GetGlobalConfig, request, timeout))

    def get_server_status(
        self, server_name: str, *, max_age_seconds: float | None = None, timeout: float | None = None
    ) -> StatusReport:
        request = _status_request(server_name, max_age_seconds)
        response = self._call(self._stub.GetServerStatus, request, timeout, server_name)
        return convert.report_from_pb(response.report)

    def list_server_statuses(self, *, timeout: float | None = None) -> StatusSnapshot:
        request = pb.ListServerStatusesRequest()
        response = self._call(self._stub.ListServerStatuses, request, timeout)
        return StatusSnapshot(response.revision, [convert.report_from_pb(r) for r in response.reports])

    def watch_server_statuses(
        self, start_revision: int = 0, *, heartbeat_seconds: float | None = None, timeout: float | None = None
    ) -> Generator[WatchEvent, None, None]:
        """Stream events until the caller stops iterating (or `timeout`, when given, ends the stream)."""
        request = _watch_request(start_revision, heartbeat_seconds)
        stream = self._stub.WatchServerStatuses(request, timeout=timeout, metadata=self._metadata)
        try:
            for message in stream:
                yield _watch_event(message)
        except grpc.RpcError as error:
            raise_control_error(error, self.address)
        finally:
            stream.cancel()  # type: ignore[no-untyped-call]

    def list_server_instances(self, *, timeout: float | None = None) -> list[ServerInstance]:
        request = pb.ListServerInstancesRequest()
        response = self._call(self._stub.ListServerInstances, request, timeout)
        return [convert.instance_from_pb(i) for i in response.instances]

    def get_assistant_message_header(
        self, model_server_name: str, *, timeout: float | None = None
    ) -> bytes | None:
        request = pb.GetAssistantMessageHeaderRequest(model_server_name=model_server_name)
        response = self._call(self._stub.GetAssistantMessageHeader, request, timeout, model_server_name)
        return response.header if response.HasField("header") else None

    def reload_global_config(self, *, timeout: float | None = None) -> tuple[str, bool]:
        request = pb.ReloadGlobalConfigRequest()
        response = self._call(self._stub.ReloadGlobalConfig, request, timeout)
        return response.version, response.changed

    def register_server_instance(
        self,
        server_name: str,
        *,
        listen_port: int,
        listen_host: str = "",
        pid: int = 0,
        start_time: float = 0.0,
        advertise_host: str = "",
        timeout: float | None = None,
    ) -> str:
        """Register a running server process; returns the base URL the head advertises for it."""
        request = convert.register_request_to_pb(
            server_name,
            pid=pid,
            start_time=start_time,
            listen_host=listen_host,
            listen_port=listen_port,
            advertise_host=advertise_host,
        )
        response = self._call(self._stub.RegisterServerInstance, request, timeout, server_name)
        return response.advertised_url

    def deregister_server_instance(self, server_name: str, *, pid: int = 0, timeout: float | None = None) -> bool:
        """Forget the server's registration (of `pid`, or whatever it is with 0); True when one was removed."""
        request = pb.DeregisterServerInstanceRequest(server_name=server_name, pid=pid)
        response = self._call(self._stub.DeregisterServerInstance, request, timeout, server_name)
        return response.deregistered

    def head_status(self, *, timeout: float | None = None) -> ServerStatus:
        """The head's own status from its standard health service (`Check("")`), as a probe result."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        request = health_pb2.HealthCheckRequest(service="")
        try:
            response = stub.Check(request, timeout=timeout or self.timeout_seconds)
        except grpc.RpcError as error:
            code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
            return _HEALTH_ERROR_STATUSES.get(code, "unknown_error")
        return "success" if response.status == health_pb2.HealthCheckResponse.SERVING else "unknown_error"


_HEALTH_ERROR_STATUSES: dict[grpc.StatusCode, ServerStatus] = {
    grpc.StatusCode.UNAVAILABLE: "connection_error",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
}


class ControlClient:
    """asyncio control-plane calls over the running loop's shared channel to one head.

    `security` (token, TLS) defaults to what the environment says (GYM_RPC_TOKEN, GYM_RPC_TLS_CA, ...).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        security: ClientSecurity | None = None,
    ) -> None:
        self.address = address or default_head_address()
        self.timeout_seconds = timeout_seconds
        self.security = security if security is not None else client_security()
        self._metadata = self.security.metadata()

    @property
    def _stub(self) -> pb_grpc.ControlPlaneServiceAsyncStub:
        return pb_grpc.ControlPlaneServiceStub(aio_channel(self.address, self.security.tls))

    async def _call(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[Request, Response],
        request: Request,
        timeout: float | None,
        subject: str = "",
    ) -> Response:
        try:
            return await method(request, timeout=timeout or self.timeout_seconds, metadata=self._metadata)
        except grpc.RpcError as error:
            raise_control_error(error, self.address, subject)

    async def get_head_server_config(self, *, timeout: float | None = None) -> BaseServerConfig:
        request = pb.GetHeadServerConfigRequest()
        response = await self._call(self._stub.GetHeadServerConfig, request, timeout)
        return convert.head_server_from_pb(response.head_server)

    async def get_global_config(
        self, *, include_secrets: bool = False, timeout: float | None = None
    ) -> GlobalConfig:
        """The global config; secrets only with include_secrets and the head's token (else redacted)."""
        request = pb.GetGlobalConfigRequest(include_secrets=include_secrets)
        response = await self._call(self._stub.GetGlobalConfig, request, timeout)
        return convert.global_config_from_pb(response)

    async def get_global_config_if_changed(
        self, known_version: str, *, include_secrets: bool = False, timeout: float | None = None
    ) -> GlobalConfig | None:
        """The global config when its version is not `known_version`; None (no document sent) when unchanged."""
        request = pb.GetGlobalConfigRequest(include_secrets=include_secrets, known_version=known_version)
        return _changed_config(await self._call(self._stub.GetGlobalConfig, request, timeout))

    async def get_server_status(
        self, server_name: str, *, max_age_seconds: float | None = None, timeout: float | None = None
    ) -> StatusReport:
        request = _status_request(server_name, max_age_seconds)
        response = await self._call(self._stub.GetServerStatus, request, timeout, server_name)
        return convert.report_from_pb(response.report)

    async def list_server_statuses(self, *, timeout: float | None = None) -> StatusSnapshot:
        request = pb.ListServerStatusesRequest()
        response = await self._call(self._stub.ListServerStatuses, request, timeout)
        return StatusSnapshot(response.revision, [convert.report_from_pb(r) for r in response.reports])

    async def watch_server_statuses(
        self, start_revision: int = 0, *, heartbeat_seconds: float | None = None, timeout: float | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        """Stream events until the caller stops iterating (or `timeout`, when given, ends the stream)."""
        request = _watch_request(start_revision, heartbeat_seconds)
        stream = self._stub.WatchServerStatuses(request, timeout=timeout, metadata=self._metadata)
        try:
            async for message in stream:
                yield _watch_event(message)
        except grpc.RpcError as error:
            raise_control_error(error, self.address)
        finally:
            stream.cancel()

    async def list_server_instances(self, *, timeout: float | None = None) -> list[ServerInstance]:
        request = pb.ListServerInstancesRequest()
        response = await self._call(self._stub.ListServerInstances, request, timeout)
        return [convert.instance_from_pb(i) for i in response.instances]

    async def get_assistant_message_header(
        self, model_server_name: str, *, timeout: float | None = None
    ) -> bytes | None:
        request = pb.GetAssistantMessageHeaderRequest(model_server_name=model_server_name)
        response = await self._call(self._stub.GetAssistantMessageHeader, request, timeout, model_server_name)
        return response.header if response.HasField("header") else None

    async def reload_global_config(self, *, timeout: float | None = None) -> tuple[str, bool]:
        request = pb.ReloadGlobalConfigRequest()
        response = await self._call(self._stub.ReloadGlobalConfig, request, timeout)
        return response.version, response.changed

    async def register_server_instance(
        self,
        server_name: str,
        *,
        listen_port: int,
        listen_host: str = "",
        pid: int = 0,
        start_time: float = 0.0,
        advertise_host: str = "",
        timeout: float | None = None,
    ) -> str:
        """Register a running server process; returns the base URL the head advertises for it."""
        request = convert.register_request_to_pb(
            server_name,
            pid=pid,
            start_time=start_time,
            listen_host=listen_host,
            listen_port=listen_port,
            advertise_host=advertise_host,
        )
        response = await self._call(self._stub.RegisterServerInstance, request, timeout, server_name)
        return response.advertised_url

    async def deregister_server_instance(
        self, server_name: str, *, pid: int = 0, timeout: float | None = None
    ) -> bool:
        """Forget the server's registration (of `pid`, or whatever it is with 0); True when one was removed."""
        request = pb.DeregisterServerInstanceRequest(server_name=server_name, pid=pid)
        response = await self._call(self._stub.DeregisterServerInstance, request, timeout, server_name)
        return response.deregistered
