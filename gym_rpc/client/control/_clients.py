"""The control-plane clients, blocking (`SyncControlClient`) and asyncio (`ControlClient`), made from one table.

`ControlRpcs` is the table: one row per RPC (the gRPC method, a request builder whose signature is the method's,
a response converter, a default deadline). Both clients inherit it, so an RPC cannot exist on one flavour only;
each flavour adds only its call path (gym_rpc.client.control._heads). Every call has a deadline (the client's
`timeout_seconds` unless given), carries the bearer token when one is configured, and turns gRPC failures into
gym_rpc errors that name the head's address and what to check (the gRPC error kept as their cause). Against NeMo
Gym's HTTP head (an `ng_run` deployment) the rows' `http` functions answer instead (client._nemo_gym_control;
which head a call goes to is the head seam's, client._heads).
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2

from gym_rpc.client import nemo_gym
from gym_rpc.client.control._heads import AsyncTransport, BlockingTransport
from gym_rpc.client.control._rpc import Call, Rpc, StreamRpc
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import HEALTH_SERVICE_NAME, ServerStatus, StatusSnapshot, WatchEvent, convert

# --- request builders: each one's signature is the client method's ---


def _head_server_config(*, timeout: float | None = None) -> Call[pb.GetHeadServerConfigRequest]:
    """The head's own host and port."""
    return Call(pb.GetHeadServerConfigRequest(), timeout)


def _global_config(
    *, include_secrets: bool = False, timeout: float | None = None
) -> Call[pb.GetGlobalConfigRequest]:
    """The global config; secrets only with include_secrets and the head's token (else redacted)."""
    return Call(pb.GetGlobalConfigRequest(include_secrets=include_secrets), timeout)


def _global_config_if_changed(
    known_version: str, *, include_secrets: bool = False, timeout: float | None = None
) -> Call[pb.GetGlobalConfigRequest]:
    """The global config when its version is not `known_version`; None (no document sent) when unchanged."""
    return Call(pb.GetGlobalConfigRequest(include_secrets=include_secrets, known_version=known_version), timeout)


def _server_status(
    server_name: str, *, max_age_seconds: float | None = None, timeout: float | None = None
) -> Call[pb.GetServerStatusRequest]:
    """One server's status: max_age_seconds None takes the head's freshness window, 0 asks for a probe now."""
    request = pb.GetServerStatusRequest(server_name=server_name)
    if max_age_seconds is not None:
        if not max_age_seconds >= 0:  # NaN included
            raise ValueError(f"max_age_seconds must be a number >= 0, got {max_age_seconds!r}")
        request.max_age.CopyFrom(convert.seconds_to_duration(max_age_seconds))
    return Call(request, timeout)


def _server_statuses(*, timeout: float | None = None) -> Call[pb.ListServerStatusesRequest]:
    """Every server's latest status from the head's prober, with the revision it is current as of."""
    return Call(pb.ListServerStatusesRequest(), timeout)


def _watch(
    start_revision: int = 0,
    *,
    heartbeat_seconds: float | None = None,
    timeout: float | None = None,
    engine_load: bool = False,
) -> Call[pb.WatchServerStatusesRequest]:
    """Stream events until the caller stops iterating (or `timeout`, when given, ends the stream). One stream:
    it ends with an error when the head goes away; `StatusWatch` reconnects and resumes by itself. `engine_load`
    also asks for "engine_load" events (the engines' load, a few a second at most; a head older than them sends
    none)."""
    request = pb.WatchServerStatusesRequest(start_revision=start_revision, include_engine_load=engine_load)
    if heartbeat_seconds is not None:
        request.heartbeat_interval.CopyFrom(convert.seconds_to_duration(heartbeat_seconds))
    return Call(request, timeout)


def _server_instances(*, timeout: float | None = None) -> Call[pb.ListServerInstancesRequest]:
    """The head and every configured server: type, url, pid, start time, uptime, status."""
    return Call(pb.ListServerInstancesRequest(), timeout)


def _assistant_message_header(
    model_server_name: str, *, timeout: float | None = None
) -> Call[pb.GetAssistantMessageHeaderRequest]:
    """The header bytes the harnesses of that model server declare; None when none does."""
    return Call(pb.GetAssistantMessageHeaderRequest(model_server_name=model_server_name), timeout)


def _reload(*, timeout: float | None = None) -> Call[pb.ReloadGlobalConfigRequest]:
    """Make the head re-read its config file; returns (version, changed)."""
    return Call(pb.ReloadGlobalConfigRequest(), timeout)


def _register(
    server_name: str,
    *,
    listen_port: int,
    listen_host: str = "",
    pid: int = 0,
    start_time: float = 0.0,
    advertise_host: str = "",
    lease_seconds: float | None = None,
    labels: Mapping[str, str] | None = None,
    draining: bool = False,
    server_type: str = "",
    in_flight: int = 0,
    timeout: float | None = None,
) -> Call[pb.RegisterServerInstanceRequest]:
    """Register (or renew) a running server process; returns the base URL the head advertises for it (or, from
    `register_instance`, that URL and the instance the registration holds). At an address no instance of the
    server holds it adds an instance (a replica); at one an instance holds it replaces that instance's process.
    With `lease_seconds` the registration expires unless renewed within that long (None: never). `labels` (at most
    16, gym_rpc.wire.label_problem), `draining` (no new work: the process is stopping), `server_type` (checked
    against the config's) and `in_flight` (calls in flight now, as `gym-rpc status` shows) describe it."""
    request = convert.register_request_to_pb(
        server_name,
        pid=pid,
        start_time=start_time,
        listen_host=listen_host,
        listen_port=listen_port,
        advertise_host=advertise_host,
        lease_seconds=lease_seconds,
        labels=labels,
        draining=draining,
        server_type=server_type,
        in_flight=in_flight,
    )
    return Call(request, timeout)


def _deregister(
    server_name: str, *, pid: int, instance_id: str = "", timeout: float | None = None
) -> Call[pb.DeregisterServerInstanceRequest]:
    """Forget the server's registration made by process `pid` (at `instance_id`, the id its registration
    answered; empty: every one of `pid`); True when one was removed (False: none, or another process's, which only
    its owner may remove). pid 0 names no process: INVALID_ARGUMENT."""
    request = pb.DeregisterServerInstanceRequest(server_name=server_name, pid=pid, instance_id=instance_id)
    return Call(request, timeout)


def _head_health(*, timeout: float | None = None) -> Call[health_pb2.HealthCheckRequest]:
    """The head's own status from its standard health service (`Check("")`), as a probe result."""
    return Call(health_pb2.HealthCheckRequest(service=""), timeout)


def _head_health_watch() -> Call[health_pb2.HealthCheckRequest]:
    """The head's own status as it changes (`Watch("")`): a stream that ends when the head goes away, so one that
    answers after another ended is a head that restarted or came back (registering servers register again then)."""
    return Call(health_pb2.HealthCheckRequest(service=""), None)


# --- response converters ---


def _health_status(response: health_pb2.HealthCheckResponse) -> ServerStatus:
    return "success" if response.status == health_pb2.HealthCheckResponse.SERVING else "unknown_error"


_HEALTH_ERROR_STATUSES: dict[grpc.StatusCode, ServerStatus] = {
    grpc.StatusCode.UNAVAILABLE: "connection_error",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
}


def _health_error(code: grpc.StatusCode) -> ServerStatus:
    return _HEALTH_ERROR_STATUSES.get(code, "unknown_error")


class ControlRpcs:
    """The table: every RPC the control clients offer, declared once for both flavours
    (gym_rpc.client.control._rpc).

    tests/client/control/test_rpc_coverage.py checks it against the proto's service: every RPC has a row, on both
    clients.
    """

    get_head_server_config = Rpc(
        "GetHeadServerConfig", _head_server_config, convert.head_config_from_pb, http=nemo_gym.head_server_config
    )
    get_global_config = Rpc(
        "GetGlobalConfig", _global_config, convert.global_config_from_pb, http=nemo_gym.global_config
    )
    get_global_config_if_changed = Rpc(
        "GetGlobalConfig",
        _global_config_if_changed,
        convert.changed_config_from_pb,
        http=nemo_gym.global_config_if_changed,
    )
    get_server_status = Rpc(
        "GetServerStatus", _server_status, convert.status_response_from_pb, http=nemo_gym.server_status
    )
    list_server_statuses = Rpc(
        "ListServerStatuses", _server_statuses, convert.snapshot_from_pb, http=nemo_gym.server_statuses
    )
    watch_server_statuses = StreamRpc(
        "WatchServerStatuses", _watch, convert.watch_event_from_pb, deadline=None, http=nemo_gym.watch
    )
    list_server_instances = Rpc(
        "ListServerInstances", _server_instances, convert.instances_from_pb, http=nemo_gym.server_instances
    )
    get_assistant_message_header = Rpc(
        "GetAssistantMessageHeader",
        _assistant_message_header,
        convert.header_from_pb,
        http=nemo_gym.assistant_message_header,
    )
    reload_global_config = Rpc("ReloadGlobalConfig", _reload, convert.reload_from_pb)
    register_server_instance = Rpc("RegisterServerInstance", _register, convert.advertised_url_from_pb)
    register_instance = Rpc("RegisterServerInstance", _register, convert.registered_from_pb)
    deregister_server_instance = Rpc("DeregisterServerInstance", _deregister, convert.deregistered_from_pb)
    head_status = Rpc(
        "Check",
        _head_health,
        _health_status,
        service=HEALTH_SERVICE_NAME,
        on_error=_health_error,
        http=nemo_gym.head_health,
    )
    watch_head_health = StreamRpc(
        "Watch", _head_health_watch, _health_status, service=HEALTH_SERVICE_NAME, deadline=None
    )


class SyncControlClient(BlockingTransport, ControlRpcs):
    """Blocking control-plane calls over the process's shared channel to one head.

    `security` (token, TLS) defaults to what the environment says (GYM_RPC_TOKEN, GYM_RPC_TLS_CA, ...).
    """


class ControlClient(AsyncTransport, ControlRpcs):
    """asyncio control-plane calls over the running loop's shared channel to one head.

    `security` (token, TLS) defaults to what the environment says (GYM_RPC_TOKEN, GYM_RPC_TLS_CA, ...).
    """


__all__ = ["ControlClient", "ControlRpcs", "StatusSnapshot", "SyncControlClient", "WatchEvent"]
