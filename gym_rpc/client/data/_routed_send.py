"""A call to a server with several instances, as `ServerClient.request` makes it: what it sticks by (its rollout,
its NeMo Gym session) and its send, which picks the instance, fails over through the resend loop's `reroute`
and tells the route how the call ended (gym_rpc.client.replicas._routing)."""

from __future__ import annotations

from collections.abc import Mapping
from time import monotonic
from typing import TYPE_CHECKING, Any

import aiohttp

from gym_rpc.client.data._call_metrics import metered_send
from gym_rpc.client.data._call_spans import traced_send
from gym_rpc.client.data._http import send
from gym_rpc.client.data._rollout import rollout_id_in_context
from gym_rpc.client.nemo_gym import nemo_gym_rollout_id, rollout_id_from_run_body
from gym_rpc.client.replicas import RoutedCall, ServerRoute, prompt_key, session_pin_key
from gym_rpc.client.resend import RetryPolicy, with_total
from gym_rpc.errors import RequestTimeoutError
from gym_rpc.metrics import METRICS
from gym_rpc.telemetry import TRACING

if TYPE_CHECKING:
    from aiohttp.client import _RequestOptions


def sticky_keys(
    route: ServerRoute, server_name: str, body: Any, kwargs: Mapping[str, Any]
) -> tuple[str | None, str | None, int | None]:
    """What a call to a replicated server sticks by: its rollout (gym_rpc's context, NeMo Gym's, else the one its
    body names by NeMo Gym's rule: `_ng_rollout_id`, or `_ng_task_index`-`_ng_rollout_index`, as `/seed_session`
    and `/verify` bodies do), the NeMo Gym session its cookies carry for that server, and for a model server's
    route its prompt's number (gym_rpc.client.replicas._prompt_key). No rollout and no session: a call of no
    rollout. A rollout's calls carry different ones (a tool call made where no rollout is bound carries only the
    cookie): the route keeps them as aliases of one pin (gym_rpc.client.replicas._routing)."""
    rollout_id = rollout_id_in_context() or nemo_gym_rollout_id()
    if not rollout_id and isinstance(body, Mapping):
        try:
            rollout_id = rollout_id_from_run_body(body)
        except (ValueError, TypeError):  # a malformed `_ng_rollout_id` or `_ng_attempt_index`: no rollout here
            rollout_id = None
    session = session_pin_key(kwargs.get("cookies"), server_name)
    return rollout_id or None, session, prompt_key(body) if route.affine else None


async def send_routed(
    route: ServerRoute,
    keys: tuple[str | None, str | None, int | None],
    session: aiohttp.ClientSession,
    method: str,
    server_name: str,
    url_path: str,
    retry: RetryPolicy,
    resend_after_disconnect: bool,
    kwargs: _RequestOptions,
) -> aiohttp.ClientResponse:
    """`request` for a server with a route (several instances, labels, or a cap on calls in flight): the call takes
    a place under the cap (waiting within its deadline), picks an instance, counts in flight there, moves on a
    refused connection or a busy answer (the resend loop asks `call.reroute`), and tells the route how it ended."""
    started = monotonic()
    given = kwargs.get("timeout")
    timeout = given if isinstance(given, aiohttp.ClientTimeout) else session.timeout
    total = timeout.total
    deadline = started + total if total else None  # where a body still arriving is the instance's timeout
    cap = route.cap
    if cap is None:
        return await _send(
            route, keys, session, method, server_name, url_path, retry, resend_after_disconnect, kwargs, deadline
        )
    if not await cap.acquire(None if deadline is None else deadline - started):
        raise RequestTimeoutError(
            server_name,
            method,
            url_path,
            total,
            timeout.sock_connect,
            attempts=0,
            elapsed_seconds=monotonic() - started,
            detail=(
                f"it waited for one of the {cap.limit} calls in flight its max_concurrent_requests allows "
                f"({cap.waiting} more waiting)"
            ),
        )
    try:
        if deadline is not None:  # the time left after its wait, if any, is the call's
            kwargs["timeout"] = with_total(timeout, max(deadline - monotonic(), 0.001))
        return await _send(
            route, keys, session, method, server_name, url_path, retry, resend_after_disconnect, kwargs, deadline
        )
    finally:
        cap.release()


async def _send(
    route: ServerRoute,
    keys: tuple[str | None, str | None, int | None],
    session: aiohttp.ClientSession,
    method: str,
    server_name: str,
    url_path: str,
    retry: RetryPolicy,
    resend_after_disconnect: bool,
    kwargs: _RequestOptions,
    deadline: float | None,
) -> aiohttp.ClientResponse:
    call = RoutedCall(route, keys[0], url_path, keys[1], keys[2])
    base = call.instance.url
    try:
        if TRACING.enabled or METRICS.enabled:
            observed = metered_send if METRICS.enabled else traced_send
            response = await observed(
                session,
                method,
                base,
                base + url_path,
                retry,
                resend_after_disconnect,
                kwargs,
                server_name,
                reroute=call.reroute,
            )
        else:
            response = await send(
                session,
                method,
                base + url_path,
                retry,
                resend_after_disconnect,
                kwargs,
                reroute=call.reroute,
                server_name=server_name,
            )
    except BaseException as error:
        call.failed(error)
        raise
    call.answered(response, deadline)
    return response
