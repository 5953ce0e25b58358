"""Server addresses: which bind hosts are wildcards, what a client dials instead, and base URLs."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from gym_rpc.errors import ConfigError

_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]", "*"}


def is_wildcard_host(host: str) -> bool:
    """Whether a bind address means "every interface" (0.0.0.0, ::, empty): valid to bind, not to dial."""
    return host.strip() in _WILDCARD_HOSTS


def connectable_host(host: str) -> str:
    """Map a bind address to one a client can dial: wildcards become loopback of the same family."""
    host = host.strip()
    if host in _WILDCARD_HOSTS:
        return "::1" if ":" in host else "127.0.0.1"
    return host


def url_host(host: str) -> str:
    """Bracket IPv6 literals so they can stand in a URL authority."""
    if ":" not in host:  # an IPv6 literal has one; parsing every hostname and IPv4 address costs far more
        return host
    bare = host.strip("[]")
    try:
        if ipaddress.ip_address(bare.split("%", 1)[0]).version == 6:
            return f"[{bare}]"
    except ValueError:
        pass
    return host


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 bracketed) as (host, port); `what` names the setting in the error."""
    try:
        parts = urlsplit(f"//{text.strip()}")
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or port is None:
        raise ConfigError(f"{what} {text!r}: expected HOST:PORT, e.g. 127.0.0.1:11000")
    return host, port


def checked_watch_relay(value: str, what: str) -> str:
    """A node's watch relay address: `unix:PATH`, or HOST:PORT with a port in 1..65535 (GYM_RPC_WATCH_RELAY,
    `head_server.watch_relay`); a ConfigError naming `what` (empty: the caller names it) otherwise."""
    prefix = f"{what}: " if what else ""
    text = value.strip()
    if text.startswith("unix:"):
        if not text[len("unix:") :]:
            raise ConfigError(f"{prefix}unix: needs a path, e.g. unix:/run/gym-rpc/relay.sock")
        return text
    host, port = parse_host_port(text, f"{prefix}watch relay")
    if not 0 < port < 65536:
        raise ConfigError(f"{prefix}watch relay {text!r}: the port must be in 1..65535")
    return f"{url_host(host)}:{port}"


def parse_head_addresses(value: str | Sequence[str], what: str) -> tuple[str, ...]:
    """Every head of a deployment, in the order clients try them: "a:11000,b:11000" (GYM_RPC_HEAD, --head) or a
    list of HOST:PORT (`head_server.addresses`). Each must be HOST:PORT with a port in 1..65535, none twice; `what`
    names the setting in the error (empty: the caller names it). One address gives a tuple of one."""
    prefix = f"{what}: " if what else ""
    entries = value.split(",") if isinstance(value, str) else list(value)
    if not entries or all(not str(entry).strip() for entry in entries):
        raise ConfigError(f"{prefix}no head address; expected HOST:PORT, or several as a:11000,b:11000")
    addresses: list[str] = []
    for position, entry in enumerate(entries, 1):
        if not isinstance(entry, str) or not entry.strip():
            raise ConfigError(
                f"{prefix}head address #{position} is empty or not a string; expected HOST:PORT[,HOST:PORT...]"
            )
        host, port = parse_host_port(entry, f"{prefix}head address #{position}")
        if not 0 < port < 65536:
            raise ConfigError(f"{prefix}head address #{position} {entry.strip()!r}: the port must be in 1..65535")
        address = f"{url_host(host)}:{port}"
        if address in addresses:
            raise ConfigError(f"{prefix}head address {address!r} is listed twice")
        addresses.append(address)
    return tuple(addresses)


def base_url(host: str, port: int) -> str:
    """The http:// base URL of a server bound at host:port."""
    authority = url_host(connectable_host(host))
    if authority.startswith("[") and "%" in authority and "%25" not in authority:
        authority = authority.replace("%", "%25", 1)  # an IPv6 zone id in a URL is written %25 (RFC 6874)
    return f"http://{authority}:{port}"


def url_authority(url: str) -> str:
    """`host:port` of an http:// base URL (IPv6 bracketed, as in the URL): what names an instance of a server."""
    return url.partition("://")[2].partition("/")[0]


@dataclass(frozen=True)
class InstanceAddress:
    """Where one instance of a server listens: the host and port as written, and the URL clients dial."""

    host: str
    port: int
    url: str

    @classmethod
    def of(cls, host: str, port: int) -> InstanceAddress:
        return cls(host=host, port=port, url=base_url(host, port))

    @property
    def instance_id(self) -> str:
        """The authority of `url` (`127.0.0.1:8000`, `[::1]:8000`): what names the instance on head and clients."""
        return url_authority(self.url)
