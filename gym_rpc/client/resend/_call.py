"""One data-plane call as it goes out and, after a failure, is resent: the object `send` (gym_rpc.client.data) and
the resend loop read, made once per call by the client's pipeline (gym_rpc.client.data.DataPlane)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import aiohttp
    from aiohttp.client import _RequestOptions

    from gym_rpc.client.resend._policy import RetryPolicy

# The replicas hook, asked once a failed attempt may be resent, with that attempt's error: the URL of the next
# attempt (another instance, or the same one). A URL not tried since the last pause is tried at once; one already
# tried, after the backoff pause. Called only on failures, never on the happy path; the budgets count every
# attempt, whatever its URL.
Reroute = Callable[[BaseException], str]


class CallObserver(Protocol):
    """What `send` tells whoever observes a call (a span, the worker metrics): each attempt after the first and the
    kind of failure that made it, then the answer or the error the caller gets, with the number of attempts made.
    Told from inside `send`, so observing adds no coroutine between the caller and aiohttp (each one costs every
    resumption of the call).

    An observer may fail, a call may not: whatever an observer raises is logged under its `kind` ("tracing",
    "metrics"; gym_rpc.telemetry.instrumentation_failed) and the call goes on, its answer returned (or its own
    error raised) and its connection released."""

    kind: str

    def resent(self, attempt: int, kind: str) -> None: ...

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None: ...

    def failed(self, error: BaseException, attempts: int) -> None: ...


class Call:
    """One call: where it goes (`session`, `method`, `url`, aiohttp's `kwargs`), to which server and rollout (its
    key, once worked out, or None), its budgets (`retry`) and whether a request that may have been written may
    go out again (`resend`), who is told how it goes (`observer`) and, for a replicated server, where each resend
    goes (`reroute`). `started` is the start of its deadline (time.monotonic), set when its first attempt goes
    out."""

    __slots__ = (
        "kwargs",
        "method",
        "observer",
        "reroute",
        "resend",
        "retry",
        "rollout",
        "server",
        "session",
        "started",
        "url",
    )

    def __init__(
        self,
        session: aiohttp.ClientSession,
        method: str,
        url: str,
        kwargs: _RequestOptions,
        retry: RetryPolicy,
        *,
        server: str = "",
        resend: bool = True,
        rollout: str | None = None,
        observer: CallObserver | None = None,
        reroute: Reroute | None = None,
    ) -> None:
        self.session = session
        self.method = method
        self.url = url
        self.kwargs = kwargs
        self.retry = retry
        self.server = server
        self.resend = resend
        self.rollout = rollout
        self.observer = observer
        self.reroute = reroute
        self.started = 0.0

    def __repr__(self) -> str:
        return f"<Call {self.method} {self.url} to {self.server or '?'}>"
