"""What the head knows of its servers: each server's instances and its one report, the prober (status cache,
revisions, watch history), when changes are pushed, the watch messages built once for every watcher, the
engines' load, and the log lines operators grep for (`events`, a public module).

Exports import on first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc.server.fleet._engine_load import EngineLoads, LoadPush, engine_targets
    from gym_rpc.server.fleet._prober import StatusProber
    from gym_rpc.server.fleet._pushes import (
        DEFAULT_MAX_DELAY_SECONDS,
        DEFAULT_QUIET_SECONDS,
        MAX_PUSH_DELAY_SECONDS,
    )
    from gym_rpc.server.fleet._server_instances import InstanceTarget, config_targets, serves
    from gym_rpc.server.fleet._watch_feed import ReportMessages, WatchFeed

_EXPORTS = {
    "config_targets": "gym_rpc.server.fleet._server_instances",
    "DEFAULT_MAX_DELAY_SECONDS": "gym_rpc.server.fleet._pushes",
    "DEFAULT_QUIET_SECONDS": "gym_rpc.server.fleet._pushes",
    "engine_targets": "gym_rpc.server.fleet._engine_load",
    "EngineLoads": "gym_rpc.server.fleet._engine_load",
    "InstanceTarget": "gym_rpc.server.fleet._server_instances",
    "LoadPush": "gym_rpc.server.fleet._engine_load",
    "MAX_PUSH_DELAY_SECONDS": "gym_rpc.server.fleet._pushes",
    "ReportMessages": "gym_rpc.server.fleet._watch_feed",
    "serves": "gym_rpc.server.fleet._server_instances",
    "StatusProber": "gym_rpc.server.fleet._prober",
    "WatchFeed": "gym_rpc.server.fleet._watch_feed",
}
__all__ = [
    "DEFAULT_MAX_DELAY_SECONDS",
    "DEFAULT_QUIET_SECONDS",
    "MAX_PUSH_DELAY_SECONDS",
    "EngineLoads",
    "InstanceTarget",
    "LoadPush",
    "ReportMessages",
    "StatusProber",
    "WatchFeed",
    "config_targets",
    "engine_targets",
    "serves",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
