"""Instances that register themselves: their leases and advertised hosts, the caps on them, the file that keeps
them across a restart (`registrations_file`, a public module), which IPs a host name stands for.

Exports import on first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc.server.registry._limits import RegistrationCaps, RegistrationLimits
    from gym_rpc.server.registry._registry import (
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

_EXPORTS = {
    "advertised_host": "gym_rpc.server.registry._registry",
    "CapReached": "gym_rpc.server.registry._registry",
    "DEFAULT_LEASE_SECONDS": "gym_rpc.server.registry._registry",
    "IdentityRefused": "gym_rpc.server.registry._registry",
    "InstanceRegistry": "gym_rpc.server.registry._registry",
    "is_valid_host": "gym_rpc.server.registry._registry",
    "MAX_LEASE_SECONDS": "gym_rpc.server.registry._registry",
    "MIN_LEASE_SECONDS": "gym_rpc.server.registry._registry",
    "peer_host": "gym_rpc.server.registry._registry",
    "RegistrationCaps": "gym_rpc.server.registry._limits",
    "RegistrationLimits": "gym_rpc.server.registry._limits",
}
__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "MAX_LEASE_SECONDS",
    "MIN_LEASE_SECONDS",
    "CapReached",
    "IdentityRefused",
    "InstanceRegistry",
    "RegistrationCaps",
    "RegistrationLimits",
    "advertised_host",
    "is_valid_host",
    "peer_host",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
