"""Which addresses a registering server may have the head advertise (`head_server.registration.allowed_networks`).

A registration redirects every client of a server, and the head's prober, to the address it advertises. Without
a list, any address is accepted but the link-local range and the cloud metadata services (169.254.169.254 and its
IPv6 and IPv4-mapped forms, `metadata.google.internal`): a registration pointing there would have the head and
the workers send requests to the machine's credentials endpoint. With a list, only what it names is accepted (a
network, an address, a hostname or `*.domain`), the metadata addresses too when listed. The head never resolves
a hostname (DNS could answer differently at the next dial): a hostname passes only by name.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from gym_rpc.config import HEAD_SERVER_KEY

ALLOWED_NETWORKS_SETTING = f"{HEAD_SERVER_KEY}.registration.allowed_networks"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Refused unless listed: link-local (where cloud metadata services live) and the metadata services' addresses.
REFUSED_NETWORKS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(network)
    for network in (
        "169.254.0.0/16",  # IPv4 link-local: AWS, Azure, GCP, Oracle metadata at 169.254.169.254
        "fe80::/10",  # IPv6 link-local
        "fd00:ec2::254/128",  # AWS metadata over IPv6
        "100.100.100.200/32",  # Alibaba Cloud metadata
    )
)
REFUSED_HOSTNAMES = frozenset({"metadata.google.internal", "metadata.goog", "metadata"})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _forms(address: IPAddress) -> list[IPAddress]:
    """The address and any IPv4 address embedded in it (IPv4-mapped, 6to4, NAT64): `::ffff:169.254.169.254`
    reaches the same host as `169.254.169.254`."""
    forms: list[IPAddress] = [address]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            forms.append(address.ipv4_mapped)
        if address.sixtofour is not None:
            forms.append(address.sixtofour)
        if address in _NAT64:
            forms.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return forms


def _within(addresses: list[IPAddress], networks: Iterable[IPNetwork]) -> bool:
    return any(a in n for n in networks for a in addresses if a.version == n.version)


class AddressPolicy:
    """The allowed networks and names; `refusal(host)` says why a host may not be advertised (None: it may)."""

    def __init__(self, allowed: Iterable[str] = ()) -> None:
        """`allowed`: entries as `gym_rpc.config` checked them (CIDRs normalised, hostnames lowercased)."""
        self._networks: list[IPNetwork] = []
        self._names: set[str] = set()
        self._suffixes: list[str] = []
        for entry in allowed:
            try:
                self._networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if entry.startswith("*."):
                    self._suffixes.append(entry[1:])
                else:
                    self._names.add(entry)
        self._listed = bool(self._networks or self._names or self._suffixes)

    def refusal(self, host: str) -> str | None:
        """Why `host` (an IP literal, bracketed or with a zone, or a hostname) may not be advertised; None if it
        may."""
        bare = host.strip().strip("[]")
        try:
            address = ipaddress.ip_address(bare.split("%", 1)[0])
        except ValueError:
            return self._name_refusal(bare.lower().removesuffix("."))
        forms = _forms(address)
        if _within(forms, self._networks):
            return None
        if self._listed:
            return f"{bare} is not in {ALLOWED_NETWORKS_SETTING}"
        if _within(forms, REFUSED_NETWORKS):
            return (
                f"{bare} is a link-local or cloud metadata address, refused unless {ALLOWED_NETWORKS_SETTING} "
                f"lists it"
            )
        return None

    def _name_refusal(self, name: str) -> str | None:
        if name in self._names or any(name.endswith(suffix) for suffix in self._suffixes):
            return None
        if self._listed:
            return f"{name} is not in {ALLOWED_NETWORKS_SETTING} (a hostname passes by name only)"
        if name in REFUSED_HOSTNAMES:
            return f"{name} is a cloud metadata service, refused unless {ALLOWED_NETWORKS_SETTING} lists it"
        return None
