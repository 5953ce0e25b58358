"""What the head's server interceptors share: the handler types, and one base that lets each interceptor be a
plain decision about a call's handler (run it, wrap it, or refuse the call)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # generic only in the type stubs
    Handler = grpc.RpcMethodHandler[Any, Any]
    ServerInterceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    Handler = grpc.RpcMethodHandler
    ServerInterceptor = grpc.aio.ServerInterceptor
Context = grpc.aio.ServicerContext[Any, Any]


class HandlerInterceptor(ServerInterceptor):
    """An interceptor whose `handle` picks the handler that serves a call (methods nobody serves pass through)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(details)
        return handler if handler is None else self.handle(handler, details)

    def handle(self, handler: Handler, details: grpc.HandlerCallDetails) -> Handler:
        raise NotImplementedError
