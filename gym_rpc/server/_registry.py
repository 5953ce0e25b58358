"""Registered server instances on the head: which process of a config server runs, and where clients reach it.

A server bound to a wildcard address (0.0.0.0, ::) is listed in the config by that address, which no other host
can dial. When it registers, the head records the address it saw the registration come from, and from then on
advertises that address for it (ListServerInstances) and probes it there.

A registration may carry a lease (like an etcd lease or a Consul TTL check): unless renewed in time it expires,
so a process killed without deregistering does not stay advertised. The registry finds expiries, reports them
through gym_rpc.server._events (with every other head event), and tells the prober (hence status watches).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol
from urllib.parse import unquote

from gym_rpc.config import ServerEntry, connectable_host, is_wildcard_host, url_authority
from gym_rpc.server import _events as events
from gym_rpc.server._instances import InstanceTarget, config_targets
from gym_rpc.wire import InstanceRegistration, RegistrationState

logger = logging.getLogger(__name__)

# Leases a registration may ask for: long enough to renew over a slow network, short enough to matter.
MIN_LEASE_SECONDS = 0.5
MAX_LEASE_SECONDS = 86400.0
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


class InstanceRegistry:
    """The head's registrations, one per server name (a newer registration replaces an older one)."""

    def __init__(self) -> None:
        self._registrations: dict[str, InstanceRegistration] = {}
        self._ended: dict[str, RegistrationState] = {}  # why a server's last registration ended
        self._lock = asyncio.Lock()  # one prober update at a time, each from the latest state
        self._sweeper: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._registrations)

    def get(self, server_name: str) -> InstanceRegistration | None:
        return self._registrations.get(server_name)

    def state(self, server_name: str) -> RegistrationState | None:
        """Registered, or why the last registration ended; None when the server never registered."""
        return "registered" if server_name in self._registrations else self._ended.get(server_name)

    def register(self, registration: InstanceRegistration) -> bool:
        """Record a registration; False when it only renews the current one (same process, same address), which
        changes nothing but the lease's deadline."""
        name = registration.server_name
        previous = self._registrations.get(name)
        self._registrations[name] = registration
        self._ended.pop(name, None)
        return previous is None or (previous.pid, previous.advertised_url) != (
            registration.pid,
            registration.advertised_url,
        )

    def deregister(self, server_name: str, pid: int) -> bool:
        """Remove the server's registration if `pid` is the pid it registered with. A call naming another process
        (a newer one registered since), or none (pid 0), removes nothing: only the owner deregisters."""
        current = self._registrations.get(server_name)
        if current is None or pid == 0 or current.pid != pid:
            return False
        del self._registrations[server_name]
        self._ended[server_name] = "deregistered"
        return True

    def expire(self, now: float) -> list[InstanceRegistration]:
        """Drop the registrations whose lease ran out before `now` (time.monotonic()); the ones dropped."""
        expired = [r for r in self._registrations.values() if (t := r.expires_at) is not None and t < now]
        for registration in expired:
            name = registration.server_name
            del self._registrations[name]
            self._ended[name] = "expired"
            events.server_lease_expired(
                name, registration.pid, registration.lease_ttl, registration.advertised_url
            )
        return expired

    def start_expiry(self, prober: StatusTargets, servers: Callable[[], Mapping[str, ServerEntry]]) -> None:
        """Drop expired leases in the background until stop_expiry()."""
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(
                self._expire_leases_forever(prober, servers), name="gym_rpc lease expiry"
            )

    async def stop_expiry(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    async def _expire_leases_forever(
        self,
        prober: StatusTargets,
        servers: Callable[[], Mapping[str, ServerEntry]],
        interval: float = LEASE_SWEEP_SECONDS,
    ) -> None:
        """Every `interval`, drop expired registrations and point the prober back at the config's addresses."""
        while True:
            await asyncio.sleep(interval)
            try:
                if expired := self.expire(time.monotonic()):
                    await self.update_prober(prober, servers, [r.server_name for r in expired])
            except asyncio.CancelledError:
                raise
            except Exception:  # the sweep must outlive any single bad round
                logger.exception("lease expiry sweep failed")

    def targets(self, entry: ServerEntry) -> tuple[InstanceTarget, ...]:
        """The server's instances as clients should dial them: the config's, with the registration on the config
        instance (a wildcard-bound server that registered is at its advertised URL; every other entry keeps the
        config's address)."""
        own, *replicas = config_targets(entry)
        registration = self._registrations.get(entry.name)
        if registration is not None:
            url = registration.advertised_url if is_wildcard_host(entry.host) else own.url
            own = InstanceTarget(
                instance_id=url_authority(url),
                url=url,
                origin="config",
                registration="registered",
                advertised_url=registration.advertised_url,
                pid=registration.pid,
                start_time=registration.start_time,
            )
        elif (ended := self._ended.get(entry.name)) is not None:
            own = dataclasses.replace(own, registration=ended)
        return (own, *replicas)

    async def update_prober(
        self,
        prober: StatusTargets,
        servers: Callable[[], Mapping[str, ServerEntry]],
        names: Iterable[str] | None = None,
    ) -> None:
        """Point the prober at the instances of the config `servers()` returns when the lock is held (of the
        servers `names`, or of all), so a registration racing a config reload never leaves a stale URL behind."""
        async with self._lock:
            current = servers()
            if names is None:
                await prober.set_targets({name: self.targets(entry) for name, entry in current.items()})
                return
            for name in names:
                if name in current:
                    await prober.set_instances(name, self.targets(current[name]))
