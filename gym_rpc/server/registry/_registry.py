"""Registered server instances on the head: which processes of a config server run, and where clients reach each.

A server has one or more instances. A registration at an address no instance of the server holds adds one (a
replica, in the order it first registered); a registration at an address an instance holds is that instance's
process: the same pid renews it, another pid replaces it (a restart). The config instance and the static replicas
are held by registrations at their address: the same IP and port, or a config host name that resolves to the IP
registered (looked up, bounded and cached, only to tell; what clients dial is never a looked-up address).

A server bound to a wildcard address (0.0.0.0, ::) is listed in the config by that address, which no other host
can dial. Its config instance is held by the earliest registration that holds no static replica: the head records
the address it saw that registration come from, and from then on advertises and probes the instance there. When
that process goes, the next registered instance takes its place, or the instance goes back to the config's address.

A registration may carry a lease (like an etcd lease or a Consul TTL check): unless renewed in time it expires,
so a process killed without deregistering does not stay advertised. The registry finds expiries, reports them
through gym_rpc.server.fleet.events (with every other head event), and tells the prober (hence status watches).
Only the process that made a registration removes it (its pid, at its instance).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol
from urllib.parse import unquote

from gym_rpc._tasks import cancel_and_wait
from gym_rpc.config import ServerEntry, connectable_host, is_wildcard_host, url_authority
from gym_rpc.server.fleet import InstanceTarget, config_targets
from gym_rpc.server.fleet import events as events
from gym_rpc.server.registry._host_addresses import HostAddresses
from gym_rpc.server.registry._limits import RegistrationLimits
from gym_rpc.wire import InstanceRegistration, InstanceReport, RegistrationState

logger = logging.getLogger("gym_rpc.server._registry")  # its name from before the move

# Leases a registration may ask for: long enough to renew over a slow network, short enough to matter.
MIN_LEASE_SECONDS = 0.5
MAX_LEASE_SECONDS = 86400.0
# The lease of a registration that asks for none: none lives forever, so a process gone without deregistering (or
# a flood of registrations never renewed) leaves the head within this long.
DEFAULT_LEASE_SECONDS = 300.0
# How often the head looks for expired leases: an expiry is noticed at most this late.
LEASE_SWEEP_SECONDS = 0.25


def peer_host(peer: str) -> str | None:
    """The IP address in a gRPC peer string ("ipv4:10.0.0.2:5678", "ipv6:[::1]:5678"); None for other transports
    (unix sockets) and anything unparsable. IPv4-mapped IPv6 addresses (a dual-stack head) become plain IPv4."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = unquote(rest.rsplit(":", 1)[0]).strip("[]")  # gRPC percent-encodes an IPv6 zone's "%"
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return host if "%" in host else str(address)


_HOSTNAME_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_ZONE_ID = re.compile(r"[A-Za-z0-9_.-]+")


def is_valid_host(host: str) -> bool:
    """An IP literal (IPv6 optionally bracketed) or an RFC 1123 hostname: nothing that could smuggle a port, a
    path, userinfo or a fragment into the URL the head advertises for a server."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    address, _, zone = bare.partition("%")  # an IPv6 zone ("fe80::1%eth0") names an interface
    try:
        version = ipaddress.ip_address(address).version
    except ValueError:
        pass
    else:
        if zone and not (version == 6 and _ZONE_ID.fullmatch(zone)):
            return False
        return bare == host or version == 6  # only IPv6 literals are bracketed
    if bare != host or len(host) > 253:
        return False
    labels = host.removesuffix(".").split(".")
    # An all-numeric last label makes a dotted number, not a name: `999.1.1.1` is a malformed IPv4 address, and
    # resolvers read `1.2.3` or `0x7f.1` as addresses too (RFC 1123 2.1, RFC 3696 2: top-level labels are never
    # all-numeric).
    if labels[-1].isdigit():
        return False
    return all(_HOSTNAME_LABEL.fullmatch(label) for label in labels)


def advertised_host(listen_host: str, advertise_host: str, peer: str) -> str:
    """Where clients should dial a server: the host it names, else its bind host unless that is a wildcard, else
    the address its registration came from, else loopback."""
    if advertise_host.strip():
        return advertise_host.strip()
    if not is_wildcard_host(listen_host):
        return listen_host.strip()
    return peer_host(peer) or connectable_host(listen_host)


class StatusTargets(Protocol):
    """What the registry steers: the prober's servers and their instances."""

    async def set_targets(self, servers: Mapping[str, Sequence[InstanceTarget]]) -> None: ...

    async def set_instances(self, name: str, targets: Sequence[InstanceTarget]) -> None: ...

    async def set_instance(self, name: str, target: InstanceTarget) -> None: ...

    async def drop_instance(self, name: str, instance_id: str) -> None: ...


# The ended-registration key of a wildcard-bound server's config instance, whose own id moves with its holder.
_WILDCARD_SLOT = ""

RegistrationKind = Literal["added", "replaced", "changed", "renewed"]


@dataclass(frozen=True)
class Registered:
    """What a registration did: the instance it holds (its id, to deregister it by) and how it changed it."""

    instance_id: str
    kind: RegistrationKind  # a new instance or a newly held one, another process, new labels or draining, a lease
    previous: InstanceRegistration | None  # the registration it renewed or replaced


class InstanceRegistry:
    """The head's registrations: per server name, one per instance, keyed by the id of the instance each holds
    (a config instance's or static replica's id, else the advertised one), in the order they first registered.

    `servers` returns the config's servers now (the head's current config)."""

    def __init__(self, servers: Callable[[], Mapping[str, ServerEntry]] = dict) -> None:
        self._servers = servers
        self._registrations: dict[str, dict[str, InstanceRegistration]] = {}
        # Why the registration of a config instance or static replica ended (name -> instance id -> state).
        self._ended: dict[str, dict[str, RegistrationState]] = {}
        self._lock = asyncio.Lock()  # one prober update at a time, each from the latest state
        self._sweeper: asyncio.Task[None] | None = None
        self._addresses = HostAddresses()
        # name -> advertised id -> the key of the registration advertised there: a registration finds its
        # instance in O(1), not by a walk over the server's instances.
        self._by_address: dict[str, dict[str, str]] = {}
        self.limits = RegistrationLimits()  # the caps and rate of head_server.registration (set at start)
        # Told of every change the prober follows (not of renewals): the head keeps registrations across a restart
        # (gym_rpc.server.registry.registrations_file).
        self.on_change: Callable[[], None] = lambda: None

    def __len__(self) -> int:
        return sum(len(registrations) for registrations in self._registrations.values())

    def get(self, server_name: str) -> InstanceRegistration | None:
        """The registration holding the server's config instance, if any."""
        entry = self._servers().get(server_name)
        key = self._config_holder(entry) if entry is not None else None
        return self._registrations[server_name][key] if key is not None else None

    def state(self, server_name: str) -> RegistrationState | None:
        """The config instance's registration: registered, or why its last one ended; None if it never had one."""
        if self.get(server_name) is not None:
            return "registered"
        entry = self._servers().get(server_name)
        slot = _WILDCARD_SLOT if entry is None or is_wildcard_host(entry.host) else entry.instances[0].instance_id
        return self._ended.get(server_name, {}).get(slot)

    def server_type_conflict(self, entry: ServerEntry, registration: InstanceRegistration) -> str | None:
        """Why `registration` cannot be an instance of `entry`'s server: it says another server type than the
        config's, or than another live instance registered with; None when it says none or the same."""
        said = registration.server_type
        if not said:
            return None
        name, at = entry.name, registration.advertised_id
        if said != entry.server_type:
            return (
                f"{name}: the instance registering at {at} serves as {said}, but {name} is {entry.server_type} "
                f"(its config instance {entry.instances[0].instance_id}); one server's instances are of one type"
            )
        for instance_id, other in self._registrations.get(name, {}).items():
            if other.server_type and other.server_type != said and other.advertised_id != at:
                return (
                    f"{name}: the instance registering at {at} serves as {said}, but its instance {instance_id} "
                    f"(pid {other.pid}) registered as {other.server_type}; one server's instances are of one type"
                )
        return None

    async def register(self, registration: InstanceRegistration, *, authenticated: bool = False) -> Registered:
        """Record a registration at the instance it holds (renewing, replacing or adding one). Unless the caller
        presented the head's token (`authenticated`), IdentityRefused when it cannot be the process of that
        instance: a config instance or static replica is held only from its own address, and an instance already
        held only from the address of the registration holding it."""
        name = registration.server_name
        registrations = self._registrations.setdefault(name, {})
        by_address = self._by_address.setdefault(name, {})
        instance_id = by_address.get(registration.advertised_id)
        entry = self._servers().get(name)
        if instance_id is None:
            held_config = await self._config_instance_at(entry, registration) if entry is not None else None
            instance_id = held_config or registration.advertised_id
        previous = registrations.get(instance_id)
        if not authenticated:
            refusal = await self._identity_refusal(entry, instance_id, previous, registration)
            if refusal is not None:
                raise IdentityRefused(refusal)
        kind = _kind(previous, registration)
        limits, peer = self.limits, registration.peer_host
        limited = None if kind == "renewed" else limits.rate_refusal(peer)
        if limited is None and previous is None:
            limited = limits.refusal(name, len(registrations), peer)
        if limited is not None:
            raise CapReached(limited)
        registrations[instance_id] = registration  # a key already there keeps its place: a restart stays in line
        if previous is not None and by_address.get(previous.advertised_id) == instance_id:
            del by_address[previous.advertised_id]
        by_address[registration.advertised_id] = instance_id
        if previous is None:
            limits.added(peer)
        elif previous.peer_host != peer:
            limits.removed(previous.peer_host)
            limits.added(peer)
        self._ended.get(name, {}).pop(instance_id, None)
        return Registered(instance_id, kind, previous)

    def deregister(
        self,
        server_name: str,
        pid: int,
        instance_id: str = "",
        *,
        peer_host: str = "",
        authenticated: bool = False,
    ) -> list[tuple[str, InstanceRegistration]]:
        """Remove the server's registrations made by `pid` (the one at `instance_id`, or every one of `pid` when
        empty); the ones removed. A call naming another process (a newer one registered since), or none (pid 0),
        removes nothing: only the owner deregisters. A call from another address than the registration's (pids
        are no secret: ListServerInstances shows them) is IdentityRefused unless `authenticated`."""
        registrations = self._registrations.get(server_name, {})
        keys = [instance_id] if instance_id else list(registrations)
        owned = [key for key in keys if pid != 0 and key in registrations and registrations[key].pid == pid]
        foreign = [key for key in owned if not same_machine(registrations[key].peer_host, peer_host)]
        if foreign and not authenticated:
            held = registrations[foreign[0]]
            raise IdentityRefused(
                f"{server_name}: instance {foreign[0]} is held by the registration of pid {held.pid} from "
                f"{_shown(held.peer_host)}; only a call from that address, or one presenting the head's token, "
                f"may deregister it (this one came from {_shown(peer_host)})"
            )
        return [(key, self._remove(server_name, key, "deregistered")) for key in owned]

    def expire(self, now: float) -> list[tuple[str, InstanceRegistration]]:
        """Drop the registrations whose lease ran out before `now` (time.monotonic()); the ones dropped."""
        expired = [
            (name, key)
            for name, registrations in self._registrations.items()
            for key, registration in registrations.items()
            if (t := registration.expires_at) is not None and t < now
        ]
        dropped = []
        for name, key in expired:
            registration = self._remove(name, key, "expired")
            events.server_lease_expired(
                name, registration.pid, registration.lease_ttl, registration.advertised_url
            )
            dropped.append((key, registration))
        return dropped

    def in_flight(self, server_name: str) -> dict[str, int]:
        """instance id -> calls in flight its process reported at its latest registration or renewal."""
        return {key: held.in_flight for key, held in self._registrations.get(server_name, {}).items()}

    def _remove(self, name: str, key: str, reason: RegistrationState) -> InstanceRegistration:
        entry = self._servers().get(name)
        held_config = entry is not None and key == self._config_holder(entry)
        registration = self._registrations[name].pop(key)
        self.limits.removed(registration.peer_host)
        by_address = self._by_address.get(name, {})
        if by_address.get(registration.advertised_id) == key:
            del by_address[registration.advertised_id]
        if entry is not None and (held_config or key in _config_ids(entry)):
            slot = _WILDCARD_SLOT if is_wildcard_host(entry.host) and key not in _config_ids(entry) else key
            self._ended.setdefault(name, {})[slot] = reason
        return registration

    def start_expiry(self, prober: StatusTargets) -> None:
        """Drop expired leases in the background until stop_expiry()."""
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._expire_leases_forever(prober), name="gym_rpc lease expiry")

    async def stop_expiry(self) -> None:
        await cancel_and_wait(self._sweeper)
        self._sweeper = None

    async def _expire_leases_forever(self, prober: StatusTargets, interval: float = LEASE_SWEEP_SECONDS) -> None:
        """Every `interval`, drop expired registrations and tell the prober which instances went."""
        while True:
            await asyncio.sleep(interval)
            try:
                if expired := self.expire(time.monotonic()):
                    await self.update_prober(prober, {registration.server_name for _, registration in expired})
            except asyncio.CancelledError:
                raise
            except Exception:  # the sweep must outlive any single bad round
                logger.exception("lease expiry sweep failed")

    def targets(self, entry: ServerEntry) -> tuple[InstanceTarget, ...]:
        """The server's instances as clients should dial them: the config instance (a wildcard-bound one at its
        holder's advertised address), the static replicas, then the registered instances, each with what its
        registration says (or why its last one ended)."""
        registrations = self._registrations.get(entry.name, {})
        ended = self._ended.get(entry.name, {})
        own, *replicas = config_targets(entry)
        holder = self._config_holder(entry)
        if holder is not None:
            held = registrations[holder]
            url = held.advertised_url if is_wildcard_host(entry.host) else own.url
            own = _held(InstanceTarget(InstanceReport(url_authority(url), url, origin="config")), held)
        else:
            slot = _WILDCARD_SLOT if is_wildcard_host(entry.host) else own.instance_id
            own = own.with_registration(ended.get(slot))
        targets = [own]
        for replica in replicas:
            held_replica = registrations.get(replica.instance_id)
            targets.append(
                _held(replica, held_replica)
                if held_replica is not None
                else replica.with_registration(ended.get(replica.instance_id))
            )
        config_ids = _config_ids(entry)
        for key, registration in registrations.items():
            if key != holder and key not in config_ids:
                url = registration.advertised_url
                targets.append(_held(InstanceTarget(InstanceReport(key, url, origin="registered")), registration))
        return tuple(targets)

    def _config_holder(self, entry: ServerEntry) -> str | None:
        """The key of the registration holding the config instance: the one at its address, or (wildcard-bound)
        the earliest one that holds no static replica."""
        registrations = self._registrations.get(entry.name, {})
        if not is_wildcard_host(entry.host):
            own = entry.instances[0].instance_id
            return own if own in registrations else None
        replicas = {address.instance_id for address in entry.replicas}
        return next((key for key in registrations if key not in replicas), None)

    async def _identity_refusal(
        self,
        entry: ServerEntry | None,
        instance_id: str,
        previous: InstanceRegistration | None,
        registration: InstanceRegistration,
    ) -> str | None:
        """Why `registration` may not hold `instance_id` (not authenticated): None when it is a new instance at an
        address of its own, when it comes from the address of the registration holding the instance, or (an
        instance the config names, held by none) from the config's address of it."""
        name, peer = registration.server_name, registration.peer_host
        if previous is not None:
            if same_machine(previous.peer_host, peer):
                return None
            return (
                f"{name}: instance {instance_id} is held by the registration of pid {previous.pid} from "
                f"{_shown(previous.peer_host)}; only a registration from that address, or one presenting the "
                f"head's token, may renew, drain or replace it (this one came from {_shown(peer)})"
            )
        if entry is None or instance_id not in _config_ids(entry):
            return None
        address = next(a for a in entry.instances if a.instance_id == instance_id)
        host = connectable_host(address.host)
        if peer and (
            await self._addresses.same_host(host, peer)
            or (_is_loopback(peer) and any(_is_loopback(ip) for ip in await self._addresses.of(host)))
        ):
            return None
        what = "config instance" if address is entry.instances[0] else "static replica"
        return (
            f"{name}: {instance_id} is the config's {what}; a registration holds it only from its address "
            f"({host}) or with the head's token, and this one came from {_shown(peer)}"
        )

    async def _config_instance_at(self, entry: ServerEntry, registration: InstanceRegistration) -> str | None:
        """The id of the config instance or static replica at the registration's address, if one is: same port,
        and the same IP (a config host name counts when it resolves to the registered IP). A wildcard-bound
        config instance is no address to match (its holder is the earliest registration)."""
        candidates = entry.replicas if is_wildcard_host(entry.host) else entry.instances
        for address in candidates:
            if address.port == registration.port and await self._addresses.same_host(
                connectable_host(address.host), registration.advertised_host
            ):
                return address.instance_id
        return None

    def rekey(self, servers: Mapping[str, ServerEntry]) -> None:
        """After a reload: a registration holding a config instance or static replica the config no longer has
        becomes a registered instance at its own advertised address (of two there, the one renewed last stays)."""
        for name, registrations in self._registrations.items():
            entry = servers.get(name)
            config_ids = _config_ids(entry) if entry is not None else set()
            for key in [k for k, r in registrations.items() if k not in config_ids and k != r.advertised_id]:
                moved = registrations.pop(key)
                there = registrations.get(moved.advertised_id)
                if there is None or there.registered_at < moved.registered_at:
                    registrations[moved.advertised_id] = moved
                dropped = moved if registrations.get(moved.advertised_id) is not moved else there
                if dropped is not None:
                    self.limits.removed(dropped.peer_host)
            self._by_address[name] = {r.advertised_id: k for k, r in registrations.items()}

    async def update_instances(self, prober: StatusTargets, name: str, keys: Iterable[str]) -> None:
        """Point the prober at the instances `keys` of server `name` as they are now (held, ended or gone): the
        cost of those instances, not of the server's. A wildcard-bound config instance moves with its holder, so
        such a server is given whole."""
        self.on_change()
        async with self._lock:
            entry = self._servers().get(name)
            if entry is None:
                return
            if is_wildcard_host(entry.host):
                await prober.set_instances(name, self.targets(entry))
                return
            for key in keys:
                target = self._target_of(entry, key)
                if target is None:
                    await prober.drop_instance(name, key)
                else:
                    await prober.set_instance(name, target)

    def _target_of(self, entry: ServerEntry, key: str) -> InstanceTarget | None:
        """What `targets` gives for the instance `key` of a server not bound to a wildcard; None when it is no
        instance (a registered one that went)."""
        held = self._registrations.get(entry.name, {}).get(key)
        config = next((t for t in config_targets(entry) if t.instance_id == key), None)
        if config is not None:
            return (
                _held(config, held)
                if held is not None
                else config.with_registration(self._ended.get(entry.name, {}).get(key))
            )
        if held is None:
            return None
        return _held(InstanceTarget(InstanceReport(key, held.advertised_url, origin="registered")), held)

    def entries(self) -> list[tuple[str, InstanceRegistration]]:
        """Every registration with the id of the instance it holds, in the order they first registered."""
        return [
            (key, held) for registrations in self._registrations.values() for key, held in registrations.items()
        ]

    def restore(self, entries: Iterable[tuple[str, InstanceRegistration]]) -> int:
        """Take back registrations an earlier head process held (gym_rpc.server.registry.registrations_file), each
        at the instance it held; those of servers the config no longer has are left out. How many were taken."""
        servers = self._servers()
        taken = 0
        for instance_id, registration in entries:
            name = registration.server_name
            if name in servers and instance_id not in self._registrations.get(name, {}):
                self._registrations.setdefault(name, {})[instance_id] = registration
                self._by_address.setdefault(name, {})[registration.advertised_id] = instance_id
                self.limits.added(registration.peer_host)
                taken += 1
        return taken

    async def update_prober(self, prober: StatusTargets, names: Iterable[str] | None = None) -> None:
        """Point the prober at the instances of the servers `names` (None: of every server, after a reload) as
        the config has them when the lock is held, so a registration racing a reload never leaves a stale URL."""
        self.on_change()
        async with self._lock:
            current = self._servers()
            if names is None:
                self.rekey(current)
                await prober.set_targets({name: self.targets(entry) for name, entry in current.items()})
                return
            for name in names:
                if name in current:
                    await prober.set_instances(name, self.targets(current[name]))


class CapReached(Exception):
    """A registration past a cap or its client's rate (RESOURCE_EXHAUSTED, naming the setting)."""


class IdentityRefused(Exception):
    """A registration or deregistration that cannot come from the process holding the instance (PERMISSION_DENIED
    to the caller, a rate-limited warning in the head's log)."""


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def same_machine(a: str, b: str) -> bool:
    """Whether two registrations' peer addresses are one machine: the same IP, or both loopback (every loopback
    address is this machine, as for the head's per-client bounds)."""
    return a == b or (_is_loopback(a) and _is_loopback(b))


def _shown(peer: str) -> str:
    return peer or "an unknown address"


def _config_ids(entry: ServerEntry) -> set[str]:
    """The ids of the instances the config names at a fixed address (a wildcard-bound entry's own moves)."""
    addresses = entry.replicas if is_wildcard_host(entry.host) else entry.instances
    return {address.instance_id for address in addresses}


def _held(target: InstanceTarget, registration: InstanceRegistration) -> InstanceTarget:
    """`target` held by `registration`: registered, with its process, labels and draining flag."""
    held = dataclasses.replace(
        target.unprobed,
        registration="registered",
        draining=registration.draining,
        labels=registration.labels,
        pid=registration.pid,
        start_time=registration.start_time,
    )
    return InstanceTarget(held, registration.advertised_url)


def _kind(previous: InstanceRegistration | None, registration: InstanceRegistration) -> RegistrationKind:
    if previous is None:
        return "added"
    if previous.pid != registration.pid:
        return "replaced"
    if (previous.advertised_url, previous.labels, previous.draining) != (
        registration.advertised_url,
        registration.labels,
        registration.draining,
    ):
        return "changed"
    return "renewed"
