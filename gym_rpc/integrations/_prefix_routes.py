"""The aiohttp routes that serve a Gym-prefixed path as the route its stripped path resolves to.

aiohttp picks a request's route (its `match_info`, `request.app`, the sub-apps' middlewares) before any middleware
runs, and a request has no public way to be given another route. So the routing happens where aiohttp routes: two
custom resources (`web.AbstractResource`, aiohttp's documented extension point for routing) claim the paths under
`/ng-rollout` and `/ng-trace`, and answer with the route the stripped path resolves to in the same router (sub-apps
included). aiohttp then assigns that route itself, builds the middleware chain of its apps and sets `request.app`
as for any request; `TraceContextPathMiddleware` only hands the handler a `request.clone()` (which keeps that
route) at the stripped path. `install(app)` registers both on the root app before it starts (a frozen router takes
none).

A path these resources do not take stays with aiohttp's own routing: a malformed prefix (the middleware answers
400), a second prefix inside the stripped path (no route of the app, as before), and the one edge a clone cannot
carry: a stripped path starting with "//" (an empty segment after the prefix, which no Gym client sends), which is
answered 404 as aiohttp answers a path no route serves.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from aiohttp import hdrs, web
from yarl import URL

from gym_rpc.errors import MalformedGymPrefixError
from gym_rpc.wire import ROLLOUT_SEGMENT, TRACE_SEGMENT, GymPrefixes, split_gym_prefixes

# Where the resources leave what they parsed, for the middleware: in the request's own mapping (public), under a
# typed key where aiohttp has them (>= 3.14 warns once for each str key), else a str no handler would pick.
ROUTED_PREFIXES: Any = (
    web.RequestKey("gym_rpc_routed_prefixes", GymPrefixes)
    if hasattr(web, "RequestKey")
    else "gym_rpc_routed_prefixes"
)


async def _no_route(request: web.Request) -> web.StreamResponse:
    raise web.HTTPNotFound()


class GymPrefixResource(web.AbstractResource):
    """Claims the paths under `/<segment>` that carry a well-formed Gym prefix, for the route of the stripped path.

    It lists no routes of its own (`len() == 0`): it serves none, it hands the request on to the one that does.
    """

    def __init__(self, segment: str, router: web.UrlDispatcher) -> None:
        super().__init__()
        self._canonical = f"/{segment}"
        self._router = router
        self._no_route = web.ResourceRoute(hdrs.METH_ANY, _no_route, self)

    @property
    def canonical(self) -> str:
        # The router indexes resources by their canonical path's segments: this one is tried only for paths under
        # it, before the resources indexed at "/" (a catch-all `/{tail:.*}` does not shadow it).
        return self._canonical

    async def resolve(self, request: web.Request) -> tuple[web.UrlMappingMatchInfo | None, set[str]]:
        if ROUTED_PREFIXES in request:  # the stripped path being resolved: a second prefix is a plain path there
            return None, set()
        try:
            prefixes = split_gym_prefixes(request.rel_url.raw_path)
        except MalformedGymPrefixError:
            return None, set()  # the middleware answers 400 with the reason
        if not prefixes.stripped:
            return None, set()
        if prefixes.rest.startswith("//"):
            # clone() would write its raw_path with two more slashes (yarl spells an empty authority): not served.
            return web.UrlMappingMatchInfo({}, self._no_route), set()
        request[ROUTED_PREFIXES] = prefixes  # copied into the clone below, which this resource then passes by
        stripped = request.clone(
            rel_url=URL.build(path=prefixes.rest, query_string=request.rel_url.raw_query_string, encoded=True)
        )
        match_info = await self._router.resolve(stripped)
        return match_info, set()

    def url_for(self, **kwargs: str) -> URL:
        raise RuntimeError(
            f"{self._canonical}/... is routed by gym_rpc's TraceContextPathMiddleware: no URL for it"
        )

    def add_prefix(self, prefix: str) -> None:
        raise RuntimeError(
            "TraceContextPathMiddleware.install(app) belongs on the root aiohttp application, not on a sub-app"
        )

    def get_info(self) -> Any:  # aiohttp's info dict type is private to it
        return {"prefix": self._canonical}

    def raw_match(self, path: str) -> bool:
        return False  # never reused by router.add_resource(path) for a user's route

    def __len__(self) -> int:
        return 0

    def __iter__(self) -> Iterator[web.AbstractRoute]:
        return iter(())


def install_prefix_routes(app: web.Application) -> bool:
    """Register the resources on `app`'s router (once); whether they were already there."""
    if has_prefix_routes(app):
        return True
    router = app.router
    if router.frozen:
        raise RuntimeError(
            "TraceContextPathMiddleware.install(app) must run before the aiohttp app starts (its router is frozen)"
        )
    for segment in (ROLLOUT_SEGMENT, TRACE_SEGMENT):
        router.register_resource(GymPrefixResource(segment, router))
    return False


def has_prefix_routes(app: web.Application) -> bool:
    """Whether `install_prefix_routes(app)` ran."""
    return any(isinstance(resource, GymPrefixResource) for resource in app.router.resources())
