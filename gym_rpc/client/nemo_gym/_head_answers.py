"""The control clients' RPCs answered from NeMo Gym's HTTP head: one function per row of the RPC table.

Each takes the head's endpoints, the row's request message and the call's deadline, and returns what the gRPC row
returns, so `SyncControlClient`, `ControlClient`, `ServerClient` and `gym-rpc status|wait|config` work unchanged
inside an `ng_run` deployment. The config and the instances come from the head; statuses are probed directly, as
NeMo Gym's own client does (the servers concurrently, within the deadline); a watch is those probes repeated,
yielding a snapshot and then each change. What NeMo Gym's head cannot do (reloads, registrations) is refused with
UNIMPLEMENTED and the advice to put `gym-rpc bridge` in front of it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from gym_rpc.client.nemo_gym._head_endpoints import NemoGymEndpoints
from gym_rpc.client.nemo_gym._probe import probe
from gym_rpc.config import HEAD_SERVER_KEY, BaseServerConfig, GlobalConfig, ServerEntry
from gym_rpc.errors import ControlPlaneError, HeadTimeoutError, UnknownServerError
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import ServerInstance, ServerStatus, StatusReport, StatusSnapshot, WatchEvent

# A watch without a heartbeat interval probes every server this often (NeMo Gym's head tells nobody of changes).
WATCH_POLL_SECONDS = 1.0
_MAX_PROBE_THREADS = 32


def unimplemented(method: str, address: str) -> ControlPlaneError:
    return ControlPlaneError(
        f"{method}: the head at {address} is NeMo Gym's HTTP head, which has no {method}; run "
        f"`gym-rpc bridge --upstream http://{address}` and point gym_rpc at the bridge for it",
        address=address,
        code=grpc.StatusCode.UNIMPLEMENTED,
    )


def head_server_config(
    head: NemoGymEndpoints, request: pb.GetHeadServerConfigRequest, timeout: float | None
) -> BaseServerConfig:
    return head.config(_seconds(timeout), include_secrets=False).head_server


def global_config(
    head: NemoGymEndpoints, request: pb.GetGlobalConfigRequest, timeout: float | None
) -> GlobalConfig:
    return head.config(_seconds(timeout), include_secrets=request.include_secrets)


def global_config_if_changed(
    head: NemoGymEndpoints, request: pb.GetGlobalConfigRequest, timeout: float | None
) -> GlobalConfig | None:
    config = head.config(_seconds(timeout), include_secrets=request.include_secrets)
    return None if config.version == request.known_version else config


def server_status(
    head: NemoGymEndpoints, request: pb.GetServerStatusRequest, timeout: float | None
) -> StatusReport:
    """The server probed now (NeMo Gym's head keeps no statuses); the head's own name asks the head."""
    seconds = _seconds(timeout)
    deadline = time.monotonic() + seconds
    if request.server_name == HEAD_SERVER_KEY:
        return _report(HEAD_SERVER_KEY, head.url, deadline)
    config = head.config(seconds, include_secrets=False)
    return _report(request.server_name, config.server(request.server_name).url, deadline)


def server_statuses(
    head: NemoGymEndpoints, request: pb.ListServerStatusesRequest, timeout: float | None
) -> StatusSnapshot:
    seconds = _seconds(timeout)
    deadline = time.monotonic() + seconds
    return _snapshot(head.config(seconds, include_secrets=False), deadline)


def watch(
    head: NemoGymEndpoints, request: pb.WatchServerStatusesRequest, timeout: float | None
) -> Iterator[WatchEvent]:
    """A snapshot, then every change (a changed status, or a changed config: a change without reports), and a
    heartbeat each `heartbeat_interval` when one is asked for, from probes repeated that often (else every
    WATCH_POLL_SECONDS). With a `timeout` the watch ends then, as a gRPC stream's deadline ends it."""
    heartbeat = request.heartbeat_interval.ToNanoseconds() / 1e9 if request.HasField("heartbeat_interval") else 0
    interval = heartbeat or WATCH_POLL_SECONDS
    ends_at = None if timeout is None else time.monotonic() + timeout
    config = head.config(_within(ends_at, interval), include_secrets=False)
    snapshot = _snapshot(config, time.monotonic() + _within(ends_at, interval))
    yield WatchEvent("snapshot", snapshot.revision, snapshot.reports, False, config.version)
    statuses = {r.server_name: r.status for r in snapshot.reports}
    while True:
        pause = interval if ends_at is None else min(interval, ends_at - time.monotonic())
        if pause > 0:
            time.sleep(pause)
        if ends_at is not None and time.monotonic() >= ends_at:
            raise HeadTimeoutError(
                f"the status watch of NeMo Gym's head at {head.address} reached its deadline of {timeout:g} s "
                "(the watch's own timeout; the head answered)",
                address=head.address,
                code=grpc.StatusCode.DEADLINE_EXCEEDED,
            )
        new_config = head.config(_within(ends_at, interval), include_secrets=False)
        snapshot = _snapshot(new_config, time.monotonic() + _within(ends_at, interval))
        changed = [r for r in snapshot.reports if statuses.get(r.server_name) != r.status]
        statuses = {r.server_name: r.status for r in snapshot.reports}
        if changed or new_config.version != config.version:
            yield WatchEvent("change", snapshot.revision, changed, False, new_config.version)
        elif heartbeat:
            yield WatchEvent("heartbeat", snapshot.revision, [], False, new_config.version)
        config = new_config


def server_instances(
    head: NemoGymEndpoints, request: pb.ListServerInstancesRequest, timeout: float | None
) -> list[ServerInstance]:
    return head.instances(_seconds(timeout))


def assistant_message_header(
    head: NemoGymEndpoints, request: pb.GetAssistantMessageHeaderRequest, timeout: float | None
) -> bytes | None:
    config = head.config(_seconds(timeout), include_secrets=False)
    if request.model_server_name not in config.servers:
        raise UnknownServerError(request.model_server_name, list(config.servers))
    return config.assistant_message_header(request.model_server_name)


def head_health(head: NemoGymEndpoints, request: object, timeout: float | None) -> ServerStatus:
    return head.status(_seconds(timeout))


def _seconds(timeout: float | None) -> float:
    """Every HTTP request is bounded; a call without a deadline (none of these rows has none) gets a minute."""
    return 60.0 if timeout is None else timeout


def _within(ends_at: float | None, interval: float) -> float:
    """One round's deadline: the poll interval, never past the watch's end."""
    left = interval if ends_at is None else ends_at - time.monotonic()
    return max(min(interval, left), 0.001)


def _report(name: str, url: str, deadline: float) -> StatusReport:
    result = probe(url, max(deadline - time.monotonic(), 0.001))
    return StatusReport(
        server_name=name,
        status=result.status,
        url=url,
        latency_seconds=result.latency_seconds,
        checked_at=result.checked_at,
        detail=result.detail,
        http_status=result.http_status,
    )


def _snapshot(config: GlobalConfig, deadline: float) -> StatusSnapshot:
    """Every server probed at once, each within the deadline; the revision is the time of the round in ms."""
    servers: list[ServerEntry] = list(config.servers.values())
    revision = time.time_ns() // 1_000_000
    if not servers:
        return StatusSnapshot(revision, [])
    with ThreadPoolExecutor(min(len(servers), _MAX_PROBE_THREADS)) as pool:
        reports = list(pool.map(lambda entry: _report(entry.name, entry.url, deadline), servers))
    return StatusSnapshot(revision, reports)
