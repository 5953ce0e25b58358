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

from gym_rpc.config import HEAD_SERVER_KEY, RegistrationSettings
from gym_rpc.server.security import client_key

_SETTING = f"{HEAD_SERVER_KEY}.registration"
MAX_TRACKED_CLIENTS = 4096  # rate buckets kept at once; full ones are forgotten first


class RegistrationLimits:
    """Counts of registered instances per client and in total, and each client's rate bucket."""

    def __init__(self, settings: RegistrationSettings | None = None) -> None:
        self.settings = settings if settings is not None else RegistrationSettings()  # the caps and the rate
        self.total = 0
        self._per_client: Counter[str] = Counter()
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, time.monotonic() of that count)

    def refusal(self, server_name: str, held_by_server: int, peer_host: str) -> str | None:
        """Why one more instance of `server_name` (which has `held_by_server` registered now) from `peer_host`
        is refused, None when it may be added. Checks the caps only: see `rate_refusal` for the rate."""
        settings, client = self.settings, client_key(peer_host)
        if held_by_server >= settings.max_instances_per_server:
            return (
                f"{server_name} has {held_by_server} registered instances, the most one server may have "
                f"({_SETTING}.max_instances_per_server: {settings.max_instances_per_server})"
            )
        if self.total >= settings.max_instances:
            return f"the head holds {self.total} registered instances, its cap ({_SETTING}.max_instances)"
        if self._per_client[client] >= settings.max_instances_per_client:
            return (
                f"{_shown(peer_host)} holds {self._per_client[client]} registered instances, the most one client "
                f"address may ({_SETTING}.max_instances_per_client: {settings.max_instances_per_client})"
            )
        return None

    def rate_refusal(self, peer_host: str, now: float | None = None) -> str | None:
        """Take one registration from the client's bucket; why not when it is empty (None: taken)."""
        (burst, per_second), client = self._rate(), client_key(peer_host)
        now = time.monotonic() if now is None else now
        tokens, since = self._buckets.get(client, (burst, now))
        tokens = min(burst, tokens + (now - since) * per_second)
        if tokens < 1:
            self._buckets[client] = (tokens, now)
            return (
                f"{_shown(peer_host)} registers faster than {per_second:g} a second (bursts of {burst:g}; "
                f"{_SETTING}.registrations_per_second); renewals are not counted, retry in "
                f"{(1 - tokens) / per_second:.2g} s"
            )
        if len(self._buckets) >= MAX_TRACKED_CLIENTS and client not in self._buckets:
            self._forget_full(now)
        self._buckets[client] = (tokens - 1, now)
        return None

    def _rate(self) -> tuple[float, float]:
        """The bucket's size and how many registrations a second refill it."""
        return float(self.settings.registration_burst), self.settings.registrations_per_second

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
        burst, per_second = self._rate()
        full = [c for c, (t, s) in self._buckets.items() if t + (now - s) * per_second >= burst]
        for client in full or list(self._buckets):
            del self._buckets[client]


def _shown(peer: str) -> str:
    return f"client {peer}" if peer else "a client of unknown address"
