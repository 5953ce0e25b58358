"""The IP addresses a config host name stands for, to tell whether a registration is at a config instance.

The registry asks whether a registration is at the address of a config instance (`localhost` and `127.0.0.1`, a
node's name and the IP its registration came from). Only names from the head's own config are looked up, never a
name a registration gives (that is compared by name): no caller can make the head query names of its choosing. A
lookup is bounded in time and cached; its answer only ever decides which instance a registration holds, never what
anyone dials (clients and the prober dial the config's names and the registered addresses as they are). A name
that does not resolve in time stands for nothing.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time


class HostAddresses:
    """Whether a registered host is a config host: the same IP, the same name, or an IP the config name resolves
    to (looked up bounded in time, cached for `ttl_seconds`)."""

    def __init__(self, ttl_seconds: float = 30.0, timeout_seconds: float = 1.0, max_cached: int = 1024) -> None:
        self._ttl = ttl_seconds
        self._timeout = timeout_seconds
        self._max_cached = max_cached
        self._cache: dict[str, tuple[float, frozenset[str]]] = {}

    async def same_host(self, config_host: str, registered_host: str) -> bool:
        registered_ip = _ip(registered_host)
        if registered_ip is None:  # a name the registration gave: never looked up, the same name or not
            return _name(config_host) == _name(registered_host)
        return registered_ip in await self.of(config_host)

    async def of(self, host: str) -> frozenset[str]:
        literal = _ip(host)
        if literal is not None:
            return frozenset({literal})
        cached = self._cache.get(host)
        if cached is not None and time.monotonic() - cached[0] < self._ttl:
            return cached[1]
        try:
            infos = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM), self._timeout
            )
            found = frozenset(ip for info in infos if (ip := _ip(str(info[4][0]))) is not None)
        except (OSError, TimeoutError, UnicodeError):
            found = frozenset()
        if len(self._cache) >= self._max_cached:
            self._cache.clear()
        self._cache[host] = (time.monotonic(), found)
        return found


def _name(host: str) -> str:
    return host.strip().lower().rstrip(".")


def _ip(host: str) -> str | None:
    """The normalised IP literal `host` is (IPv6 bracketed or not, zone dropped), or None for a name."""
    try:
        return str(ipaddress.ip_address(host.strip().strip("[]").split("%", 1)[0]))
    except ValueError:
        return None
