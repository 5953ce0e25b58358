"""Instances that register themselves: their leases and advertised hosts, the caps on them, the file that keeps
them across a restart (`registrations_file`, a public module), which IPs a host name stands for."""

from gym_rpc.server.registry._limits import RegistrationLimits as RegistrationLimits
from gym_rpc.server.registry._registry import DEFAULT_LEASE_SECONDS as DEFAULT_LEASE_SECONDS
from gym_rpc.server.registry._registry import MAX_LEASE_SECONDS as MAX_LEASE_SECONDS
from gym_rpc.server.registry._registry import MIN_LEASE_SECONDS as MIN_LEASE_SECONDS
from gym_rpc.server.registry._registry import CapReached as CapReached
from gym_rpc.server.registry._registry import IdentityRefused as IdentityRefused
from gym_rpc.server.registry._registry import InstanceRegistry as InstanceRegistry
from gym_rpc.server.registry._registry import advertised_host as advertised_host
from gym_rpc.server.registry._registry import is_valid_host as is_valid_host
from gym_rpc.server.registry._registry import peer_host as peer_host
