"""Server status: the four probe results NeMo Gym knows, and one server's report (the head's prober makes them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

ServerStatus = Literal["success", "connection_error", "timeout", "unknown_error"]
SERVER_STATUSES: tuple[ServerStatus, ...] = get_args(ServerStatus)
# Whether a process of the server is registered with the head, or why it no longer is; None: never registered.
RegistrationState = Literal["registered", "deregistered", "expired"]


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


@dataclass(frozen=True)
class StatusSnapshot:
    """Every server's latest report, current as of `revision`."""

    revision: int
    reports: list[StatusReport]


@dataclass(frozen=True)
class WatchEvent:
    """One message of a status watch: kind is "snapshot", "change" or "heartbeat"."""

    kind: str
    revision: int
    reports: list[StatusReport]
    compacted: bool
    config_version: str = ""  # the head's config version when sent; a change means: fetch the config again
