"""Typed errors raised by gym_rpc. Every message names what was wrong and, where it helps, what to check.

Every error class lives here (ServerDroppedError, an aiohttp type too, in gym_rpc._aiohttp_errors, exported here on
first use). How a failed gRPC call becomes one of them (and how the head sends the known server
names as standard `google.rpc.Status` details) is the wire layer's job: `gym_rpc.wire._errors`. This module imports
nothing heavy, so `import gym_rpc` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Literal, TypedDict, Unpack

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


# What ended a data-plane call's resends (ResendsExhaustedError.limit).
ResendLimit = Literal["attempts", "time", "deadline", "client budget", "no resend"]
_KIND_WORDS = {
    "refused": "refused or unreachable",
    "dropped_before_write": "dropped before the request was written",
    "dropped_after_write": "dropped after the request was written",
    "timeout": "timed out",
}


class GivenUpFacts(TypedDict, total=False):
    """The keywords ServerUnreachableError and ServerDroppedError take besides their own, each optional: the
    call's `server_name` and `method` (empty if not known), the `elapsed_seconds` of its attempts (0.0), what
    ended its resends (`limit`, `attempts` if not said) and any more `detail` (empty)."""

    server_name: str
    method: str
    elapsed_seconds: float
    limit: ResendLimit
    detail: str


class ResendsExhaustedError(GymRpcError):
    """A data-plane call given up on: its last attempt failed with `kind` (gym_rpc.client's FailureKind values:
    refused, dropped_before_write, dropped_after_write, timeout) and `limit` ended its resends: its kind's
    `attempts` or `time`, the call's `deadline`, the client's full resend budget (`client budget`), or the caller's
    `_resend_after_disconnect=False` (`no resend`). The aiohttp error of the last attempt is its `__cause__`."""

    server_name: str
    method: str
    url: str
    kind: str
    attempts: int
    elapsed_seconds: float
    limit: ResendLimit
    detail: str

    def _record(
        self,
        url: str,
        kind: str,
        attempts: int,
        *,
        server_name: str = "",
        method: str = "",
        elapsed_seconds: float = 0.0,
        limit: ResendLimit = "attempts",
        detail: str = "",
    ) -> None:
        self.server_name, self.method, self.url, self.kind = server_name, method, url, kind
        self.attempts, self.elapsed_seconds, self.limit, self.detail = attempts, elapsed_seconds, limit, detail

    def _where(self) -> str:
        where = f"{self.method} {self.url}" if self.method else self.url
        return f"{where} (server {self.server_name!r})" if self.server_name else where

    def _story(self) -> str:
        """Which call failed how, how often and for how long, and what stopped its resends."""
        stopped = {
            "attempts": f"its {self.kind} budget's attempts ran out",
            "time": f"its {self.kind} budget's time ran out",
            "deadline": "its deadline ran out",
            "client budget": "the client's resend budget had no free slot in the time left",
            "no resend": "not resent: the server may have acted on it and _resend_after_disconnect=False",
        }[self.limit]
        detail = f"; {self.detail}" if self.detail else ""
        return (
            f"{self._where()}: {_KIND_WORDS.get(self.kind, self.kind)}, given up after {self.attempts} "
            f"attempt(s) in {self.elapsed_seconds:.1f} s ({stopped}{detail})"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # picklable (Ray), though __init__ takes more than the message
        state = dict(self.__dict__)
        if isinstance(self, OSError):  # errno lives in OSError's own slot, not in __dict__
            state["errno"] = self.errno
        return _rebuilt, (type(self), self.args, state)


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    error = cls.__new__(cls, *args)
    error.args = args
    for name, value in state.items():
        setattr(error, name, value)
    return error


class ServerUnreachableError(ResendsExhaustedError, ConnectionError):
    """A Gym server refused or could not be reached at `url`, after the bounded resends (kind `refused`). Its
    keywords: GivenUpFacts."""

    def __init__(self, url: str, attempts: int, reason: str, **facts: Unpack[GivenUpFacts]) -> None:
        self._record(url, "refused", attempts, **facts)
        super().__init__(
            f"{self._story()}: {reason}; check that it runs and that its host and port in the global config are "
            f"right"
        )


class NoHealthyInstanceError(ServerUnreachableError):
    """No instance of a replicated server may take the call: each is down by the head's probe, ejected after
    failures, draining, or outside the labels the worker asked for. `instances` is each instance's id and last
    status, as the message shows them. A ServerUnreachableError too: code catching that keeps working."""

    def __init__(self, server_name: str, instances: list[tuple[str, str]], why: str = "") -> None:
        self.instances = instances
        listed = "; ".join(f"{instance_id} {status}" for instance_id, status in instances) or "none"
        reason = f"{why}; " if why else ""
        message = (
            f"no healthy instance of server {server_name!r} can take the call ({reason}{len(instances)} "
            f"instance(s): {listed}); check that its processes run and register with the head"
        )
        self._record(instances[0][0] if instances else "", "refused", 0, server_name=server_name, detail=why)
        GymRpcError.__init__(self, message)


class RequestTimeoutError(ResendsExhaustedError, TimeoutError):
    """A data-plane call got no answer within its deadline, or timed out on every attempt its budget allowed (a
    TimeoutError, as aiohttp's own is; kind `timeout`)."""

    def __init__(
        self,
        server_name: str,
        method: str,
        url: str,
        total_seconds: float | None,
        connect_seconds: float | None,
        *,
        attempts: int = 1,
        elapsed_seconds: float | None = None,
        limit: ResendLimit = "deadline",
        detail: str = "",
    ) -> None:
        self._record(
            server_name=server_name,
            method=method,
            url=url,
            kind="timeout",
            attempts=attempts,
            elapsed_seconds=(total_seconds or 0.0) if elapsed_seconds is None else elapsed_seconds,
            limit=limit,
            detail=detail,
        )
        limits = [
            f"total {total_seconds:g} s" if total_seconds else "",
            f"connect {connect_seconds:g} s" if connect_seconds else "",
        ]
        deadlines = ", ".join(x for x in limits if x) or "none set"
        if limit == "deadline":
            what = (
                f"{self._where()} got no answer within its deadline ({deadlines}); {attempts} attempt(s) in "
                f"{self.elapsed_seconds:.1f} s{f' ({detail})' if detail else ''}"
            )
        else:
            what = f"{self._story()}; its deadlines: {deadlines}"
        super().__init__(
            f"{what}; raise http_client.total_timeout_seconds or pass timeout=aiohttp.ClientTimeout(total=...) "
            f"for slower calls"
        )


class InvalidRolloutIdError(GymRpcError, ValueError):
    """A rollout id that cannot stand as one URL path segment."""


class MalformedGymPrefixError(GymRpcError, ValueError):
    """A `/ng-rollout/...` or `/ng-trace/...` path prefix that cannot be honoured; answered with 400."""


class UpstreamError(GymRpcError):
    """The upstream NeMo Gym head could not be reached or gave an answer the bridge cannot use."""


def __getattr__(name: str) -> Any:
    """ServerDroppedError, an aiohttp type too, lives in gym_rpc._aiohttp_errors and is imported on first use:
    `import gym_rpc` loads no aiohttp. (Typed code can import it from gym_rpc.client.)"""
    if name != "ServerDroppedError":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = importlib.import_module("gym_rpc._aiohttp_errors").ServerDroppedError
    globals()[name] = value  # later lookups skip __getattr__
    return value
