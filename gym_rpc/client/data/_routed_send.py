"""A call to a server with several instances, as `ServerClient.request` makes it: what it sticks by (its rollout,
its NeMo Gym session) and its send, which picks the instance, fails over through the resend loop's `reroute`
and tells the route how the call ended (gym_rpc.client.replicas._call_in_flight)."""

from __future__ import annotations

from collections.abc import Mapping
from time import monotonic
from typing import Any

import aiohttp

from gym_rpc.client.data._call_spans import observer_for
from gym_rpc.client.data._http import Call, send
from gym_rpc.client.nemo_gym import rollout_id_from_run_body
from gym_rpc.client.replicas import RoutedCall, ServerRoute, prompt_key, session_pin_key
from gym_rpc.client.resend import with_total
from gym_rpc.errors import RequestTimeoutError

# What a call to a replicated server sticks by: its rollout, its NeMo Gym session, its prompt's number.
StickyKeys = tuple[str | None, str | None, int | None]


def sticky_keys(
    route: ServerRoute, server_name: str, rollout: str | None, body: Any, kwargs: Mapping[str, Any]
) -> StickyKeys:
    """What a call to a replicated server sticks by: its rollout (`rollout`, the call's key from gym_rpc's context
    or NeMo Gym's, else the one its body names by NeMo Gym's rule: `_ng_rollout_id`, or
    `_ng_task_index`-`_ng_rollout_index`, as `/seed_session` and `/verify` bodies do), the NeMo Gym session its
    cookies carry for that server, and for a model server's route its prompt's number
    (gym_rpc.client.replicas._prompt_key). No rollout and no session: a call of no rollout. A rollout's calls carry
    different ones (a tool call made where no rollout is bound carries only the cookie): the route keeps them as
    aliases of one pin (gym_rpc.client.replicas._server_route)."""
    if not rollout and isinstance(body, Mapping):
        try:
            rollout = rollout_id_from_run_body(body)
        except (ValueError, TypeError):  # a malformed `_ng_rollout_id` or `_ng_attempt_index`: no rollout here
            rollout = None
    session = session_pin_key(kwargs.get("cookies"), server_name)
    return rollout or None, session, prompt_key(body) if route.affine else None


async def send_routed(call: Call, route: ServerRoute, keys: StickyKeys, url_path: str) -> aiohttp.ClientResponse:
    """`call` to a server with a route (several instances, labels, or a cap on calls in flight): it takes a place
    under the cap (waiting within its deadline), picks an instance, counts in flight there, moves on a refused
    connection or a busy answer (the resend loop asks the routed call's `reroute`), and tells the route how it
    ended. Its observers are chosen once its instance is known (gym_rpc.client.data._call_spans.observer_for)."""
    started = monotonic()
    kwargs = call.kwargs
    given = kwargs.get("timeout")
    timeout = given if isinstance(given, aiohttp.ClientTimeout) else call.session.timeout
    total = timeout.total
    deadline = started + total if total else None  # where a body still arriving is the instance's timeout
    cap = route.cap
    if cap is not None and not await cap.acquire(None if deadline is None else deadline - started):
        raise RequestTimeoutError(
            call.server,
            call.method,
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
        if cap is not None and deadline is not None:  # the time left after its wait, if any, is the call's
            kwargs["timeout"] = with_total(timeout, max(deadline - monotonic(), 0.001))
        routed = RoutedCall(route, keys[0], url_path, keys[1], keys[2])
        base = routed.instance.url
        call.url = base + url_path
        call.reroute = routed.reroute
        call.observer = observer_for(call, base)
        try:
            response = await send(call)
        except BaseException as error:
            routed.failed(error)
            raise
        routed.answered(response, deadline)
        return response
    finally:
        if cap is not None:
            cap.release()
