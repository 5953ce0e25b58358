"""A `ServerClient`'s data plane: its calls to Gym servers, from a server name and a path to aiohttp's answer.

Made on the client's first call (its `_data_plane`), so aiohttp and the data plane's modules (replicas routing
included) load then, never with server_client (a process that only asks the head never loads them). It holds what
every call reads, as plain attributes: the client's base URLs, typed config, pools and endpoints (pydantic's
private attributes would cost each read a BaseModel.__getattr__, about 1.5 µs: bench/hot_path.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel

from gym_rpc.client.data._call_paths import call_rollout, path_rule, rollout_paths
from gym_rpc.client.data._call_spans import observer_for
from gym_rpc.client.data._http import Call, json_payload, send
from gym_rpc.client.data._rollout import rollout_id_in_context
from gym_rpc.client.data._routed_send import send_routed, sticky_keys
from gym_rpc.client.resend import BACKPRESSURE_STATUSES, Backpressure, resend_after_failure
from gym_rpc.metrics import METRICS
from gym_rpc.telemetry import TRACING

if TYPE_CHECKING:
    from typing import Unpack

    import aiohttp
    from aiohttp.client import _RequestOptions

    from gym_rpc.client.data._http_pools import HttpPools
    from gym_rpc.client.replicas import Routing
    from gym_rpc.config import GlobalConfig


class Targets(Protocol):
    """Where a client's calls go (ServerClient's endpoints, gym_rpc.client._endpoints): asked on a call only when
    its URL is not cached yet, and once for the routes."""

    base_urls: dict[str, str]
    config: GlobalConfig
    routing: Routing | None

    async def ready_routing(self) -> Routing: ...

    async def aresolve(self, server_name: str) -> str: ...


class DataPlane:
    """One client's calls. It refers to the client's own base URLs, config, pools and endpoints, which are never
    rebound once set; a copy or an unpickled client gets its own (ServerClient never copies or pickles this)."""

    __slots__ = ("base_urls", "config", "endpoints", "path_rule", "pools", "rollout_paths", "routing")

    def __init__(self, endpoints: Targets, pools: HttpPools) -> None:
        self.endpoints = endpoints
        self.base_urls = endpoints.base_urls
        self.config: GlobalConfig = endpoints.config
        # Where calls carry their rollout (None: nowhere, no observability and no engine entry), decided once.
        self.path_rule = path_rule(self.config)
        self.rollout_paths = rollout_paths(self.config, self.path_rule)  # what the rule gave a rollout's calls
        self.pools = pools
        self.routing: Routing | None = endpoints.routing  # None until the first call waited for the instances

    async def call(
        self,
        method: str,
        server_name: str,
        url_path: str,
        _control: bool = False,
        _resend_after_disconnect: bool = True,
        **kwargs: Unpack[_RequestOptions],
    ) -> aiohttp.ClientResponse:
        """`request`, `post` and `get`: where the call goes (a cached URL, or the server's route), its body, its
        rollout key (worked out once, when something reads it: the path rule, the route, the span), its path,
        then one `Call` through `send` (or the routed send), its observers chosen in one place
        (gym_rpc.client.data._call_spans.observer_for).

        What a call keeps alive while it waits is what the collector pays for at thousands in flight (bench/
        allocations.py): after the first call `client.post(...)` and `client.get(...)` are this coroutine itself
        (ServerClient's direct calls), and a call nobody observes, to a server of one instance, makes its first
        attempt here, with neither a `Call` nor a coroutine of `send`'s (the "inline first attempt" row of
        bench/allocations.py counts what that saves): they are made only after a failure.
        """
        routing = self.routing
        if routing is None:
            routing = self.routing = await self.endpoints.ready_routing()
        route = routing.routes.get(server_name)
        if route is None:
            url = self.base_urls.get(server_name) or await self.endpoints.aresolve(server_name)
        body = kwargs.pop("json", None)
        if body is not None:
            if type(body) is not dict and isinstance(body, BaseModel):  # BaseModel's isinstance is an ABC check
                body = body.model_dump(mode="json", exclude_unset=True)
            if kwargs.get("data") is not None:
                raise ValueError("data and json parameters can not be used at the same time")
            kwargs["data"] = json_payload(body)
        observed = METRICS.enabled or TRACING.enabled  # what metrics and tracing cost when off: these two checks
        rule = self.path_rule  # decided once per client (gym_rpc.client.data._call_paths)
        if rule is None:
            rollout = call_rollout() if route is not None or observed else None
        else:
            # call_rollout's first choice without its Python call: `rollout_context`'s id, else the whole lookup
            rollout = rollout_id_in_context() or call_rollout()
            paths = self.rollout_paths
            if paths is not None and type(rollout) is str:  # a rollout (never ""): the key's own type
                url_path = paths[rollout, server_name, url_path]  # the rule's path, asked once per rollout
            else:
                url_path = rule(self.config, server_name, url_path, rollout, body, kwargs)
        pools = self.pools
        sessions = pools.sessions()
        session = sessions.control if _control else sessions.data
        calls = sessions.calls  # the loop's calls in flight: the client-wide resend budget's measure of load
        calls.value += 1
        try:
            if route is not None or observed:  # a Call from the start: its route or its observers read it
                call = Call(
                    session,
                    method,
                    url_path if route is not None else url + url_path,  # routed: its instance's URL goes in front
                    kwargs,
                    pools.settings.retry,
                    server=server_name,
                    resend=_resend_after_disconnect,
                    rollout=rollout,
                )
                if route is not None:
                    keys = sticky_keys(route, server_name, rollout, body, kwargs)
                    return await send_routed(call, route, keys, url_path)
                call.observer = observer_for(call, url)
                if call.observer is not None:
                    return await send(call)
                # nobody observes it (a child of an unsampled parent, its context in the headers): sent as below,
                full_url = call.url
                del call  # and the Call not kept alive while it waits
            else:
                full_url = url + url_path
            started = time.monotonic()  # the start of the call's deadline, as in `send`
            try:
                response = await session.request(method, full_url, **kwargs)
            except BaseException as error:
                failure = error
            else:
                status = response.status
                if status < 429 or status not in BACKPRESSURE_STATUSES:  # most answers: one int comparison
                    return response
                failure = Backpressure(response)  # busy: asked again after its Retry-After, within budget
            failed = Call(  # a call sent here becomes a Call only now, for its resends
                session,
                method,
                full_url,
                kwargs,
                pools.settings.retry,
                server=server_name,
                resend=_resend_after_disconnect,
                rollout=rollout,
            )
            failed.started = started
            return await resend_after_failure(failed, failure)
        finally:
            calls.value -= 1
