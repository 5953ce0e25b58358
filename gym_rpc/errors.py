"""Typed errors raised by gym_rpc. Every message names what was wrong and, where it helps, what to check.

Every error class lives here. How a failed gRPC call becomes one of them (and how the head sends the known server
names as standard `google.rpc.Status` details) is the wire layer's job: `gym_rpc.wire._errors`. This module imports
nothing heavy, so `import gym_rpc` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc


MAX_QUOTED_CHARACTERS = 200  # of a caller's text quoted in an error: enough to recognise, never a flood
MAX_LISTED_CHARACTERS = 1000  # of names listed in an error (the rest counted): a NOT_FOUND stays a few KiB


def quoted(text: str, limit: int = MAX_QUOTED_CHARACTERS) -> str:
    """`text` as an error quotes it: repr()'d, cut to `limit` characters with its length said when longer, so a
    caller's 4 MiB name comes back as a few hundred bytes."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def first_names(names: list[str], limit: int = MAX_LISTED_CHARACTERS) -> list[str]:
    """The first of `names`, in their order, that fit in `limit` characters (at least one)."""
    shown: list[str] = []
    used = 0
    for name in names:
        used += len(name) + 2
        if shown and used > limit:
            break
        shown.append(name[:MAX_QUOTED_CHARACTERS])
    return shown


def listed(names: list[str]) -> str:
    """Names for an error message: the first that fit in MAX_LISTED_CHARACTERS, and how many more."""
    shown = first_names(sorted(names))
    text = ", ".join(shown) or "(none)"
    return f"{text} (and {len(names) - len(shown)} more)" if len(shown) < len(names) else text


class GymRpcError(Exception):
    """Base class of every error gym_rpc raises on purpose."""


class ConfigError(GymRpcError, ValueError):
    """A config document or file is malformed (the message names the file and line when known)."""


class UnknownServerError(GymRpcError, KeyError):
    """A server name is not in the global config; the message lists the known names."""

    def __init__(self, server_name: str, known: list[str]) -> None:
        self.server_name = server_name
        self.known = known
        super().__init__(f"unknown server {quoted(server_name)}; known servers: {listed(known)}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class ControlPlaneError(GymRpcError):
    """A control-plane call failed; `code` is its `grpc.StatusCode`, `address` the head's address. The
    `grpc.RpcError` it came from is its `__cause__`."""

    def __init__(self, message: str, *, address: str, code: grpc.StatusCode) -> None:
        self.address = address
        self.code = code
        super().__init__(message)


class HeadUnreachableError(ControlPlaneError, ConnectionError, ValueError):
    """The head server could not be reached (refused, no route, or no answer within the deadline).

    Also a ValueError: NeMo Gym's client raises ValueError when it cannot reach the head, and code written for it
    catches that."""


class HeadTimeoutError(HeadUnreachableError, TimeoutError):
    """The head did not answer within the call's deadline (DEADLINE_EXCEEDED): it may be there but slow.

    A HeadUnreachableError too, as before this type existed, so code catching that keeps working."""


class ServerUnreachableError(GymRpcError, ConnectionError):
    """A Gym server refused or could not be reached at `url`, after the bounded retries."""

    def __init__(self, url: str, attempts: int, reason: str) -> None:
        self.url = url
        self.attempts = attempts
        super().__init__(
            f"server at {url} is unreachable after {attempts} attempt(s) ({reason}); check that it runs and "
            f"that its host and port in the global config are right"
        )


class NoHealthyInstanceError(ServerUnreachableError):
    """No instance of a replicated server may take the call: each is down by the head's probe, ejected after
    failures, draining, or outside the labels the worker asked for. `instances` is each instance's id and last
    status, as the message shows them. A ServerUnreachableError too: code catching that keeps working."""

    def __init__(self, server_name: str, instances: list[tuple[str, str]], why: str = "") -> None:
        self.server_name = server_name
        self.instances = instances
        listed = "; ".join(f"{instance_id} {status}" for instance_id, status in instances) or "none"
        reason = f"{why}; " if why else ""
        message = (
            f"no healthy instance of server {server_name!r} can take the call ({reason}{len(instances)} "
            f"instance(s): {listed}); check that its processes run and register with the head"
        )
        GymRpcError.__init__(self, message)
        self.url = instances[0][0] if instances else ""
        self.attempts = 0


class RequestTimeoutError(GymRpcError, TimeoutError):
    """A data-plane call got no answer within its deadline (a TimeoutError, as aiohttp's own is)."""

    def __init__(
        self, server_name: str, method: str, url: str, total_seconds: float | None, connect_seconds: float | None
    ) -> None:
        self.server_name = server_name
        self.url = url
        limits = [
            f"total {total_seconds:g} s" if total_seconds else "",
            f"connect {connect_seconds:g} s" if connect_seconds else "",
        ]
        super().__init__(
            f"{method} {url} (server {server_name!r}) got no answer within its deadline "
            f"({', '.join(x for x in limits if x) or 'none set'}); raise http_client.total_timeout_seconds "
            f"or pass timeout=aiohttp.ClientTimeout(total=...) for slower calls"
        )


class InvalidRolloutIdError(GymRpcError, ValueError):
    """A rollout id that cannot stand as one URL path segment."""


class MalformedGymPrefixError(GymRpcError, ValueError):
    """A `/ng-rollout/...` or `/ng-trace/...` path prefix that cannot be honoured; answered with 400."""


class UpstreamError(GymRpcError):
    """The upstream NeMo Gym head could not be reached or gave an answer the bridge cannot use."""
