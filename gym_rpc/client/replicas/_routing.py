"""A client's routes (`Routing`), by server name: made from the config (its static replicas), then kept current
from what the follower hands in: the head's reports (`apply_reports`), its instance rows (`apply_rows`) and the
worker's label selectors (`set_selector`). A name gets a route (gym_rpc.client.replicas._server_route: how a
route picks) when it has more than one instance, a label selector or a cap on calls in flight. Nothing here runs
per call.

Names with one instance have no route: `ServerClient.request` takes its old path for them, at its old cost.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from gym_rpc.client.replicas._engine_load_table import EngineLoadTable
from gym_rpc.client.replicas._instance_state import (
    Instance,
    InstanceState,
    InstanceView,
    config_states,
    report_states,
)
from gym_rpc.client.replicas._server_route import Selector, ServerRoute
from gym_rpc.client.resend import ConcurrencyCap
from gym_rpc.config import url_authority
from gym_rpc.wire import MODEL_SERVER_TYPE, RESOURCES_SERVER_TYPE

if TYPE_CHECKING:
    from gym_rpc.client.replicas._outliers import OutlierDetection
    from gym_rpc.config import GlobalConfig
    from gym_rpc.wire import ServerInstance, StatusReport

# Every live Routing of the process, for the worker metrics' per-instance counts.
ROUTINGS: weakref.WeakSet[Routing] = weakref.WeakSet()


class Routing:
    """A client's routes, by server name: made from the config (its static replicas), then kept current from the
    head's reports. `routes` holds only names with more than one instance (or a label selector)."""

    __slots__ = (
        "__weakref__",
        "affine",
        "caps",
        "engine_loads",
        "movable",
        "policy",
        "routes",
        "selectors",
        "skipped",
    )

    def __init__(
        self,
        config: GlobalConfig,
        policy: OutlierDetection,
        selectors: Mapping[str, Selector],
        skipped: frozenset[str] = frozenset(),
    ) -> None:
        self.policy = policy
        self.selectors = dict(selectors)
        self.skipped = skipped  # names a launcher's override URL stands for: never routed
        # The engines' load as the head reads it, pushed by the follower; a picker reads it (`.of(name, id)`).
        self.engine_loads = EngineLoadTable()
        # model servers: their routes pick by prompt (prefix-affine); every other kind keeps exact stickiness
        self.affine = frozenset(
            name for name, entry in config.servers.items() if entry.server_type == MODEL_SERVER_TYPE
        )
        self.routes: dict[str, ServerRoute] = {}
        # Names with a cap on calls in flight get a route even with one instance (decided once per name: the
        # one-instance path of the others stays as it was).
        self.caps = {
            name: entry.max_concurrent_requests
            for name, entry in config.servers.items()
            if entry.max_concurrent_requests is not None
        }
        # A rollout's busy call may move to another instance only where the config says it keeps no state there.
        self.movable = frozenset(
            name for name, entry in config.servers.items() if entry.server_type != RESOURCES_SERVER_TYPE
        )
        for name, entry in config.servers.items():
            states = config_states(entry)
            if name not in skipped and (len(states) > 1 or name in self.selectors or name in self.caps):
                self.routes[name] = self._route(name, states)
        ROUTINGS.add(self)

    def apply_reports(self, reports: Iterable[StatusReport]) -> None:
        """The head's latest reports (a snapshot or changes): each server's instances as the head lists them."""
        for report in reports:
            if report.instances:
                self._set(report.server_name, report_states(report))
            else:  # a head older than replicas: the report is the one instance it knows (the config's)
                route = self.routes.get(report.server_name)
                if route is not None and route.instances:
                    first = route.instances[0]
                    route.update(
                        [
                            InstanceState(
                                first.instance_id,
                                first.url,
                                report.status,
                                report.checked_at,
                                http_status=report.http_status,
                            ),
                            *(_state_of(instance) for instance in route.instances[1:]),
                        ]
                    )

    def apply_rows(self, rows: Iterable[ServerInstance]) -> None:
        """ListServerInstances rows (one per instance of every server), as `lookup_registered_servers` has them."""
        by_name: dict[str, list[InstanceView]] = {}
        for row in rows:
            if not row.instance_id:
                continue  # the head's own row, or a head older than replicas (one instance per server)
            url = row.advertised_url or row.url
            by_name.setdefault(row.name, []).append(
                InstanceState(
                    row.instance_id or url_authority(url),
                    url,
                    row.status,
                    draining=row.draining,
                    labels=row.labels,
                    origin=row.origin,
                )
            )
        for name, states in by_name.items():
            self._set(name, states)

    def _set(self, name: str, states: Sequence[InstanceView]) -> None:
        if name in self.skipped:
            return
        route = self.routes.get(name)
        if route is not None:
            route.update(states)
        elif len(states) > 1 or name in self.selectors or name in self.caps:
            self.routes[name] = self._route(name, states)

    def _route(self, name: str, states: Sequence[InstanceView]) -> ServerRoute:
        affine = name in self.affine
        loads = self.engine_loads if affine else None
        route = ServerRoute(name, states, self.policy, self.selectors.get(name), affine, loads)
        limit = self.caps.get(name)
        route.cap = None if limit is None else ConcurrencyCap(limit)
        route.moves_rollouts = name in self.movable
        return route

    def set_selector(self, name: str, selector: Selector | None, config: GlobalConfig) -> None:
        if selector is None:
            self.selectors.pop(name, None)
        else:
            self.selectors[name] = selector
        route = self.routes.get(name)
        if route is not None:
            route.set_selector(selector)
        elif selector is not None and name not in self.skipped:
            entry = config.servers.get(name)
            states = config_states(entry) if entry is not None else []
            self.routes[name] = self._route(name, states)


def _state_of(instance: Instance) -> InstanceState:
    return InstanceState(
        instance.instance_id,
        instance.url,
        instance.status,
        instance.checked_at,
        instance.draining,
        None,
        instance.registration,
        instance.origin,
        instance.http_status,
    )
