"""Where a `ServerClient` calls a server: name -> base URL (cached), or the route over its instances.

A URL comes from the config entry, from NEMO_GYM_MODEL_SERVER_BASE_URL when the launcher named this server, or,
for a wildcard-bound server, from where it registered with the head (an advertised lookup). A server with several
instances (docs/replicas.md) has a route instead: this process's routes (gym_rpc.client.replicas) are made on
first use, fed by this process's follower of the head, and restricted by the client's label selectors.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gym_rpc._environment import environment
from gym_rpc.client.control import HeadView
from gym_rpc.client.data import RolloutTarget, apply_rollout_prefix, call_rollout, rollout_headers
from gym_rpc.config import GlobalConfig, is_wildcard_host
from gym_rpc.errors import UnknownServerError

if TYPE_CHECKING:
    from gym_rpc.client._follower import InstanceFollower
    from gym_rpc.client.data import HttpClientSettings
    from gym_rpc.client.replicas import Routing
    from gym_rpc.wire import EngineLoad, ServerInstance

# A wildcard-bound server not registered yet (or a head that could not say) is dialled on loopback meanwhile and
# asked about again at most this often, so a server registering after the client started is still found.
ADVERTISED_RETRY_SECONDS = 5.0
_advertised_lock = threading.Lock()
# How long a client's first call waits for the head's first list of instances (once per client and process), so
# that a rollout's first call is pinned where its later ones will go. A head that is not there ends the wait.
FIRST_INSTANCES_WAIT_SECONDS = 1.0
_routing_lock = threading.Lock()


def model_server_override(server_name: str) -> str | None:
    """NEMO_GYM_MODEL_SERVER_BASE_URL when NEMO_GYM_MODEL_SERVER_NAME names `server_name`: the URL a launcher gave
    a harness it started where the head is unreachable, rollout prefix included (it binds no rollout context)."""
    override = environment().model_server_override(server_name)
    return override.rstrip("/") if override is not None else None


class Endpoints:
    """One client's way from a server name to where its calls go.

    `base_urls` is the client's `_server_base_urls` (NeMo Gym's cache, the same dict). What travels with a pickled
    client is `portable()`: the caches, the selectors and whether it asks the head; the routes and the follower
    are this process's own (`routing` stays None until the first call here)."""

    def __init__(
        self,
        config: GlobalConfig,
        head: HeadView,
        settings: HttpClientSettings,
        base_urls: dict[str, str],
        *,
        asks_head: bool = True,
    ) -> None:
        self.config = config
        self.head = head
        self.settings = settings
        self.base_urls = base_urls
        # name -> advertised URL of the servers that registered with the head; None until first needed.
        self.advertised_urls: dict[str, str] | None = None
        self.advertised_fetched_at = 0.0  # wall clock (it crosses processes), 0: never
        # False for a client made from an injected NEMO_GYM_CONFIG_DICT: such a process never asks the head by
        # itself (SECURITY.md); its wildcard-bound servers are dialled on loopback until
        # lookup_registered_servers().
        self.asks_head = asks_head
        # server name -> the labels its instances must carry for new work (`require_labels`).
        self.selectors: dict[str, dict[str, str]] = {}
        # Whether the client follows the head's instances: by default when it asks the head.
        self.follows_instances: bool | None = None
        # The routes, once `routing_started` made them (None until then, and in a process that unpickled the
        # client); `pending`: the routes and their follower of the head (or None) as soon as they exist.
        self.routing: Routing | None = None
        self.pending: tuple[Routing, InstanceFollower | None] | None = None

    # --- what travels with the client ---

    def portable(self) -> dict[str, Any]:
        """What a pickled client carries of this: caches, selectors, whether it asks and follows the head."""
        return {
            "base_urls": self.base_urls,
            "advertised_urls": self.advertised_urls,
            "advertised_fetched_at": self.advertised_fetched_at,
            "asks_head": self.asks_head,
            "selectors": self.selectors,
            "follows_instances": self.follows_instances,
        }

    def restore(self, portable: Mapping[str, Any]) -> None:
        """Take what `portable()` gave (in another process): this process's routes are made on first use."""
        self.base_urls.update(portable["base_urls"])
        self.advertised_urls = portable["advertised_urls"]
        self.advertised_fetched_at = portable["advertised_fetched_at"]
        self.asks_head = portable["asks_head"]
        self.selectors.update(portable["selectors"])
        self.follows_instances = portable["follows_instances"]
        named = environment().model_server_name
        if named and model_server_override(named) is not None:
            self.base_urls.pop(named, None)  # this process's launcher URL wins over the sender's cache

    # --- one URL per server name ---

    def resolve(self, server_name: str) -> str:
        """`ServerClient._resolve_base_url`: blocking when the head is asked (from an event loop: `aresolve`)."""
        routed = self.routed_url(server_name, wait=True)
        return routed if routed is not None else self._resolve_with(server_name, self._advertised_base_urls)

    async def aresolve(self, server_name: str) -> str:
        """`resolve` for the event loop: a call to the head runs in a thread, never in the loop (which may be
        serving that head). The loop only reads the answer: it never makes a control call itself, even when the
        next lookup falls due while the thread runs."""
        entry = self.config.servers.get(server_name)
        if entry is not None and is_wildcard_host(entry.host) and self.asks_head and self._advertised_lookup_due():
            import asyncio  # a worker that only asks the head never loads asyncio

            await asyncio.to_thread(self._advertised_base_urls)
        routed = self.routed_url(server_name, wait=False)
        return routed if routed is not None else self._resolve_with(server_name, self._known_advertised_urls)

    def routed_url(self, server_name: str, *, wait: bool) -> str | None:
        """For a server with several instances, the current rollout's instance, else a healthy one; None for a
        server with one (its URL is resolved as it always was)."""
        routing = self.routing
        if routing is None:
            routing = self.routing_started(wait_seconds=FIRST_INSTANCES_WAIT_SECONDS if wait else 0.0)
        route = routing.routes.get(server_name)
        if route is None:
            return None
        return route.any_url(call_rollout())

    def _resolve_with(self, server_name: str, advertised_urls: Callable[[], dict[str, str]]) -> str:
        url = self.base_urls.get(server_name)
        if url is not None:
            return url
        override = model_server_override(server_name)
        if override is not None:
            return override  # never cached: read again per call (only in a harness the launcher set it for)
        servers = self.config.servers
        entry = servers.get(server_name)
        if entry is None:
            self.config.raise_unusable(server_name)
            raise UnknownServerError(server_name, list(servers))
        if not is_wildcard_host(entry.host) or not self.asks_head:
            url = self.base_urls[server_name] = entry.url
            return url
        advertised = advertised_urls().get(server_name)
        if advertised is None:
            return entry.url
        self.base_urls[server_name] = advertised
        return advertised

    def rollout_target(
        self, server_name: str, rollout_id: str | None, token_capture: bool, trace_context: bool
    ) -> RolloutTarget:
        """`ServerClient.rollout_target`: the URL and headers of a rollout's calls, by the entry's form."""
        url = self.resolve(server_name)
        entry = self.config.servers.get(server_name)
        header = None if entry is None else entry.session_affinity_header
        if header is None or model_server_override(server_name) is not None:  # a launcher's URL is as given
            return RolloutTarget(apply_rollout_prefix(url, rollout_id, token_capture, trace_context), {})
        if token_capture:
            raise ValueError(
                f"server {server_name!r} takes a rollout in its {header} header (session_affinity_header): an "
                f"engine or router has no training-token-capture path"
            )
        return RolloutTarget(url, rollout_headers(rollout_id, header, trace_context))

    # --- where wildcard-bound servers registered ---

    def lookup_registered_servers(self) -> dict[str, str]:
        """`ServerClient.lookup_registered_servers`: ask the head now (blocking, bounded)."""
        found = self._fetch_advertised_urls()
        with _advertised_lock:
            self.advertised_urls = {**(self.advertised_urls or {}), **found}
            self.advertised_fetched_at = time.time()
        for name, entry in self.config.servers.items():
            if is_wildcard_host(entry.host) and name in found:
                self.base_urls[name] = found[name]
        return dict(found)

    def _known_advertised_urls(self) -> dict[str, str]:
        return self.advertised_urls or {}

    def _advertised_lookup_due(self) -> bool:
        return self.advertised_urls is None or time.time() - self.advertised_fetched_at >= ADVERTISED_RETRY_SECONDS

    def _advertised_base_urls(self) -> dict[str, str]:
        """name -> advertised URL of the servers registered with the head, fetched when a lookup is due (a head
        that cannot say adds nothing: wildcard-bound servers are dialled on loopback meanwhile)."""
        if self._advertised_lookup_due():
            with _advertised_lock:
                if self._advertised_lookup_due():
                    self.advertised_urls = {**(self.advertised_urls or {}), **self._fetch_advertised_urls()}
                    self.advertised_fetched_at = time.time()
        return self.advertised_urls or {}

    def _fetch_advertised_urls(self) -> dict[str, str]:
        """Every instance the head lists, into this client's routes (a server of several is routed over them
        from now on); name -> advertised URL of the servers registered at one address."""
        rows = self.head.list_instances()
        self.routing_started().apply_rows(rows)
        return _advertised_urls_of(rows)

    # --- replicas: routes to servers with several instances (docs/replicas.md) ---

    def known(self, server_name: str) -> None:
        """Raise UnknownServerError (or the config's reason the entry is unusable) for a name not in the config."""
        if server_name not in self.config.servers:
            self.config.raise_unusable(server_name)
            raise UnknownServerError(server_name, list(self.config.servers))

    def require_labels(self, server_name: str, labels: Mapping[str, str] | None) -> None:
        """`ServerClient.require_labels`."""
        self.known(server_name)
        selector = None if labels is None else _checked_labels(labels)
        if selector is None:
            self.selectors.pop(server_name, None)
        else:
            self.selectors[server_name] = selector
        for routing in (self.routing, self.pending and self.pending[0]):
            if routing is not None:
                routing.set_selector(server_name, selector, self.config)

    def engine_loads(self, server_name: str) -> dict[str, EngineLoad]:
        """`ServerClient.engine_loads`."""
        self.known(server_name)
        return self.routing_started().engine_loads.server(server_name)

    def follow_instances(self, follow: bool) -> None:
        """`ServerClient.follow_instances`."""
        self.follows_instances = follow
        pending = self.pending
        if pending is None:
            return
        routing, follower = pending
        if follow and follower is None:
            follower = self._follower()
            follower.subscribe(routing)
        elif not follow and follower is not None:
            follower.unsubscribe(routing)
            follower = None
        self.pending = (routing, follower)

    def _follower(self) -> InstanceFollower:
        """This process's follower of the head's instances; gRPC loads here, with the first call that needs it."""
        from gym_rpc.client._follower import follower_for

        return follower_for(self.head.address, self.head.security, self.config.head_settings.watch_relay)

    def _follows(self) -> bool:
        return self.asks_head if self.follows_instances is None else self.follows_instances

    def routing_started(self, wait_seconds: float = 0.0) -> Routing:
        """This process's routes for the client, made (and its follower subscribed) on first use; waits up to
        `wait_seconds` (blocking) for the head's first list of instances."""
        with _routing_lock:
            pending = self.pending
            if pending is None:
                config = self.config
                skipped = frozenset(name for name in config.servers if model_server_override(name) is not None)
                from gym_rpc.client.replicas import Routing  # with aiohttp: the data plane's, on first use

                routing = Routing(config, self.settings.outlier_detection, self.selectors, skipped)
                follower = None
                if self._follows():
                    follower = self._follower()
                    follower.subscribe(routing)
                pending = self.pending = (routing, follower)
        routing, follower = pending
        if follower is None or follower.first_snapshot.done():
            self.routing = routing
        elif wait_seconds > 0:
            import concurrent.futures

            concurrent.futures.wait([follower.first_snapshot], wait_seconds)
            self.routing = routing
        return routing

    async def ready_routing(self) -> Routing:
        """`routing_started` for the event loop: the wait for the head's first list of instances (at most
        FIRST_INSTANCES_WAIT_SECONDS, once) never blocks the loop."""
        routing = self.routing_started()
        pending = self.pending
        follower = pending[1] if pending is not None else None
        if follower is not None and not follower.first_snapshot.done():
            import asyncio

            first = asyncio.wrap_future(follower.first_snapshot)
            await asyncio.wait([first], timeout=FIRST_INSTANCES_WAIT_SECONDS)
        self.routing = routing
        return routing


def _advertised_urls_of(instances: list[ServerInstance]) -> dict[str, str]:
    """name -> advertised URL of each server that registered one instance (a server of several has a route)."""
    urls: dict[str, list[str]] = {}
    for instance in instances:
        if instance.advertised_url:
            urls.setdefault(instance.name, []).append(instance.advertised_url)
    return {name: found[0] for name, found in urls.items() if len(found) == 1}


def _checked_labels(labels: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(labels, Mapping) or not all(
        isinstance(key, str) and isinstance(value, str) and key for key, value in labels.items()
    ):
        raise ValueError(
            f"labels must map non-empty strings to strings, e.g. {{'weights_version': '43'}}; got {labels!r}"
        )
    return dict(labels)
