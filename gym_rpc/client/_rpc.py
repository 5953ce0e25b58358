"""One call path per flavour, and RPCs declared once for both (the idea of temporalio's `service.py`).

An `Rpc` is one row of the control client's table: the gRPC method it calls, a request builder whose signature is
the wrapper's signature, a converter from the response to what the caller gets, and a default deadline. It is a
descriptor: read from a `BlockingTransport` it is a plain call, from an `AsyncTransport` a coroutine; a
`StreamRpc` is an iterator or an async iterator. The clients declare each RPC once, in one shared class, so an RPC
cannot exist on one flavour only, and the two signatures cannot drift.

A row may also say how NeMo Gym's HTTP head answers it (`http`): against a head that speaks HTTP, not gRPC (an
`ng_run` deployment; gym_rpc.client._head_protocol finds out once per address), both call paths use that instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
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
from gym_rpc.client._head_protocol import (
    DETECT_TIMEOUT_SECONDS,
    GRPC,
    NEMO_GYM_HTTP,
    HeadProtocol,
    forget_head_protocol,
    head_protocol,
    known_head_protocol,
    remembered_head_protocol,
)
from gym_rpc.client._nemo_gym_control import unimplemented
from gym_rpc.client._nemo_gym_head import NemoGymHead
from gym_rpc.client._security import ClientSecurity, client_security
from gym_rpc.errors import HeadTimeoutError, HeadUnreachableError
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
    "connection_error" rather than raising). `http`, when given, answers the call from NeMo Gym's HTTP head (the
    head's endpoints, the request, the deadline); a row without it is refused there with UNIMPLEMENTED.
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
        http: Callable[[NemoGymHead, Any, float | None], Any] | None = None,
    ) -> None:
        self.method = method
        self.build = build
        self.convert = convert
        self.service = service
        self.deadline = deadline
        self.on_error = on_error
        self.http = http
        self.__doc__ = build.__doc__

    def deadline_for(self, call: Call[Request], client_timeout: float) -> float | None:
        if call.timeout is not None:
            return call.timeout
        return client_timeout if self.deadline == CLIENT_DEADLINE else self.deadline

    def failed(self, error: grpc.RpcError, address: str) -> Result:
        """The result `on_error` makes of a failure, else the typed gym_rpc error (the gRPC one its cause)."""
        code = status_code(error)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            forget_head_protocol(address)  # the head went away: whatever listens there next is looked at afresh
        if self.on_error is None:
            raise from_grpc_error(error, address) from error
        return self.on_error(code)

    def over_http(self, head: NemoGymHead, call: Call[Request], client_timeout: float) -> Any:
        """The call answered from NeMo Gym's HTTP head: the row's result (for a stream, an iterator of them)."""
        if self.http is None:
            raise unimplemented(self.method, head.address)
        return self.http(head, call.request, self.deadline_for(call, client_timeout))  # a failed GET forgets it

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

    def stream_failed(self, error: grpc.RpcError, address: str, deadline: float | None) -> None:
        """As `failed`, except that the DEADLINE_EXCEEDED of a stream that had answered (`deadline`: its deadline;
        None when nothing came) is its own deadline passing, which says nothing against the head."""
        if status_code(error) == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None:
            raise HeadTimeoutError(
                f"{self.method} from the head at {address} reached the stream's deadline of {deadline:.1f} s (the "
                "timeout it was given), as asked; the head had answered",
                address=address,
                code=grpc.StatusCode.DEADLINE_EXCEEDED,
            ) from error
        self.failed(error, address)

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

    def _nemo_gym_head(
        self, rpc: Rpc[..., Any, Any, Any], call: Call[Any]
    ) -> tuple[NemoGymHead | None, Call[Any]]:
        """NeMo Gym's HTTP head when that is what listens at the address, else None (a gRPC head); and the call,
        its deadline less the time the first look at the address took (one connection, within the deadline)."""
        tls = self.security.tls is not None
        protocol = known_head_protocol(self.address, tls=tls)
        if protocol is None:
            deadline = rpc.deadline_for(call, self.timeout_seconds)
            started = time.monotonic()
            protocol = head_protocol(self.address, tls=tls, timeout=deadline or DETECT_TIMEOUT_SECONDS)
            if deadline is not None:
                call = Call(call.request, max(deadline - (time.monotonic() - started), 0.001))
        return (NemoGymHead(self.address) if protocol == NEMO_GYM_HTTP else None), call

    async def _anemo_gym_head(
        self, rpc: Rpc[..., Any, Any, Any], call: Call[Any]
    ) -> tuple[NemoGymHead | None, Call[Any]]:
        """`_nemo_gym_head` for the event loop: the first look at an address runs in a thread."""
        if known_head_protocol(self.address, tls=self.security.tls is not None) is None:
            return await asyncio.to_thread(self._nemo_gym_head, rpc, call)
        return self._nemo_gym_head(rpc, call)

    # A unary call made to a head remembered as speaking one protocol, which fails as if nothing listened there
    # (gRPC's UNAVAILABLE, or an HTTP GET unreachable), may have reached another head started at that address with
    # the other protocol: `ng_run` on the port a `gym-rpc head` had, or the other way round (11000 is both one's
    # default). The failed attempt forgets the address's protocol; the address is looked at again, within the
    # call's deadline, and only when the look finds the other protocol is the call made once more, with that one.
    # The first attempt cannot have been served then (a head of one protocol serves no request of the other), so
    # no call is made twice.

    def _protocol_may_have_changed(self, error: BaseException, remembered: HeadProtocol | None) -> bool:
        if isinstance(error, grpc.RpcError):
            return remembered == GRPC and status_code(error) == grpc.StatusCode.UNAVAILABLE
        return remembered == NEMO_GYM_HTTP and not isinstance(error, HeadTimeoutError)

    def _call_again(self, rpc: Rpc[..., Any, Any, Any], call: Call[Any], started: float) -> Call[Any]:
        """`call` with what is left of its deadline (`started` when it began), the address's protocol forgotten."""
        forget_head_protocol(self.address)
        deadline = rpc.deadline_for(call, self.timeout_seconds)
        if deadline is None:
            return call
        return Call(call.request, max(deadline - (time.monotonic() - started), 0.001))

    def _protocol_changed(self, remembered: HeadProtocol | None) -> bool:
        """After the second look: whether it found the other protocol (nothing, or the same, changes nothing)."""
        found = remembered_head_protocol(self.address)
        return found is not None and found != remembered

    def _failed(self, rpc: Rpc[..., Any, Any, Result], error: BaseException) -> Result:
        """The first attempt's failure, as it would have been: a gRPC error made typed (or `on_error`'s result)."""
        if isinstance(error, grpc.RpcError):
            return rpc.failed(error, self.address)
        raise error


class BlockingTransport(_Transport):
    """The one blocking call path, over the process's shared channel to the head."""

    def unary(self, rpc: Rpc[..., Any, Any, Result], *args: Any, **kwargs: Any) -> Result:
        remembered, started = remembered_head_protocol(self.address), time.monotonic()
        head, call = self._nemo_gym_head(rpc, rpc.build(*args, **kwargs))
        try:
            return self._attempt(rpc, head, call)
        except (grpc.RpcError, HeadUnreachableError) as error:
            if not self._protocol_may_have_changed(error, remembered):
                return self._failed(rpc, error)
            head, again = self._nemo_gym_head(rpc, self._call_again(rpc, call, started))
            if not self._protocol_changed(remembered):
                return self._failed(rpc, error)
        try:
            return self._attempt(rpc, head, again)
        except grpc.RpcError as error:
            return rpc.failed(error, self.address)

    def _attempt(self, rpc: Rpc[..., Any, Any, Result], head: NemoGymHead | None, call: Call[Any]) -> Result:
        """The call over HTTP to NeMo Gym's `head`, or over gRPC (None); a gRPC failure raised as it is."""
        if head is not None:
            result: Result = rpc.over_http(head, call, self.timeout_seconds)
            return result
        method = _method(sync_channel(self.address, self.security.tls), rpc)
        timeout = rpc.deadline_for(call, self.timeout_seconds)
        return rpc.convert(method(call.request, timeout=timeout, metadata=self._metadata))

    def stream(self, rpc: Rpc[..., Any, Any, Result], *args: Any, **kwargs: Any) -> Generator[Result, None, None]:
        head, call = self._nemo_gym_head(rpc, rpc.build(*args, **kwargs))
        if head is not None:
            yield from rpc.over_http(head, call, self.timeout_seconds)
            return
        method = _method(sync_channel(self.address, self.security.tls), rpc)
        deadline = rpc.deadline_for(call, self.timeout_seconds)
        messages = method(call.request, timeout=deadline, metadata=self._metadata)
        answered = False
        try:
            for message in messages:
                answered = True
                yield rpc.convert(message)
        except grpc.RpcError as error:
            _stream_rpc(rpc).stream_failed(error, self.address, deadline if answered else None)
        finally:
            messages.cancel()


class AsyncTransport(_Transport):
    """The one asyncio call path, over the running loop's shared channel to the head."""

    async def unary(self, rpc: Rpc[..., Any, Any, Result], *args: Any, **kwargs: Any) -> Result:
        remembered, started = remembered_head_protocol(self.address), time.monotonic()
        head, call = await self._anemo_gym_head(rpc, rpc.build(*args, **kwargs))
        try:
            return await self._attempt(rpc, head, call)
        except (grpc.RpcError, HeadUnreachableError) as error:
            if not self._protocol_may_have_changed(error, remembered):
                return self._failed(rpc, error)
            head, again = await self._anemo_gym_head(rpc, self._call_again(rpc, call, started))
            if not self._protocol_changed(remembered):
                return self._failed(rpc, error)
        try:
            return await self._attempt(rpc, head, again)
        except grpc.RpcError as error:
            return rpc.failed(error, self.address)

    async def _attempt(self, rpc: Rpc[..., Any, Any, Result], head: NemoGymHead | None, call: Call[Any]) -> Result:
        """The call over HTTP to NeMo Gym's `head` (in a thread), or over gRPC (None); a gRPC failure raised."""
        if head is not None:
            result: Result = await asyncio.to_thread(rpc.over_http, head, call, self.timeout_seconds)
            return result
        method = _method(aio_channel(self.address, self.security.tls), rpc)
        timeout = rpc.deadline_for(call, self.timeout_seconds)
        return rpc.convert(await method(call.request, timeout=timeout, metadata=self._metadata))

    async def stream(
        self, rpc: Rpc[..., Any, Any, Result], *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Result, None]:
        head, call = await self._anemo_gym_head(rpc, rpc.build(*args, **kwargs))
        if head is not None:
            async for result in _in_threads(rpc.over_http(head, call, self.timeout_seconds)):
                yield result
            return
        method = _method(aio_channel(self.address, self.security.tls), rpc)
        deadline = rpc.deadline_for(call, self.timeout_seconds)
        messages = method(call.request, timeout=deadline, metadata=self._metadata)
        answered = False
        try:
            async for message in messages:
                answered = True
                yield rpc.convert(message)
        except grpc.RpcError as error:
            _stream_rpc(rpc).stream_failed(error, self.address, deadline if answered else None)
        finally:
            messages.cancel()


async def _in_threads(results: Generator[Result, None, None]) -> AsyncGenerator[Result, None]:
    """A blocking generator (NeMo Gym's polled watch) iterated from the event loop, each step in a thread."""
    done = object()
    try:
        while (result := await asyncio.to_thread(next, results, done)) is not done:
            yield result  # type: ignore[misc]
    finally:
        with contextlib.suppress(ValueError):  # still running in its thread (the caller was cancelled)
            results.close()


def _stream_rpc(rpc: Rpc[..., Any, Any, Result]) -> StreamRpc[..., Any, Any, Result]:
    """The stream call paths serve only StreamRpc rows (their descriptors bind `stream`)."""
    assert isinstance(rpc, StreamRpc)
    return rpc
