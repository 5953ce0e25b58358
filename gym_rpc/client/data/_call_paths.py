"""Where a data-plane call carries its rollout: in the path (`/ng-rollout/<id>`, Gym servers with observability on,
NeMo Gym's rule) or, for an engine or router entry (`session_affinity_header`), in a header.

`ServerClient` decides once per client which of the two functions below its calls run (`path_rule`): a config
without engine entries keeps `observed_path`, exactly the rule it always had. Its calls of a rollout ask the rule
once per path: `RolloutPaths` remembers what it gave (bench/cpu_count.py: about 3,800 instructions per call less).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gym_rpc.client.data._rollout import rollout_id_in_context
from gym_rpc.client.nemo_gym import nemo_gym_rollout_id, rollout_id_from_run_body
from gym_rpc.config import GlobalConfig
from gym_rpc.wire import RESOURCES_SERVER_TYPE, encode_rollout_id, prefixed_path

if TYPE_CHECKING:
    from aiohttp.client import _RequestOptions

# (config, server name, url path, the call's rollout key, json body, request options) -> the path to send; may
# add a header to the options.
PathRule = Callable[[GlobalConfig, str, str, str | None, Any, "_RequestOptions"], str]


def call_rollout() -> str | None:
    """Which rollout the call being made belongs to, by its context: gym_rpc's `rollout_context`, else NeMo Gym's
    own (when NeMo Gym is loaded); None for none. Worked out once per call (the pipeline's), then handed to the
    path rule, the routing keys and the span; a body's own rollout (`_ng_rollout_id`) is each rule's to read."""
    return rollout_id_in_context() or nemo_gym_rollout_id() or None


def observed_path(
    config: GlobalConfig, server_name: str, url_path: str, rollout: str | None, body: Any, kwargs: _RequestOptions
) -> str:
    """The rollout prefix rule with observability on, as NeMo Gym applies it: the call's rollout (`rollout`, the id
    bound by gym_rpc's `rollout_context`, else by NeMo Gym's own context when NeMo Gym is loaded), else, for
    `/verify` on a resources server, the one the body names (`_ng_rollout_id`, or
    `_ng_task_index`-`_ng_rollout_index`; a malformed one is a ValueError naming the key)."""
    entry = config.servers.get(server_name)
    if entry is None:  # a server known only from NEMO_GYM_MODEL_SERVER_BASE_URL: its URL carries the prefix
        return url_path
    rollout_id = rollout
    if not rollout_id and url_path == "/verify" and entry.server_type == RESOURCES_SERVER_TYPE:
        rollout_id = rollout_id_from_run_body(body)
    return prefixed_path(url_path, entry.server_type, rollout_id)


def engine_aware_path(
    config: GlobalConfig, server_name: str, url_path: str, rollout: str | None, body: Any, kwargs: _RequestOptions
) -> str:
    """The rule of a config with engine entries: a call to one keeps its path and carries the rollout id in the
    entry's header (observability on or off: a router needs it to keep the rollout on one engine); any other call
    follows `observed_path` while observability is on, and is left alone while it is off."""
    entry = config.servers.get(server_name)
    if entry is None:
        return url_path
    header = entry.session_affinity_header
    if header is None:
        if config.observability_enabled:
            return observed_path(config, server_name, url_path, rollout, body, kwargs)
        return url_path
    if rollout:
        # the id by the one rule the path form holds it to: nothing but a plain id reaches a router's header
        kwargs["headers"] = with_session_header(kwargs.get("headers"), header, encode_rollout_id(rollout))
    return url_path


def path_rule(config: GlobalConfig) -> PathRule | None:
    """The rule a client's calls follow, decided once per client: None (no rule: no observability, no engine)."""
    if any(entry.session_affinity_header is not None for entry in config.servers.values()):
        return engine_aware_path
    return observed_path if config.observability_enabled else None


# Entries a client's RolloutPaths holds at most before it starts over: a rollout is one or two entries (its
# model calls, its /verify), so this covers a worker's rollouts in flight at once; past it, calls pay the rule.
ROLLOUT_PATHS_LIMIT = 4096


class RolloutPaths(dict[tuple[str, str, str], str]):
    """What `observed_path` gives a call of a rollout, by (rollout id, server name, path): every call of a rollout
    asks for the same path, so the rule runs for its first only. Read as `paths[rollout, server_name, url_path]`
    (a hit is one dict lookup, no Python call); a miss runs the rule (its typed error raised, nothing kept).

    Only for a call with a rollout: without one, `/verify` takes its id from the body, which is not in the key.
    Bounded: when full it is cleared (a rollout id space has no end). The config is the client's, never rebound."""

    __slots__ = ("config",)

    def __init__(self, config: GlobalConfig) -> None:
        super().__init__()
        self.config = config

    def __missing__(self, key: tuple[str, str, str]) -> str:
        rollout, server_name, url_path = key
        path = observed_path(self.config, server_name, url_path, rollout, None, {})
        if len(self) >= ROLLOUT_PATHS_LIMIT:
            self.clear()
        self[key] = path
        return path


def rollout_paths(config: GlobalConfig, rule: PathRule | None) -> RolloutPaths | None:
    """The memo of a client whose rule is `observed_path` (decided once per client with `path_rule`); None for
    any other rule (an engine entry's header is added to each call's own options: nothing to remember)."""
    return RolloutPaths(config) if rule is observed_path else None


def with_session_header(given: Any, header: str, rollout_id: str) -> Any:
    """The caller's headers plus `header: rollout_id`, in a copy (their mapping is never touched). A session key
    the caller set under that name (in any case) is theirs and wins."""
    if not given:
        return {header: rollout_id}
    from multidict import CIMultiDict  # aiohttp's, loaded with the data plane

    headers: CIMultiDict[str] = CIMultiDict(given)
    headers.setdefault(header, rollout_id)
    return headers
