"""Static replicas of a server entry: the `replicas:` key beside the entry's `host` and `port`.

```yaml
policy_model:
  responses_api_models:
    vllm_model:
      host: 10.0.0.1          # the entry's own address: the first instance, as it always was
      port: 8000
      replicas:               # more instances of the same server, in this order
        - {host: 10.0.0.2, port: 8000}
        - 10.0.0.3:8000       # or "host:port"
```
The key sits where NeMo Gym keeps a server's own settings (its entry models allow extra keys), so a NeMo Gym
server reading its entry is unaffected. Processes that register with the head add instances of their own at run
time; this key is for the ones an operator knows in advance.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any

from gym_rpc.config._addresses import InstanceAddress, parse_host_port
from gym_rpc.errors import ConfigError

REPLICAS_KEY = "replicas"
_ADDRESS_KEYS = frozenset({"host", "port"})
# Characters that would turn a host into something else inside a URL (a path, a query, userinfo, a fragment).
_NOT_IN_A_HOST = frozenset("/?#@\\ \t\r\n")


def replica_addresses(server_name: str, own: InstanceAddress, value: Any) -> tuple[InstanceAddress, ...]:
    """The static replicas an entry lists (none when the key is absent or null), each checked; a ConfigError of one
    line names the server, the replica and what is wrong. An address listed twice (the entry's own included) is
    refused: two instances at one address would be one process counted twice."""
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ConfigError(
            f'server {server_name!r}: {REPLICAS_KEY} must be a list of {{host, port}} mappings or "host:port" '
            f"strings, not {type(value).__name__}"
        )
    seen = {own.instance_id: "the entry's own address"}
    replicas = []
    for index, item in enumerate(value):
        where = f"server {server_name!r}: {REPLICAS_KEY}[{index}]"
        address = _replica(item, where)
        earlier = seen.get(address.instance_id)
        if earlier is not None:
            raise ConfigError(f"{where} {address.instance_id} is listed twice: it is also {earlier}")
        seen[address.instance_id] = f"{REPLICAS_KEY}[{index}]"
        replicas.append(address)
    return tuple(replicas)


def _replica(item: Any, where: str) -> InstanceAddress:
    if isinstance(item, str):
        host, port = parse_host_port(item, where)
    elif isinstance(item, Mapping):
        unknown = sorted(str(key) for key in item if key not in _ADDRESS_KEYS)
        if unknown:
            keys = ", ".join(map(repr, unknown))
            raise ConfigError(f"{where}: unknown key {keys} (a replica has host and port only)")
        missing = [key for key in ("host", "port") if key not in item]
        if missing:
            raise ConfigError(f"{where} has no {' and no '.join(missing)}")
        host, port = item["host"], item["port"]
        if not isinstance(host, str):
            raise ConfigError(f"{where}: host must be a string, not {type(host).__name__}")
    else:
        raise ConfigError(
            f'{where} must be a {{host, port}} mapping or a "host:port" string, not {type(item).__name__}'
        )
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"{where}: port must be an integer in 1..65535, not {port!r}")
    if not _is_plain_host(host):
        raise ConfigError(f"{where}: host {host!r} is neither an IP address nor a hostname")
    return InstanceAddress.of(host, port)


def _is_plain_host(host: str) -> bool:
    """A host that stays a host in a URL: not empty, nothing that starts a path, query, fragment or userinfo, and a
    colon only in an IPv6 literal (a port belongs in `port`)."""
    if not host.strip() or _NOT_IN_A_HOST & set(host):
        return False
    if ":" not in host:
        return True
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return ipaddress.ip_address(bare.split("%", 1)[0]).version == 6
    except ValueError:
        return False
