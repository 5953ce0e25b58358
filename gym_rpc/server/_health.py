"""The standard `grpc.health.v1.Health` service, with `List` answered.

grpc's reference asyncio servicer implements Check and Watch only; `List` (in the proto it ships, and so in
reflection) answers UNIMPLEMENTED and logs a traceback per call. Tools such as `grpc-health-probe` and operators
listing every Gym server's state use it.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]

MAX_LISTED_SERVICES = 10_000  # the proto lets a server refuse a list too long to send (RESOURCE_EXHAUSTED)


class HealthServicer(health_aio.HealthServicer):  # type: ignore[misc]
    """grpc's asyncio health servicer plus `List`: every service name with its serving state."""

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthListResponse:
        statuses = dict(self._server_status)  # the base class's table: one source of truth for Check and List
        if len(statuses) > MAX_LISTED_SERVICES:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(statuses)} health services, more than {MAX_LISTED_SERVICES} listed at once; use Check",
            )
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()}
        )
