"""Requests that do not decode are the client's mistake: INVALID_ARGUMENT, one log line at most, no traceback.

grpc.aio decodes a request before any handler code runs; when the bytes are not the expected protobuf message it
logs an 8-line ERROR traceback and answers UNKNOWN, once per call, so any client (even one without the token)
could fill the head's log. `DecodeGuardInterceptor` gives every handler a deserializer that cannot raise, and
answers INVALID_ARGUMENT when it saw a broken request. The token interceptor never decodes a request at all.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from gym_rpc.server.security import Context, Handler, HandlerInterceptor

logger = logging.getLogger("gym_rpc.server._bad_requests")  # its name from before the move


@dataclass(frozen=True)
class Undecodable:
    """What the tolerant deserializer returns in place of a request it could not decode."""

    problem: str


def _tolerant(deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # protobuf's DecodeError, or anything a generated parser raises on garbage
            return Undecodable(f"the request to {method} is not a valid protobuf message ({type(exc).__name__})")

    return decode


async def _refuse(context: Context, request: Undecodable) -> None:
    logger.info("%s: answered INVALID_ARGUMENT", request.problem)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)


def guard_handler(handler: Handler, method: str) -> Handler:
    """`handler` with a deserializer that cannot raise and INVALID_ARGUMENT for what it could not decode."""
    if handler.request_deserializer is None:  # raw bytes in: nothing to decode
        return handler
    deserialize = _tolerant(handler.request_deserializer, method)
    codec = {"request_deserializer": deserialize, "response_serializer": handler.response_serializer}
    if not handler.request_streaming:
        if handler.response_streaming:
            unary_stream: Any = handler.unary_stream  # async in grpc.aio; the stubs type it sync
            if not inspect.isasyncgenfunction(unary_stream):  # a coroutine that writes its messages itself

                async def unary_stream_writer(request: Any, context: Context) -> None:
                    if isinstance(request, Undecodable):
                        await _refuse(context, request)
                    await unary_stream(request, context)

                # Kept a coroutine: grpc awaits it, with no generator per stream around it.
                return grpc.unary_stream_rpc_method_handler(unary_stream_writer, **codec)

            async def unary_stream_guarded(request: Any, context: Context) -> AsyncIterator[Any]:
                if isinstance(request, Undecodable):
                    await _refuse(context, request)
                async for response in _each_response(unary_stream(request, context)):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream_guarded, **codec)
        unary_unary: Any = handler.unary_unary

        async def unary_unary_guarded(request: Any, context: Context) -> Any:
            if isinstance(request, Undecodable):
                await _refuse(context, request)
            response = unary_unary(request, context)
            return await response if inspect.isawaitable(response) else response

        return grpc.unary_unary_rpc_method_handler(unary_unary_guarded, **codec)

    async def checked(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, Undecodable):
                await _refuse(context, request)
            yield request

    if handler.response_streaming:
        stream_stream: Any = handler.stream_stream

        async def stream_stream_guarded(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            async for response in _each_response(stream_stream(checked(requests, context), context)):
                yield response

        return grpc.stream_stream_rpc_method_handler(stream_stream_guarded, **codec)
    stream_unary: Any = handler.stream_unary

    async def stream_unary_guarded(requests: AsyncIterator[Any], context: Context) -> Any:
        response = stream_unary(checked(requests, context), context)
        return await response if inspect.isawaitable(response) else response

    return grpc.stream_unary_rpc_method_handler(stream_unary_guarded, **codec)


async def _each_response(responses: Any) -> AsyncIterator[Any]:
    """A streaming handler's responses: an async generator's, or none from a coroutine that writes them itself
    with context.write (grpc's health Watch)."""
    if inspect.isawaitable(responses):
        await responses
        return
    async for response in responses:
        yield response


class DecodeGuardInterceptor(HandlerInterceptor):
    """Every handler guarded by `guard_handler`; wrapped once per method, so a call pays one dict lookup."""

    def __init__(self) -> None:
        self._guarded: dict[str, tuple[Handler, Handler]] = {}  # method -> (original, guarded)

    def handle(self, handler: Handler, details: grpc.HandlerCallDetails) -> Handler:
        known = self._guarded.get(details.method)
        if known is not None and known[0] is handler:
            return known[1]
        guarded = guard_handler(handler, details.method)
        if len(self._guarded) < 1024:  # method names come from clients: remember only a bounded number
            self._guarded[details.method] = (handler, guarded)
        return guarded
