"""How much one client may register (`head_server.registration`): caps on registered instances per server name,
per head and per client address, and a rate of registrations per client address, so no client can drown the head
(or the workers following it) in instances. A registration past a cap or the rate is RESOURCE_EXHAUSTED naming the
setting; renewals (nothing changed but the lease) are never rate-limited, and instances already held never count
twice.

Every loopback address is one client (gym_rpc.server.security._watch_slots.client_key), as for watches: a local
process cannot take a share per address it binds.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from gym_rpc.config import HEAD_SERVER_KEY, RegistrationSettings
from gym_rpc.server.security import client_key

_SETTING = f"{HEAD_SERVER_KEY}.registration"
MAX_TRACKED_CLIENTS = 4096  # rate buckets kept at once; full ones are forgotten first


@dataclass(frozen=True)
class RegistrationCaps:
    """The bounds, as `head_server.registration` sets them (gym_rpc.config.RegistrationSettings' defaults)."""

    per_server: int = RegistrationSettings().max_instances_per_server
    total: int = RegistrationSettings().max_instances
    per_client: int = RegistrationSettings().max_instances_per_client
    per_second: float = RegistrationSettings().registrations_per_second
    burst: int = RegistrationSettings().registration_burst

    @classmethod
    def from_settings(cls, settings: RegistrationSettings) -> RegistrationCaps:
        return cls(
            per_server=settings.max_instances_per_server,
            total=settings.max_instances,
            per_client=settings.max_instances_per_client,
            per_second=settings.registrations_per_second,
            burst=settings.registration_burst,
        )


class RegistrationLimits:
    """Counts of registered instances per client and in total, and each client's rate bucket."""

    def __init__(self, caps: RegistrationCaps = RegistrationCaps()) -> None:
        self.caps = caps
        self.total = 0
        self._per_client: Counter[str] = Counter()
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, time.monotonic() of that count)

    def refusal(self, server_name: str, held_by_server: int, peer_host: str) -> str | None:
        """Why one more instance of `server_name` (which has `held_by_server` registered now) from `peer_host`
        is refused, None when it may be added. Checks the caps only: see `rate_refusal` for the rate."""
        caps, client = self.caps, client_key(peer_host)
        if held_by_server >= caps.per_server:
            return (
                f"{server_name} has {held_by_server} registered instances, the most one server may have "
                f"({_SETTING}.max_instances_per_server: {caps.per_server})"
            )
        if self.total >= caps.total:
            return f"the head holds {self.total} registered instances, its cap ({_SETTING}.max_instances)"
        if self._per_client[client] >= caps.per_client:
            return (
                f"{_shown(peer_host)} holds {self._per_client[client]} registered instances, the most one client "
                f"address may ({_SETTING}.max_instances_per_client: {caps.per_client})"
            )
        return None

    def rate_refusal(self, peer_host: str, now: float | None = None) -> str | None:
        """Take one registration from the client's bucket; why not when it is empty (None: taken)."""
        caps, client = self.caps, client_key(peer_host)
        now = time.monotonic() if now is None else now
        tokens, since = self._buckets.get(client, (float(caps.burst), now))
        tokens = min(float(caps.burst), tokens + (now - since) * caps.per_second)
        if tokens < 1:
            self._buckets[client] = (tokens, now)
            return (
                f"{_shown(peer_host)} registers faster than {caps.per_second:g} a second (bursts of {caps.burst}; "
                f"{_SETTING}.registrations_per_second); renewals are not counted, retry in "
                f"{(1 - tokens) / caps.per_second:.2g} s"
            )
        if len(self._buckets) >= MAX_TRACKED_CLIENTS and client not in self._buckets:
            self._forget_full(now)
        self._buckets[client] = (tokens - 1, now)
        return None

    def added(self, peer_host: str) -> None:
        self.total += 1
        self._per_client[client_key(peer_host)] += 1

    def removed(self, peer_host: str) -> None:
        self.total -= 1
        client = client_key(peer_host)
        self._per_client[client] -= 1
        if self._per_client[client] <= 0:
            del self._per_client[client]

    def _forget_full(self, now: float) -> None:
        """Forget the buckets that have refilled (a client away long enough is like a new one); all when none
        has, so the table stays bounded."""
        caps = self.caps
        full = [c for c, (t, s) in self._buckets.items() if t + (now - s) * caps.per_second >= caps.burst]
        for client in full or list(self._buckets):
            del self._buckets[client]


def _shown(peer: str) -> str:
    return f"client {peer}" if peer else "a client of unknown address"
