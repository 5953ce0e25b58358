"""RPCs declared once for both call paths (the idea of temporalio's `service.py`).

An `Rpc` is one row of the control client's table: the gRPC method it calls, a request builder whose signature is
the wrapper's signature, a converter from the response to what the caller gets, and a default deadline. It is a
descriptor: read from a `BlockingCallPath` it is a plain call, from an `AsyncCallPath` a coroutine; a `StreamRpc`
is an iterator or an async iterator. The clients declare each RPC once, in one shared class, so an RPC cannot
exist on one flavour only, and the two signatures cannot drift.

A row may also say how NeMo Gym's HTTP head answers it (`http`): which head a call goes to, and how, is the head
seam's business (gym_rpc.client.control._heads), not the row's.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, Generic, Literal, ParamSpec, TypeVar, overload

import grpc

from gym_rpc.client.nemo_gym import NemoGymEndpoints
from gym_rpc.errors import HeadTimeoutError
from gym_rpc.wire import SERVICE_NAME, from_grpc_error, status_code

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
        http: Callable[[NemoGymEndpoints, Any, float | None], Any] | None = None,
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
        if self.on_error is None:
            raise from_grpc_error(error, address) from error
        return self.on_error(status_code(error))

    def _bind(self, call_path: Callable[..., Any]) -> Callable[..., Any]:
        """The client's call path for this row; help() and inspect.signature() show the builder's parameters."""
        return functools.update_wrapper(functools.partial(call_path, self), self.build)

    @overload
    def __get__(self, client: None, owner: type) -> Rpc[Params, Request, Response, Result]: ...
    @overload
    def __get__(self, client: BlockingCallPath, owner: type) -> Callable[Params, Result]: ...
    @overload
    def __get__(self, client: AsyncCallPath, owner: type) -> Callable[Params, Coroutine[Any, Any, Result]]: ...
    def __get__(self, client: BlockingCallPath | AsyncCallPath | None, owner: type) -> Any:
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
        self, client: BlockingCallPath, owner: type
    ) -> Callable[Params, Generator[Result, None, None]]: ...
    @overload
    def __get__(self, client: AsyncCallPath, owner: type) -> Callable[Params, AsyncGenerator[Result, None]]: ...
    def __get__(self, client: BlockingCallPath | AsyncCallPath | None, owner: type) -> Any:
        return self if client is None else self._bind(client.stream)


class BlockingCallPath(ABC):
    """What a blocking client is to its rows: a unary call returns the result, a stream is an iterator."""

    @abstractmethod
    def unary(self, rpc: Rpc[..., Any, Any, Result], *args: Any, **kwargs: Any) -> Result: ...

    @abstractmethod
    def stream(
        self, rpc: Rpc[..., Any, Any, Result], *args: Any, **kwargs: Any
    ) -> Generator[Result, None, None]: ...


class AsyncCallPath(ABC):
    """What an asyncio client is to its rows: a unary call is a coroutine, a stream an async iterator."""

    @abstractmethod
    async def unary(self, rpc: Rpc[..., Any, Any, Result], *args: Any, **kwargs: Any) -> Result: ...

    @abstractmethod
    def stream(
        self, rpc: Rpc[..., Any, Any, Result], *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Result, None]: ...
