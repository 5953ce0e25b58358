"""The `gym_rpc.v1.ControlPlaneService` handlers of the head server.

Handlers read the head's current state (config, prober) and never rebuild per call what a config version fixes:
the GetGlobalConfig responses (redacted, and with secrets) are built once per version.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol

import grpc

from gym_rpc._logging import RateLimitedLog
from gym_rpc.config import HEAD_SERVER_KEY, REDACTED, GlobalConfig, base_url, is_wildcard_host
from gym_rpc.errors import ConfigError, quoted
from gym_rpc.server.fleet import EngineLoads, LoadPush, ReportMessages, StatusProber, WatchFeed
from gym_rpc.server.fleet import events as events
from gym_rpc.server.registry import (
    DEFAULT_LEASE_SECONDS,
    MAX_LEASE_SECONDS,
    MIN_LEASE_SECONDS,
    CapReached,
    IdentityRefused,
    InstanceRegistry,
    advertised_host,
    is_valid_host,
    peer_host,
)
from gym_rpc.server.security import (
    DEFAULT_MAX_CONCURRENT_WATCHES,
    DEFAULT_MAX_WATCHES_PER_PEER,
    DEFAULT_STALL_SECONDS,
    AddressPolicy,
    BoundedWrites,
    PeerMap,
    WatchSlots,
    caller_is_authenticated,
    peer_address,
)
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.v1 import control_plane_pb2_grpc as pb_grpc
from gym_rpc.wire import ReportedProcess, StatusReport, convert, label_problem, unknown_server_status

logger = logging.getLogger("gym_rpc.server._servicer")  # its name from before the move

DEFAULT_HEARTBEAT_SECONDS = 5.0
MIN_HEARTBEAT_SECONDS = 0.05
# Time kept back from the caller's deadline so a TIMEOUT answer still reaches the caller before it gives up: a
# tenth of the time left, at least 0.1 s (a busy head's event loop can take that long to send it).
DEADLINE_MARGIN_SECONDS = 0.1
DEADLINE_MARGIN_SHARE = 0.1
MAX_PROBE_SECONDS = 30.0

Context = grpc.aio.ServicerContext[Any, Any]


class HeadState(Protocol):
    """What the handlers need from the head server."""

    config: GlobalConfig
    prober: StatusProber
    registry: InstanceRegistry
    engine_loads: EngineLoads
    pid: int
    start_time: float

    @property
    def ready(self) -> bool:
        """Whether the head serves what it knows: config loaded, first probe round done, warm-up over."""
        ...

    @property
    def processes(self) -> Mapping[str, ReportedProcess]:
        """pid and start time per server, as the config source reports them (a NeMo Gym upstream)."""
        ...

    async def reload(self) -> bool: ...


class ControlPlaneServicer(pb_grpc.ControlPlaneServiceServicer):
    def __init__(
        self,
        head: HeadState,
        *,
        max_concurrent_watches: int = DEFAULT_MAX_CONCURRENT_WATCHES,
        max_watches_per_peer: int = DEFAULT_MAX_WATCHES_PER_PEER,
        address_policy: AddressPolicy | None = None,
        watch_stall_seconds: float = DEFAULT_STALL_SECONDS,
        registrations_off: str | None = None,
        peers: PeerMap | None = None,
    ) -> None:
        self._head = head
        self.peers = peers if peers is not None else PeerMap()  # who is behind a relayed connection
        self._registrations_off = registrations_off  # why RegisterServerInstance is refused; None: taken
        # Who tried to take over an instance it does not hold: a line per 10 s at most, however hard it tries.
        self._identity_refusals = RateLimitedLog(logger)
        self._cap_refusals = RateLimitedLog(logger)
        self._address_policy = address_policy if address_policy is not None else AddressPolicy()
        self._config_responses: dict[bool, tuple[str, pb.GetGlobalConfigResponse]] = {}
        self._report_messages = ReportMessages()  # each probe result converted once
        # One message per change, built once for every watcher.
        self.watch_feed = WatchFeed(
            lambda: self._head.prober, lambda: self._head.engine_loads, self._report_messages
        )
        # Per client address (not per connection: a client opening more connections is still one peer), so one
        # client cannot take every slot of the head and lock the other watchers out.
        self.watch_slots = WatchSlots(
            "status watches", max_concurrent_watches, max_watches_per_peer, instead="poll ListServerStatuses"
        )
        self.watch_stall_seconds = watch_stall_seconds
        self.watch_writes = BoundedWrites(watch_stall_seconds)

    @property
    def watches(self) -> int:
        """Status watches open now (the head's `gym.head.watchers` gauge)."""
        return self.watch_slots.open

    async def GetHeadServerConfig(
        self, request: pb.GetHeadServerConfigRequest, context: Context
    ) -> pb.GetHeadServerConfigResponse:
        return pb.GetHeadServerConfigResponse(head_server=convert.head_server_to_pb(self._head.config))

    async def GetGlobalConfig(
        self, request: pb.GetGlobalConfigRequest, context: Context
    ) -> pb.GetGlobalConfigResponse:
        # Secrets only for a caller that presented the head's token and asks for them; with no token configured
        # no caller is authenticated, so everyone gets the redacted config.
        include_secrets = request.include_secrets and caller_is_authenticated()
        config = self._head.config
        if request.known_version and request.known_version == config.version:
            return pb.GetGlobalConfigResponse(version=config.version, unchanged=True)  # no document to send
        cached = self._config_responses.get(include_secrets)
        if cached is None or cached[0] != config.version:
            response = _config_response(config, include_secrets)
            cached = self._config_responses[include_secrets] = (config.version, response)
        return cached[1]

    async def GetServerStatus(
        self, request: pb.GetServerStatusRequest, context: Context
    ) -> pb.GetServerStatusResponse:
        name = request.server_name
        if name == HEAD_SERVER_KEY:
            return pb.GetServerStatusResponse(report=convert.report_to_pb(self._head_report()))
        await self._require_server(name, context)
        prober = self._head.prober
        if request.HasField("max_age"):
            max_age = request.max_age.ToNanoseconds() / 1e9
            if max_age < 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_age must not be negative")
        else:
            max_age = prober.default_max_age_seconds
        cached = prober.fresh_report(name, max_age)
        if cached is not None:
            return pb.GetServerStatusResponse(report=convert.report_to_pb(cached))
        budget = probe_budget(context.time_remaining(), prober.probe_timeout_seconds)
        report = await prober.probe_now(name, budget, max_age)  # the instances whose results are too old
        return pb.GetServerStatusResponse(report=convert.report_to_pb(report))

    async def ListServerStatuses(
        self, request: pb.ListServerStatusesRequest, context: Context
    ) -> pb.ListServerStatusesResponse:
        prober = self._head.prober
        return pb.ListServerStatusesResponse(
            revision=prober.revision,
            reports=self._report_messages.of(prober.reports()),
            engine_loads=[convert.engine_load_to_pb(load) for load in self._head.engine_loads.loads()],
        )

    async def WatchServerStatuses(
        self, request: pb.WatchServerStatusesRequest, context: Context
    ) -> AsyncIterator[pb.WatchServerStatusesResponse]:
        """The watch as an async generator (the Connect port's; the gRPC port serves `write_watch`)."""
        key = await self.watch_slots.take_or_abort(context, peer_address(self.peers.caller(context)))
        try:
            stream = WatchStream(self.watch_feed, request)
            while True:
                yield await stream.next()
        finally:
            self.watch_slots.release(key)

    async def write_watch(self, request: pb.WatchServerStatusesRequest, context: Context) -> None:
        """The watch on the gRPC port: one coroutine that writes each message itself, each write bounded by the
        stall limit (gym_rpc.server.security.BoundedWrites). Thousands of these stay open, so a stream holds as
        little as it can: no generator, task or timer of its own while it waits."""
        peer = self.peers.caller(context)
        key = await self.watch_slots.take_or_abort(context, peer_address(peer))
        try:
            await self.watch_writes.write_all(context, WatchStream(self.watch_feed, request).next, peer)
        finally:
            self.watch_slots.release(key)

    async def ListServerInstances(
        self, request: pb.ListServerInstancesRequest, context: Context
    ) -> pb.ListServerInstancesResponse:
        head = self._head
        instances = [convert.head_instance_to_pb(head.config, head.pid, head.start_time)]
        for name, entry in head.config.servers.items():
            instances += convert.server_instances_to_pb(
                entry, head.prober.report(name), head.processes.get(name), head.registry.in_flight(name)
            )
        return pb.ListServerInstancesResponse(instances=instances)

    async def GetAssistantMessageHeader(
        self, request: pb.GetAssistantMessageHeaderRequest, context: Context
    ) -> pb.GetAssistantMessageHeaderResponse:
        name = request.model_server_name
        await self._require_server(name, context, "model_server_name")
        try:
            header = self._head.config.assistant_message_header(name)
        except ConfigError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.GetAssistantMessageHeaderResponse(header=header)

    async def ReloadGlobalConfig(
        self, request: pb.ReloadGlobalConfigRequest, context: Context
    ) -> pb.ReloadGlobalConfigResponse:
        try:
            changed = await self._head.reload()
        except ConfigError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"reload refused, old config kept: {exc}")
        return pb.ReloadGlobalConfigResponse(version=self._head.config.version, changed=changed)

    async def RegisterServerInstance(
        self, request: pb.RegisterServerInstanceRequest, context: Context
    ) -> pb.RegisterServerInstanceResponse:
        name = request.server_name
        await self._require_registrations_of(name, context)
        if not 0 < request.listen_port < 65536:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "listen_port must be in 1..65535")
        if request.pid < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "pid must not be negative")
        await _require_valid_hosts(request, context)
        lease = DEFAULT_LEASE_SECONDS  # every registration has a lease: none lives forever
        if request.HasField("lease_ttl"):
            lease = request.lease_ttl.ToNanoseconds() / 1e9
            if not MIN_LEASE_SECONDS <= lease <= MAX_LEASE_SECONDS:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"lease_ttl must be between {MIN_LEASE_SECONDS:g} s and {MAX_LEASE_SECONDS:g} s, "
                    f"got {lease:g} s",
                )
        caller = self.peers.caller(context)
        host = advertised_host(request.listen_host, request.advertise_host, caller)
        refusal = self._address_policy.refusal(host)
        if refusal is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{name}: advertised host {refusal}")
        problem = label_problem(request.labels)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {problem}")
        peer = peer_host(caller) or ""
        registration = dataclasses.replace(
            convert.registration_from_pb(request, host, time.monotonic()), peer_host=peer, lease_ttl=lease
        )
        head = self._head
        conflict = head.registry.server_type_conflict(head.config.servers[name], registration)
        if conflict is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, conflict)
        try:
            registered = await head.registry.register(registration, authenticated=caller_is_authenticated())
        except CapReached as exc:
            self._cap_refusals.log(f"refused the registration of {name} at {registration.advertised_url}: {exc}")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{name}: {exc}")
        except IdentityRefused as exc:
            self._identity_refusals.log(
                f"refused the registration of {name} at {registration.advertised_url} (pid {registration.pid}) "
                f"from {peer or 'an unknown address'}: {exc}"
            )
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        if registered.kind == "renewed":  # nothing changed but the lease (and the calls in flight): not followed
            events.server_renewed(name, registration.pid, registration.advertised_url)
        else:
            await head.registry.update_instances(head.prober, name, [registered.instance_id])
            instances = len(head.prober.report(name).instances)
            events.server_registered(name, registered.instance_id, registration, registered.previous, instances)
        response = pb.RegisterServerInstanceResponse(
            advertised_url=registration.advertised_url, instance_id=registered.instance_id
        )
        response.lease_ttl.FromNanoseconds(round(lease * 1e9))
        return response

    async def DeregisterServerInstance(
        self, request: pb.DeregisterServerInstanceRequest, context: Context
    ) -> pb.DeregisterServerInstanceResponse:
        name = request.server_name
        await self._require_registrations_of(name, context)
        if request.pid <= 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "pid is required: the pid the registration was made with (only its owner deregisters it; a "
                "registration made without a pid ends with its lease or when another replaces it)",
            )
        head = self._head
        peer = peer_host(self.peers.caller(context)) or ""
        try:
            removed = head.registry.deregister(
                name, request.pid, request.instance_id, peer_host=peer, authenticated=caller_is_authenticated()
            )
        except IdentityRefused as exc:
            self._identity_refusals.log(
                f"refused the deregistration of {name} (pid {request.pid}) from {peer or 'an unknown address'}: "
                f"{exc}"
            )
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        if removed:
            await head.registry.update_instances(head.prober, name, [key for key, _ in removed])
            left = len(head.prober.report(name).instances)
            for instance_id, registration in removed:
                events.server_deregistered(name, registration.pid, instance_id, left)
        return pb.DeregisterServerInstanceResponse(deregistered=bool(removed))

    async def _require_registrations_of(self, name: str, context: Context) -> None:
        """What a registration or deregistration of `name` needs first: PERMISSION_DENIED, saying which flag or
        setting turns them on, on a head that takes no registrations; then `_require_server`."""
        if self._registrations_off is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, self._registrations_off)
        await self._require_server(name, context)

    async def _require_server(self, name: str, context: Context, field: str = "server_name") -> None:
        """INVALID_ARGUMENT for no name, NOT_FOUND (with the known names) for one the config does not have."""
        if not name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field} is required")
        servers = self._head.config.servers
        if name not in servers:
            status = unknown_server_status(name, [*servers, HEAD_SERVER_KEY])
            await context.abort(status.code, status.details, status.trailing_metadata)

    def _head_report(self) -> StatusReport:
        head = self._head.config.head_server
        return StatusReport(
            server_name=HEAD_SERVER_KEY,
            status="success",
            url=base_url(head.host, head.port),
            checked_at=time.time(),
        )


def probe_budget(remaining: float | None, default: float) -> float:
    """How long a status call may probe: as long as its caller waits (`remaining` seconds, None: no deadline, then
    `default`), less a margin to deliver the answer, at most MAX_PROBE_SECONDS."""
    if remaining is None:
        return default
    margin = max(DEADLINE_MARGIN_SECONDS, remaining * DEADLINE_MARGIN_SHARE)
    return max(0.001, min(MAX_PROBE_SECONDS, remaining - margin))


async def _require_valid_hosts(request: pb.RegisterServerInstanceRequest, context: Context) -> None:
    """Refuse hosts that are neither IP literals nor hostnames: the head builds advertised URLs from them, which
    clients then dial (a host like "evil.example/x#" would rewrite the URL)."""
    listen_host, advertise_host = request.listen_host.strip(), request.advertise_host.strip()
    if listen_host and not (is_wildcard_host(listen_host) or is_valid_host(listen_host)):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _bad_host_message("listen_host", listen_host))
    if advertise_host and not is_valid_host(advertise_host):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _bad_host_message("advertise_host", advertise_host))


def _bad_host_message(field: str, host: str) -> str:
    what = "is neither an IP address nor a hostname (letters, digits, hyphens and dots; no port)"
    return f"{field} {quoted(host)} {what}"


def _config_response(config: GlobalConfig, include_secrets: bool) -> pb.GetGlobalConfigResponse:
    """The GetGlobalConfig answer; even with secrets, the head's own token never leaves it."""
    if not include_secrets:
        return convert.global_config_to_pb(config, include_secrets=False)
    head = config.document.get(HEAD_SERVER_KEY)
    if isinstance(head, Mapping) and "auth_token" in head:
        document = {**config.document, HEAD_SERVER_KEY: {**head, "auth_token": REDACTED}}
        config = dataclasses.replace(
            config, document=document, config_json=json.dumps(document, ensure_ascii=False)
        )
    return convert.global_config_to_pb(config, include_secrets=True)


def add_control_plane_service(servicer: ControlPlaneServicer, server: grpc.aio.Server) -> None:
    """Serve `servicer` as pb_grpc's generated registration would, except that watch messages go through the
    servicer's WatchFeed serializer, so a change sent to a thousand watchers is serialised once."""
    service = pb.DESCRIPTOR.services_by_name["ControlPlaneService"]
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        serializer = (
            servicer.watch_feed.serialize
            if method.name == "WatchServerStatuses"
            else response_class.SerializeToString
        )
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handler = servicer.write_watch if method.name == "WatchServerStatuses" else getattr(servicer, method.name)
        handlers[method.name] = make(
            handler, request_deserializer=request_class.FromString, response_serializer=serializer
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    # As the generated code does too: grpc resolves registered methods without the generic handler lookup, where
    # this grpcio has them (1.63 and later; the generic handler above serves on older ones).
    register: Any = getattr(server, "add_registered_method_handlers", None)
    if register is not None:
        register(service.full_name, handlers)


WatchWriter = Callable[[pb.WatchServerStatusesRequest, Context], Awaitable[None]]


def add_watch_service(write_watch: WatchWriter, feed: WatchFeed, server: grpc.aio.Server) -> None:
    """Serve the ControlPlaneService's WatchServerStatuses alone (a node's watch relay): `write_watch` writes each
    stream, `feed` serialises each shared message once; every other method of the service is UNIMPLEMENTED."""
    service = pb.DESCRIPTOR.services_by_name["ControlPlaneService"]
    handler = grpc.unary_stream_rpc_method_handler(
        write_watch,
        request_deserializer=pb.WatchServerStatusesRequest.FromString,
        response_serializer=feed.serialize,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, {"WatchServerStatuses": handler}),)
    )


class WatchStream:
    """One status watch's state between messages: the revision it has delivered, and when it last sent anything.
    `next()` waits for and returns the next message: the snapshot first (unless it resumes), then each push's
    message (shared by every watcher at its revision), the engines' load when asked, heartbeats when quiet. It
    reads all of it through `feed` (the head's, or a node relay's over its mirror of the head)."""

    __slots__ = ("_feed", "_heartbeat", "_load", "_quiet_since", "_seen", "_snapshot")

    def __init__(self, feed: WatchFeed, request: pb.WatchServerStatusesRequest) -> None:
        self._feed = feed
        heartbeat = DEFAULT_HEARTBEAT_SECONDS
        if request.HasField("heartbeat_interval"):
            heartbeat = max(MIN_HEARTBEAT_SECONDS, request.heartbeat_interval.ToNanoseconds() / 1e9)
        self._heartbeat = heartbeat
        seen = request.start_revision
        self._snapshot: pb.WatchServerStatusesResponse | None = None
        if seen == 0 or seen > feed.prober().revision:  # a revision from the future was issued by another head
            # The revision is taken with the snapshot: changes the prober records while it is being sent follow it
            # rather than being skipped.
            seen, self._snapshot = feed.snapshot(compacted=seen != 0)
        self._seen = seen  # the revision delivered: a resume from it misses nothing
        # ENGINE_LOAD messages for a watch that asks (gym_rpc.server._engine_load): coalesced, a few a second.
        self._load = LoadPush(feed.engine_loads()) if request.include_engine_load else None
        self._quiet_since = time.monotonic()

    async def next(self) -> pb.WatchServerStatusesResponse:
        self._quiet_since = time.monotonic()  # the caller sent the last message just now
        if self._snapshot is not None:
            snapshot, self._snapshot = self._snapshot, None
            return snapshot
        feed, load, heartbeat = self._feed, self._load, self._heartbeat
        while True:
            prober = feed.prober()  # read again each time: a reload replaces it
            # The stream holds nothing but `seen` while it waits or lags: what it missed is merged when it asks.
            self._seen, message = feed.after(self._seen)
            if message is not None:
                return message
            if load is not None and load.due():
                return feed.engine_loads().message(self._seen, prober.config_version)
            # A plain watch looks again twice an interval and sends a heartbeat once nothing was sent for 3/4 of
            # it: never quiet much longer than the interval, and no chattier when idle. One that asks for the
            # engines' load looks again at their push interval (its LoadPush says when a heartbeat is due).
            period = heartbeat / 2 if load is None else load.wait_seconds(heartbeat)
            if await prober.pushes.wake(period):
                continue
            if load.heartbeat_due(heartbeat) if load is not None else self._quiet(heartbeat):
                return feed.heartbeat(self._seen)

    def _quiet(self, heartbeat: float) -> bool:
        return time.monotonic() - self._quiet_since >= 0.75 * heartbeat
