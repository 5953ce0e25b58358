"""The conversion layer: the only hand-written module that builds or reads `gym_rpc.v1` messages field by field.

Everything else speaks gym_rpc's own types (GlobalConfig, ServerEntry, StatusReport, ServerStatus).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ParamSpec, TypeVar, cast

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from gym_rpc.config import (
    HEAD_SERVER_KEY,
    BaseServerConfig,
    GlobalConfig,
    ServerEntry,
    base_url,
    redact_secrets,
    url_authority,
)
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire._status import (
    EngineLoad,
    InstanceOrigin,
    InstanceReport,
    RegistrationState,
    ServerStatus,
    StatusReport,
    StatusSnapshot,
    WatchEvent,
)

_STATUS_TO_PB: dict[ServerStatus | None, pb.ServerStatus.ValueType] = {
    None: pb.SERVER_STATUS_UNSPECIFIED,
    "success": pb.SERVER_STATUS_SUCCESS,
    "connection_error": pb.SERVER_STATUS_CONNECTION_ERROR,
    "timeout": pb.SERVER_STATUS_TIMEOUT,
    "unknown_error": pb.SERVER_STATUS_UNKNOWN_ERROR,
}
_STATUS_FROM_PB: dict[int, ServerStatus | None] = {v: k for k, v in _STATUS_TO_PB.items()}
_P = ParamSpec("_P")
_T = TypeVar("_T")


def status_to_pb(status: ServerStatus | None) -> pb.ServerStatus.ValueType:
    return _STATUS_TO_PB[status]


def status_from_pb(status: int) -> ServerStatus | None:
    """None for UNSPECIFIED (not probed yet) and for values a newer head may add."""
    return _STATUS_FROM_PB.get(status)


def seconds_to_duration(seconds: float) -> Duration:
    duration = Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration


def epoch_to_timestamp(epoch_seconds: float) -> Timestamp:
    timestamp = Timestamp()
    timestamp.FromNanoseconds(round(epoch_seconds * 1e9))
    return timestamp


_REGISTRATION_TO_PB: dict[RegistrationState | None, pb.RegistrationState.ValueType] = {
    None: pb.REGISTRATION_STATE_UNSPECIFIED,
    "registered": pb.REGISTRATION_STATE_REGISTERED,
    "deregistered": pb.REGISTRATION_STATE_DEREGISTERED,
    "expired": pb.REGISTRATION_STATE_EXPIRED,
}
_REGISTRATION_FROM_PB: dict[int, RegistrationState | None] = {v: k for k, v in _REGISTRATION_TO_PB.items()}


_ORIGIN_TO_PB: dict[InstanceOrigin | None, pb.InstanceOrigin.ValueType] = {
    None: pb.INSTANCE_ORIGIN_UNSPECIFIED,
    "config": pb.INSTANCE_ORIGIN_CONFIG,
    "static_replica": pb.INSTANCE_ORIGIN_STATIC_REPLICA,
    "registered": pb.INSTANCE_ORIGIN_REGISTERED,
}
_ORIGIN_FROM_PB: dict[int, InstanceOrigin | None] = {v: k for k, v in _ORIGIN_TO_PB.items()}


def instance_report_to_pb(instance: InstanceReport) -> pb.InstanceReport:
    message = pb.InstanceReport(
        instance_id=instance.instance_id,
        url=instance.url,
        status=status_to_pb(instance.status),
        detail=instance.detail,
        http_status=instance.http_status,
        registration=_REGISTRATION_TO_PB[instance.registration],
        draining=instance.draining,
        labels=instance.labels,
        origin=_ORIGIN_TO_PB[instance.origin],
        pid=instance.pid,
    )
    if instance.checked_at:
        message.latency.CopyFrom(seconds_to_duration(instance.latency_seconds))
        message.checked_at.CopyFrom(epoch_to_timestamp(instance.checked_at))
    if instance.start_time > 0:
        message.start_time.CopyFrom(epoch_to_timestamp(instance.start_time))
    return message


def _seconds(message: Duration | Timestamp) -> float:
    """`message.ToNanoseconds() / 1e9` from its two public fields, without that method's range check: a status
    report has four of them (its own and its instance's latency and check time)."""
    return (message.seconds * 1_000_000_000 + message.nanos) / 1e9


def _made_without_init(cls: Callable[_P, _T]) -> Callable[_P, _T]:
    """`cls(**fields)` for a frozen dataclass, typed as its constructor, made as pickle restores one (its fields
    put in its `__dict__`) instead of by its `__init__`, which sets each field through `object.__setattr__`: that
    was 40 % of converting the status reports of a ListServerStatuses or a watch (bench/control_plane.py, "status
    of 200 servers"). Every field must be given, by keyword (no defaults are filled in):
    tests/wire/test_wire_instances.py checks that the converters give them all."""

    def made(*args: _P.args, **fields: _P.kwargs) -> _T:
        if args:
            raise TypeError(f"{getattr(cls, '__name__', cls)} fields go by keyword here")
        instance: _T = object.__new__(cast(type[_T], cls))
        instance.__dict__.update(fields)
        return instance

    return made


_new_instance_report = _made_without_init(InstanceReport)
_new_status_report = _made_without_init(StatusReport)


def instance_report_from_pb(message: pb.InstanceReport) -> InstanceReport:
    labels = message.labels
    return _new_instance_report(
        instance_id=message.instance_id,
        url=message.url,
        status=_STATUS_FROM_PB.get(message.status),
        detail=message.detail,
        http_status=message.http_status,
        latency_seconds=_seconds(message.latency),
        checked_at=_seconds(message.checked_at),
        registration=_REGISTRATION_FROM_PB.get(message.registration),
        draining=message.draining,
        labels=dict(labels) if labels else {},
        origin=_ORIGIN_FROM_PB.get(message.origin),  # None too for values a newer head adds
        pid=message.pid,
        start_time=_seconds(message.start_time) if message.HasField("start_time") else 0.0,
    )


def report_to_pb(report: StatusReport) -> pb.ServerStatusReport:
    message = pb.ServerStatusReport(
        server_name=report.server_name,
        status=status_to_pb(report.status),
        url=report.url,
        detail=report.detail,
        http_status=report.http_status,
        registration=_REGISTRATION_TO_PB[report.registration],
        advertised_url=report.advertised_url,
        instances=[instance_report_to_pb(instance) for instance in report.instances],
    )
    if report.checked_at:
        message.latency.CopyFrom(seconds_to_duration(report.latency_seconds))
        message.checked_at.CopyFrom(epoch_to_timestamp(report.checked_at))
    return message


def report_from_pb(message: pb.ServerStatusReport) -> StatusReport:
    return _new_status_report(
        server_name=message.server_name,
        status=_STATUS_FROM_PB.get(message.status),
        url=message.url,
        latency_seconds=_seconds(message.latency),
        checked_at=_seconds(message.checked_at),
        detail=message.detail,
        http_status=message.http_status,
        registration=_REGISTRATION_FROM_PB.get(message.registration),  # None too for values a newer head adds
        advertised_url=message.advertised_url,
        instances=tuple([instance_report_from_pb(instance) for instance in message.instances]),
    )


def head_server_to_pb(config: GlobalConfig) -> pb.HeadServer:
    return pb.HeadServer(host=config.head_server.host, port=config.head_server.port)


def head_server_from_pb(message: pb.HeadServer) -> BaseServerConfig:
    return BaseServerConfig(host=message.host, port=message.port)


def global_config_to_pb(config: GlobalConfig, *, include_secrets: bool) -> pb.GetGlobalConfigResponse:
    """Built once per config version on the head, then served as is."""
    redact = not include_secrets
    return pb.GetGlobalConfigResponse(
        version=config.version,
        head_server=head_server_to_pb(config),
        servers=[_entry_to_pb(entry, redact) for entry in config.servers.values()],
        checkpoint_enabled=config.checkpoint_enabled,
        observability_enabled=config.observability_enabled,
        config_json=config.redacted_json if redact else config.config_json,
    )


def _entry_to_pb(entry: ServerEntry, redact: bool) -> pb.ServerEntry:
    return pb.ServerEntry(
        name=entry.name,
        server_type=entry.server_type,
        impl_name=entry.impl_name,
        host=entry.host,
        port=entry.port,
        url=entry.url,
        config_json=json.dumps(redact_secrets(entry.config) if redact else entry.config, ensure_ascii=False),
    )


def global_config_from_pb(message: pb.GetGlobalConfigResponse) -> GlobalConfig:
    """Rebuild the typed view from the exact JSON the head resolved and validated (GlobalConfig.from_served_json).
    The version stays the head's: one computed here from a redacted document would miss secret changes and
    disagree with ReloadGlobalConfig."""
    return GlobalConfig.from_served_json(message.config_json, message.version)


@dataclass(frozen=True)
class ServerInstance:
    """One row of `gym status`."""

    name: str
    server_type: str
    impl_name: str
    url: str
    pid: int
    start_time: float
    status: ServerStatus | None
    advertised_url: str = ""  # set when the server registered (RegisterServerInstance)
    instance_id: str = ""  # which instance of the server this row is; "" for the head's own row
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    draining: bool = False
    origin: InstanceOrigin | None = None
    in_flight: int = 0  # calls in flight its process reported at its latest registration or renewal


@dataclass(frozen=True)
class RegisteredInstance:
    """What RegisterServerInstance answers: where clients are sent, and the instance the registration holds (the
    id to deregister it by)."""

    advertised_url: str
    instance_id: str


@dataclass(frozen=True)
class ReportedProcess:
    """The process serving one server, as a config source reports it (NeMo Gym's /server_instances)."""

    pid: int
    start_time: float  # epoch seconds; 0 when unknown


@dataclass(frozen=True)
class InstanceRegistration:
    """One running server process, as it registered."""

    server_name: str
    pid: int
    start_time: float  # epoch seconds; 0 when not known
    listen_host: str
    port: int
    advertised_host: str
    # The head's time.monotonic() when this registration (or its latest renewal) arrived: the lease runs from it,
    # so stepping the wall clock neither expires a live registration nor keeps a dead one. Never shown.
    registered_at: float
    lease_ttl: float = 0.0  # seconds the registration lives without a renewal; 0: no expiry (the head grants one)
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    draining: bool = False  # the process is stopping: no new work for it
    server_type: str = ""  # the type it says it serves as; "" when not said
    in_flight: int = 0  # calls in flight in the process when it (re)registered
    # The IP address the registration came from ("" when unknown): what holds its instance (gym_rpc.server.
    # _registry). Never shown.
    peer_host: str = ""

    @property
    def advertised_url(self) -> str:
        return base_url(self.advertised_host, self.port)

    @property
    def advertised_id(self) -> str:
        """The authority of `advertised_url`: the instance id of an instance at the address it advertised."""
        return url_authority(self.advertised_url)

    @property
    def expires_at(self) -> float | None:
        """The time.monotonic() after which an unrenewed registration is dropped; None when it never expires."""
        return self.registered_at + self.lease_ttl if self.lease_ttl > 0 else None


def head_instance_to_pb(config: GlobalConfig, pid: int, start_time: float) -> pb.ServerInstance:
    return pb.ServerInstance(
        name=HEAD_SERVER_KEY,
        server_type=HEAD_SERVER_KEY,
        url=base_url(config.head_server.host, config.head_server.port),
        pid=pid,
        start_time=epoch_to_timestamp(start_time),
        uptime=seconds_to_duration(time.time() - start_time),
        status=pb.SERVER_STATUS_SUCCESS,
    )


def server_instances_to_pb(
    entry: ServerEntry,
    report: StatusReport,
    process: ReportedProcess | None = None,
    in_flight: Mapping[str, int] | None = None,
) -> list[pb.ServerInstance]:
    """A configured server as ListServerInstances shows it: one row per instance of its report, in its order.

    The config instance's row keeps what the row of a server has always said: `url` is the config's, and
    `advertised_url` where its registration said clients reach it; what the config source reports of its process
    (a NeMo Gym upstream's /server_instances) wins over what a registration said. Every other instance's row has
    its own URL (its advertised one while it is registered). `in_flight`: instance id -> the calls in flight its
    process last reported."""
    rows = []
    for instance in report.instances:
        is_config = instance.origin == "config"
        message = pb.ServerInstance(
            name=entry.name,
            server_type=entry.server_type,
            impl_name=entry.impl_name,
            url=entry.url if is_config else instance.url,
            pid=instance.pid,
            status=status_to_pb(instance.status),
            instance_id=instance.instance_id,
            labels=instance.labels,
            draining=instance.draining,
            origin=_ORIGIN_TO_PB[instance.origin],
            in_flight=(in_flight or {}).get(instance.instance_id, 0),
        )
        if is_config:
            message.advertised_url = report.advertised_url
        elif instance.registration == "registered":
            message.advertised_url = instance.url
        started = instance.start_time
        if is_config and process is not None:
            message.pid = process.pid
            started = process.start_time or started
        if started > 0:
            message.start_time.CopyFrom(epoch_to_timestamp(started))
            message.uptime.CopyFrom(seconds_to_duration(max(0.0, time.time() - started)))
        rows.append(message)
    return rows


def instance_from_pb(message: pb.ServerInstance) -> ServerInstance:
    return ServerInstance(
        name=message.name,
        server_type=message.server_type,
        impl_name=message.impl_name,
        url=message.url,
        pid=message.pid,
        start_time=message.start_time.ToNanoseconds() / 1e9 if message.HasField("start_time") else 0.0,
        status=status_from_pb(message.status),
        advertised_url=message.advertised_url,
        instance_id=message.instance_id,
        labels=dict(message.labels),
        draining=message.draining,
        origin=_ORIGIN_FROM_PB.get(message.origin),
        in_flight=message.in_flight,
    )


def register_request_to_pb(
    server_name: str,
    *,
    pid: int,
    start_time: float,
    listen_host: str,
    listen_port: int,
    advertise_host: str,
    lease_seconds: float | None = None,
    labels: Mapping[str, str] | None = None,
    draining: bool = False,
    server_type: str = "",
    in_flight: int = 0,
) -> pb.RegisterServerInstanceRequest:
    request = pb.RegisterServerInstanceRequest(
        server_name=server_name,
        pid=pid,
        listen_host=listen_host,
        listen_port=listen_port,
        advertise_host=advertise_host,
        labels=labels or {},
        draining=draining,
        server_type=server_type,
        in_flight=max(0, in_flight),
    )
    if start_time > 0:
        request.start_time.CopyFrom(epoch_to_timestamp(start_time))
    if lease_seconds is not None:
        request.lease_ttl.CopyFrom(seconds_to_duration(lease_seconds))
    return request


def registration_from_pb(
    request: pb.RegisterServerInstanceRequest, advertised_host: str, registered_at: float
) -> InstanceRegistration:
    """The head's record of a registration; `advertised_host` is where the head decided clients dial it,
    `registered_at` the head's time.monotonic() now."""
    return InstanceRegistration(
        server_name=request.server_name,
        pid=request.pid,
        start_time=request.start_time.ToNanoseconds() / 1e9 if request.HasField("start_time") else 0.0,
        listen_host=request.listen_host,
        port=request.listen_port,
        advertised_host=advertised_host,
        registered_at=registered_at,
        lease_ttl=request.lease_ttl.ToNanoseconds() / 1e9 if request.HasField("lease_ttl") else 0.0,
        labels=dict(request.labels),
        draining=request.draining,
        server_type=request.server_type,
        in_flight=request.in_flight,
    )


# --- responses, as the control clients return them (one converter per row of gym_rpc.client.control._clients's
# table) ---


def head_config_from_pb(response: pb.GetHeadServerConfigResponse) -> BaseServerConfig:
    return head_server_from_pb(response.head_server)


def changed_config_from_pb(response: pb.GetGlobalConfigResponse) -> GlobalConfig | None:
    """None when the head answered "unchanged" (no document sent)."""
    return None if response.unchanged else global_config_from_pb(response)


def status_response_from_pb(response: pb.GetServerStatusResponse) -> StatusReport:
    return report_from_pb(response.report)


def snapshot_from_pb(response: pb.ListServerStatusesResponse) -> StatusSnapshot:
    return StatusSnapshot(
        response.revision,
        [report_from_pb(r) for r in response.reports],
        [engine_load_from_pb(load) for load in response.engine_loads],
    )


def engine_load_to_pb(load: EngineLoad) -> pb.EngineLoad:
    """An unknown figure stays unset (proto3 `optional`), never 0."""
    message = pb.EngineLoad(server_name=load.server_name, instance_id=load.instance_id)
    if load.waiting is not None:
        message.waiting = load.waiting
    if load.running is not None:
        message.running = load.running
    if load.kv_cache_usage is not None:
        message.kv_cache_usage = load.kv_cache_usage
    if load.age_seconds is not None:
        message.age.CopyFrom(seconds_to_duration(load.age_seconds))
    return message


def engine_load_from_pb(message: pb.EngineLoad) -> EngineLoad:
    return EngineLoad(
        server_name=message.server_name,
        instance_id=message.instance_id,
        waiting=message.waiting if message.HasField("waiting") else None,
        running=message.running if message.HasField("running") else None,
        kv_cache_usage=message.kv_cache_usage if message.HasField("kv_cache_usage") else None,
        age_seconds=_seconds(message.age) if message.HasField("age") else None,
    )


_EVENT_KINDS = {
    pb.WATCH_EVENT_TYPE_SNAPSHOT: "snapshot",
    pb.WATCH_EVENT_TYPE_CHANGE: "change",
    pb.WATCH_EVENT_TYPE_HEARTBEAT: "heartbeat",
    pb.WATCH_EVENT_TYPE_ENGINE_LOAD: "engine_load",
}


def watch_event_from_pb(message: pb.WatchServerStatusesResponse) -> WatchEvent:
    return WatchEvent(
        kind=_EVENT_KINDS.get(message.type, "unknown"),
        revision=message.revision,
        reports=[report_from_pb(r) for r in message.reports],
        compacted=message.compacted,
        config_version=message.config_version,
        engine_loads=[engine_load_from_pb(load) for load in message.engine_loads],
    )


def instances_from_pb(response: pb.ListServerInstancesResponse) -> list[ServerInstance]:
    return [instance_from_pb(i) for i in response.instances]


def header_from_pb(response: pb.GetAssistantMessageHeaderResponse) -> bytes | None:
    return response.header if response.HasField("header") else None


def reload_from_pb(response: pb.ReloadGlobalConfigResponse) -> tuple[str, bool]:
    """(the config version now, whether the reload changed it)."""
    return response.version, response.changed


def advertised_url_from_pb(response: pb.RegisterServerInstanceResponse) -> str:
    return response.advertised_url


def registered_from_pb(response: pb.RegisterServerInstanceResponse) -> RegisteredInstance:
    return RegisteredInstance(advertised_url=response.advertised_url, instance_id=response.instance_id)


def deregistered_from_pb(response: pb.DeregisterServerInstanceResponse) -> bool:
    return response.deregistered
