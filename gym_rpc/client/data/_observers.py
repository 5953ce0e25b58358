"""Who is told how a data-plane call goes, chosen here alone: the worker metrics (while `METRICS.enabled`), then
the call's span (while `TRACING.enabled`), both told from inside `send` (gym_rpc.client.data._http). A replicated
server's route is told by its routed send (gym_rpc.client.data._routed_send), after them."""

from __future__ import annotations

from gym_rpc.client.data._call_metrics import metered_call
from gym_rpc.client.data._call_spans import ObserverPair, call_span
from gym_rpc.client.resend import Call, CallObserver
from gym_rpc.metrics import METRICS
from gym_rpc.telemetry import TRACING


def observer_for(call: Call, base_url: str) -> CallObserver | None:
    """`call`'s observer (to be sent at once: it is counted in flight and its span started here), or None when
    neither metrics nor a span observe it. `base_url` is the server's (or its instance's), for the span."""
    metered = metered_call(call.server, call.method) if METRICS.enabled else None
    span = call_span(call, base_url) if TRACING.enabled else None
    if span is None:
        return metered
    return span if metered is None else ObserverPair(metered, span)
