"""Server status: the four probe results NeMo Gym knows, and one server's report (the head's prober makes them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

ServerStatus = Literal["success", "connection_error", "timeout", "unknown_error"]
SERVER_STATUSES: tuple[ServerStatus, ...] = get_args(ServerStatus)
# Whether a process of the server is registered with the head, or why it no longer is; None: never registered.
RegistrationState = Literal["registered", "deregistered", "expired"]
# Where an instance of a server comes from: the config entry's own address, a static replica listed in the config,
# or a process that registered at an address of its own; None: a head older than replicas did not say.
InstanceOrigin = Literal["config", "static_replica", "registered"]


@dataclass(frozen=True)
class InstanceReport:
    """One instance (replica) of a server: its own address, probe result, registration, labels and draining flag.

    `instance_id` is the authority (`host:port`) of `url`: stable while the address is, so a process restarting at
    the same address is the same instance."""

    instance_id: str
    url: str
    status: ServerStatus | None = None  # None until its first probe
    detail: str = ""
    http_status: int = 0
    latency_seconds: float = 0.0
    checked_at: float = 0.0  # epoch seconds; 0 when never checked
    registration: RegistrationState | None = None
    draining: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)
    origin: InstanceOrigin | None = None
    pid: int = 0
    start_time: float = 0.0  # epoch seconds; 0 when unknown


@dataclass(frozen=True)
class StatusReport:
    """One server's probe result. `status` is None until the server has been probed once."""

    server_name: str
    status: ServerStatus | None
    url: str
    latency_seconds: float = 0.0
    checked_at: float = 0.0  # epoch seconds; 0 when never checked
    detail: str = ""
    http_status: int = 0
    registration: RegistrationState | None = None
    advertised_url: str = ""  # where the head sends clients while the server is registered
    # Every instance of the server, the config's first (proto: ServerStatusReport.instances); empty from a head
    # older than replicas, which has one instance per server (`url`).
    instances: tuple[InstanceReport, ...] = ()


# A figure of an engine's load older than this is unknown, on the head (what it sends) and in clients (what they
# picked by): an engine that stopped answering its /metrics is never taken for an idle one.
ENGINE_LOAD_MAX_AGE_SECONDS = 5.0


@dataclass(frozen=True)
class EngineLoad:
    """What the head last read from one engine instance's `/metrics` (an entry with `session_affinity_header`):
    requests waiting and running, and KV-cache use (0 to 1). None is unknown (not reported, never read, or read
    too long ago), never zero. `age_seconds` is how old the figures were when the head sent them."""

    server_name: str
    instance_id: str
    waiting: float | None = None
    running: float | None = None
    kv_cache_usage: float | None = None
    age_seconds: float | None = None  # None: never read


@dataclass(frozen=True)
class StatusSnapshot:
    """Every server's latest report, current as of `revision`, and each engine instance's load."""

    revision: int
    reports: list[StatusReport]
    engine_loads: list[EngineLoad] = field(default_factory=list)


@dataclass(frozen=True)
class WatchEvent:
    """One message of a status watch: kind is "snapshot", "change", "heartbeat" or (asked for) "engine_load"."""

    kind: str
    revision: int
    reports: list[StatusReport]
    compacted: bool
    config_version: str = ""  # the head's config version when sent; a change means: fetch the config again
    engine_loads: list[EngineLoad] = field(default_factory=list)  # "engine_load" only: every engine instance's
