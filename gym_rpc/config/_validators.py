"""Checks of values a person types (flags, config keys), with one-line messages that name the flag or key."""

from __future__ import annotations

import ipaddress
import math
import re

from pydantic import ValidationError

from gym_rpc.errors import ConfigError

# The shortest probe interval a head accepts: shorter rounds would keep a core busy probing (and every server
# answering) for statuses no caller can tell apart.
MIN_PROBE_INTERVAL_SECONDS = 0.05


def validation_error_line(error: ValidationError, block: str) -> str:
    """One line a person reads for a pydantic error: `block.key: what is wrong` (pydantic's own text spans
    several lines and ends in a documentation URL), plus how many other problems there are."""
    problems = error.errors(include_url=False, include_input=False)
    if not problems:
        return f"{block}: invalid"
    first = problems[0]
    where = ".".join([block, *(str(part) for part in first["loc"])])
    more = (
        f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    )
    return f"{where}: {first['msg']}{more}"


def checked_port(value: int | None, what: str) -> int | None:
    """A port to bind (0: a free one); anything outside 0..65535 is refused rather than wrapped by the OS."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535):
        raise ConfigError(f"{what} must be in 0..65535 (0 picks a free port), not {value!r}")
    return value


def checked_seconds(value: float, what: str, minimum: float = 0.0) -> float:
    """A positive, finite duration (at least `minimum`): 0 would spin a core in a loop that waits it, nan and inf
    never end one."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what} must be a positive number of seconds, not {value!r}")
    if value < minimum:
        raise ConfigError(f"{what} must be at least {minimum:g} seconds, not {value!r}")
    return float(value)


MAX_CONCURRENT_REQUESTS_KEY = "max_concurrent_requests"


def checked_concurrency_cap(server_name: str, value: object) -> int | None:
    """A server entry's `max_concurrent_requests` (NeMo Gym #1208: calls in flight to a rate-limited judge): None
    when absent or null, else a positive integer; anything else is a ConfigError of one line naming the server."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"server {server_name!r}: {MAX_CONCURRENT_REQUESTS_KEY} must be a positive integer (the calls in "
            f"flight to it per client process) or null, not {type(value).__name__} {str(value)[:40]!r}"
        )
    return value


def checked_probe_interval(value: float) -> float:
    """The head's probe interval: positive, finite and no shorter than MIN_PROBE_INTERVAL_SECONDS."""
    return checked_seconds(value, "the probe interval (--probe-interval)", MIN_PROBE_INTERVAL_SECONDS)


_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST_PATTERN = re.compile(rf"(\*\.)?{_LABEL}(?:\.{_LABEL})*")  # a hostname, lowercased; `*.` for its subdomains


def checked_network_or_host(entry: str) -> str:
    """An entry of `head_server.registration.allowed_networks`: a CIDR or an IP address (normalised, so
    "10.1.2.3/8" reads 10.0.0.0/8), else a hostname, lowercased, that may start with `*.` for every name under a
    domain."""
    text = entry.strip()
    try:
        return str(ipaddress.ip_network(text, strict=False))
    except ValueError:
        pass
    name = text.lower().removesuffix(".")
    if len(name) > 253 or not _HOST_PATTERN.fullmatch(name) or name.rsplit(".", 1)[-1].isdigit():
        raise ValueError(f"{entry!r} is neither a network (CIDR such as 10.0.0.0/8), an IP address nor a hostname")
    return name
