"""One call path per flavour, and RPCs declared once for both (the idea of temporalio's `service.py`).

An `Rpc` is one row of the control client's table: the gRPC method it calls, a request builder whose signature is
the wrapper's signature, a converter from the response to what the caller gets, and a default deadline. It is a
descriptor: read from a `BlockingTransport` it is a plain call, from an `AsyncTransport` a coroutine; a
`StreamRpc` is an iterator or an async iterator. The clients declare each RPC once, in one shared class, so an RPC
cannot exist on one flavour only, and the two signatures cannot drift.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, Generic, Literal, ParamSpec, TypeVar, overload

import grpc
from grpc_health.v1 import health_pb2_grpc

from gym_rpc.client._channel import (
    DEFAULT_TIMEOUT_SECONDS,
    aio_channel,
    checked_head_address,
    default_head_address,
    sync_channel,
)
from gym_rpc.client._security import ClientSecurity, client_security
from gym_rpc.v1 import control_plane_pb2_grpc as pb_grpc
from gym_rpc.wire import HEALTH_SERVICE_NAME, SERVICE_NAME, from_grpc_error, status_code

Params = ParamSpec("Params")
Request = TypeVar("Request")
Response = TypeVar("Response")
Result = TypeVar("Result")

# The client's `timeout_seconds` applies when a call names no timeout of its own.
CLIENT_DEADLINE: Literal["client"] = "client"
Deadline = float | Literal["client"] | None  # None: no deadline (a watch runs until the caller stops it)


@dataclass(frozen=True)
class Call(Generic[Request]):
    """What a request builder returns: the request and the caller's timeout (None: the row's default)."""

    request: Request
    timeout: float | None = None


class Rpc(Generic[Params, Request, Response, Result]):
    """A unary RPC, declared once; `client.<name>(...)` builds the request, calls, converts the response.

    `on_error`, when given, turns a failed call into a result instead of an error (the head's own health answers
    "connection_error" rather than raising).
    """

    def __init__(
        self,
        method: str,
        build: Callable[Params, Call[Request]],
        convert: Callable[[Response], Result],
        *,
        service: str = SERVICE_NAME,
        deadline: Deadline = CLIENT_DEADLINE,
        on_error: Callable[[grpc.StatusCode], Result] | None = None,
    ) -> None:
        self.method = method
        self.build = build
        self.convert = convert
        self.service = service
        self.deadline = deadline
        self.on_error = on_error
        self.__doc__ = build.__doc__

    def deadline_for(self, call: Call[Request], client_timeout: float) -> float | None:
        if call.timeout is not None:
            return call.timeout
        return client_timeout if self.deadline == CLIENT_DEADLINE else self.deadline

    def failed(self, error: grpc.RpcError, address: str) -> Result:
        """The result `on_error` makes of a failure, else the typed gym_rpc error (the gRPC one its cause)."""
        if self.on_error is None:
            raise from_grpc_error(error, address) from error
        return self.on_error(status_code(error))

    def _bind(self, call_path: Callable[..., Any]) -> Callable[..., Any]:
        """The client's call path for this row; help() and inspect.signature() show the builder's parameters."""
        return functools.update_wrapper(functools.partial(call_path, self), self.build)

    @overload
    def __get__(self, client: None, owner: type) -> Rpc[Params, Request, Response, Result]: ...
    @overload
    def __get__(self, client: BlockingTransport, owner: type) -> Callable[Params, Result]: ...
    @overload
    def __get__(self, client: AsyncTransport, owner: type) -> Callable[Params, Coroutine[Any, Any, Result]]: ...
    def __get__(self, client: BlockingTransport | AsyncTransport | None, owner: type) -> Any:
        return self if client is None else self._bind(client.unary)


class StreamRpc(Rpc[Params, Request, Response, Result]):
    """A server-streaming RPC: `client.<name>(...)` iterates the converted messages until the caller stops."""

    @overload  # type: ignore[override]
    def __get__(self, client: None, owner: type) -> StreamRpc[Params, Request, Response, Result]: ...
    @overload
    def __get__(
        self, client: BlockingTransport, owner: type
    ) -> Callable[Params, Generator[Result, None, None]]: ...
    @overload
    def __get__(self, client: AsyncTransport, owner: type) -> Callable[Params, AsyncGenerator[Result, None]]: ...
    def __get__(self, client: BlockingTransport | AsyncTransport | None, owner: type) -> Any:
        return self if client is None else self._bind(client.stream)


_STUB_CLASSES: dict[str, Callable[[Any], object]] = {
    SERVICE_NAME: pb_grpc.ControlPlaneServiceStub,
    HEALTH_SERVICE_NAME: health_pb2_grpc.HealthStub,
}
# A channel's stubs, made once per channel (a channel lives as long as its process, or its event loop).
_stubs: weakref.WeakKeyDictionary[object, dict[str, object]] = weakref.WeakKeyDictionary()


def _method(channel: grpc.Channel | grpc.aio.Channel, rpc: Rpc[..., Any, Any, Any]) -> Any:
    stubs = _stubs.get(channel)
    if stubs is None:
        stubs = _stubs[channel] = {service: make(channel) for service, make in _STUB_CLASSES.items()}
    return getattr(stubs[rpc.service], rpc.method)


class _Transport:
    """What both flavours share: the head's address, the default deadline, the token and TLS."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        security: ClientSecurity | None = None,
    ) -> None:
        self.address = checked_head_address(address or default_head_address())
        self.timeout_seconds = timeout_seconds
        self.security = security if security is not None else client_security()
        self._metadata = self.security.metadata()


class BlockingTransport(_Transport):
    """The one blocking call path, over the process's shared channel to the head."""

    def unary(self, rpc: Rpc[..., Any, Any, Result], *args: Any, **kwargs: Any) -> Result:
        call = rpc.build(*args, **kwargs)
        method = _method(sync_channel(self.address, self.security.tls), rpc)
        try:
            response = method(
                call.request, timeout=rpc.deadline_for(call, self.timeout_seconds), metadata=self._metadata
            )
        except grpc.RpcError as error:
            return rpc.failed(error, self.address)
        return rpc.convert(response)

    def stream(self, rpc: Rpc[..., Any, Any, Result], *args: Any, **kwargs: Any) -> Generator[Result, None, None]:
        call = rpc.build(*args, **kwargs)
        method = _method(sync_channel(self.address, self.security.tls), rpc)
        messages = method(
            call.request, timeout=rpc.deadline_for(call, self.timeout_seconds), metadata=self._metadata
        )
        try:
            yield from map(rpc.convert, messages)
        except grpc.RpcError as error:
            rpc.failed(error, self.address)
        finally:
            messages.cancel()


class AsyncTransport(_Transport):
    """The one asyncio call path, over the running loop's shared channel to the head."""

    async def unary(self, rpc: Rpc[..., Any, Any, Result], *args: Any, **kwargs: Any) -> Result:
        call = rpc.build(*args, **kwargs)
        method = _method(aio_channel(self.address, self.security.tls), rpc)
        try:
            response = await method(
                call.request, timeout=rpc.deadline_for(call, self.timeout_seconds), metadata=self._metadata
            )
        except grpc.RpcError as error:
            return rpc.failed(error, self.address)
        return rpc.convert(response)

    async def stream(
        self, rpc: Rpc[..., Any, Any, Result], *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Result, None]:
        call = rpc.build(*args, **kwargs)
        method = _method(aio_channel(self.address, self.security.tls), rpc)
        messages = method(
            call.request, timeout=rpc.deadline_for(call, self.timeout_seconds), metadata=self._metadata
        )
        try:
            async for message in messages:
                yield rpc.convert(message)
        except grpc.RpcError as error:
            rpc.failed(error, self.address)
        finally:
            messages.cancel()
