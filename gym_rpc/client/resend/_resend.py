"""The failure path of a data-plane call: `send` (gym_rpc.client.data._http) hands its first failed attempt here,
with the call itself (what it reads of it: `ResentCall`).

Each failure is classified (gym_rpc.client.resend._failures) and resent while its kind's budget (`RetryPolicy`)
allows, after a jittered exponential pause, with one of its server's resend slots (gym_rpc.client.resend._budget)
held during the pause; a failover to an instance not tried since the last pause goes out at once and takes no slot.
The call's own deadline (aiohttp's `total`, which aiohttp applies per attempt) bounds the whole: every resend gets
only the time left. When nothing more may be tried, the call fails with a ResendsExhaustedError
naming the server, the URL, the kind, the attempts, the time spent and what ran out.

Nothing here runs while calls succeed at their first attempt.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from time import monotonic
from typing import TYPE_CHECKING, Protocol

import aiohttp

from gym_rpc._aiohttp_errors import ServerDroppedError
from gym_rpc.client.resend._budget import RESEND_BUDGET
from gym_rpc.client.resend._failures import (
    Backpressure,
    failure_kind,
    is_deadline,
    nothing_sent,
    retry_after_seconds,
)
from gym_rpc.client.resend._fresh import session_after_drop
from gym_rpc.client.resend._log import RESEND_LOG
from gym_rpc.client.resend._policy import BACKPRESSURE_STATUSES, FailureKind, RetryPolicy
from gym_rpc.errors import (
    GivenUpFacts,
    RequestTimeoutError,
    ResendLimit,
    ResendsExhaustedError,
    ServerUnreachableError,
)
from gym_rpc.telemetry import instrumentation_failed

if TYPE_CHECKING:
    from aiohttp.client import _RequestOptions


# The replicas hook, asked once a failed attempt may be resent, with that attempt's error: the URL of the next
# attempt (another instance, or the same one). A URL not tried since the last pause is tried at once; one already
# tried, after the backoff pause. Called only on failures, never on the happy path; the budgets count every
# attempt, whatever its URL.
Reroute = Callable[[BaseException], str]
_DROPPED = (FailureKind.DROPPED_BEFORE_WRITE, FailureKind.DROPPED_AFTER_WRITE)


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


class ResentCall(Protocol):
    """What the resend loop reads of a call (gym_rpc.client.data's `Call`, one object per call): where it goes,
    its budgets, whether what may have been written may go out again, its observer and reroute, and `started`,
    the start of its deadline (time.monotonic)."""

    session: aiohttp.ClientSession
    method: str
    url: str
    kwargs: _RequestOptions
    retry: RetryPolicy
    server: str
    resend: bool
    observer: CallObserver | None
    reroute: Reroute | None
    started: float


async def resend_after_failure(call: ResentCall, error: BaseException) -> aiohttp.ClientResponse:
    """Resend `call`, whose first attempt (started at `call.started`) failed with `error` (a `Backpressure` for an
    answer of 429 or 503): its answer, or the error it ends with (told to its observer either way). A 429 or 503
    that may not be resent (its budget, the deadline, the client's budget) is the answer."""
    failing = _FailingCall(call)
    session, method, kwargs, observer, server_name = (
        call.session,
        call.method,
        call.kwargs,
        call.observer,
        call.server,
    )
    attempts = 1
    sends_on = session  # the pool until an attempt is dropped, then new connections (gym_rpc.client.resend._fresh)
    try:
        while True:
            kind = failure_kind(error)
            if kind is None:
                raise error
            if kind in _DROPPED and sends_on is session:
                sends_on = session_after_drop(session)
            failed_url = failing.url
            busy = error.response if isinstance(error, Backpressure) else None
            try:
                target = await failing.next_attempt(error, kind, attempts, call.resend, call.reroute)
            except ResendsExhaustedError:
                if busy is None:
                    raise
                return _answer(busy, attempts, observer)  # the caller gets the 429 or 503 itself
            except BaseException:
                if busy is not None:
                    busy.release()
                raise
            if busy is not None:
                busy.release()  # resent: nobody reads this one
            RESEND_LOG.resent(server_name, failed_url, kind)
            attempts += 1
            if observer is not None:
                try:
                    observer.resent(attempts, kind)
                except Exception as observer_error:
                    instrumentation_failed(observer.kind, observer_error)
            RESEND_BUDGET.resend_started()  # out at the server: it widens no one's budget
            try:
                response = await sends_on.request(method, target, **kwargs)
            except BaseException as failure:
                error = failure
                continue
            finally:
                RESEND_BUDGET.resend_ended()
            if response.status in BACKPRESSURE_STATUSES:
                error = Backpressure(response)
                continue
            return _answer(response, attempts, observer)
    except BaseException as final:
        if isinstance(final, ResendsExhaustedError):
            RESEND_LOG.gave_up(final)
        if observer is not None:
            try:
                observer.failed(final, attempts)
            except Exception as observer_error:
                instrumentation_failed(observer.kind, observer_error)
        raise


def _answer(
    response: aiohttp.ClientResponse, attempts: int, observer: CallObserver | None
) -> aiohttp.ClientResponse:
    """`response`, the call's answer, told to `observer` first."""
    if observer is not None:
        try:
            observer.answered(response, attempts)
        except Exception as observer_error:
            instrumentation_failed(observer.kind, observer_error)
        except BaseException:  # the caller never gets the response: released here
            response.close()
            raise
    return response


class _FailingCall:
    """A call's failures so far, per kind, and what its next attempt may be."""

    def __init__(self, call: ResentCall) -> None:
        self.method, self.url, self.retry, self.kwargs, self.server_name = (
            call.method, call.url, call.retry, call.kwargs, call.server,
        )  # fmt: skip
        self.started = started = call.started
        given = call.kwargs.get("timeout")
        self.timeout = given if isinstance(given, aiohttp.ClientTimeout) else call.session.timeout
        self.deadline = None if not self.timeout.total else started + self.timeout.total
        self.failures: Counter[FailureKind] = Counter()
        self.first_failed_at: float | None = None
        self.pauses = 0
        self.tried_since_pause = {call.url}

    async def next_attempt(
        self,
        error: BaseException,
        kind: FailureKind,
        attempts: int,
        resend_after_disconnect: bool,
        reroute: Reroute | None,
    ) -> str:
        """The URL of the next attempt, once its pause is over; or raise what the call ends with, when its budgets
        allow no other attempt."""
        now = monotonic()
        self.failures[kind] += 1
        budget = self.retry.budget(kind)
        if self.first_failed_at is None:
            self.first_failed_at = now
        # One clock for every kind: the longest budget bounds all. A pause is taken only when the attempt after
        # it gets at least as long as the pause before the deadline: one with a sliver of time left ends on the
        # deadline before it reaches the server, and the call would end as a timeout where the server refused.
        kind_ends = self.first_failed_at + budget.seconds
        ends = kind_ends if self.deadline is None else min(kind_ends, self.deadline)
        if kind is FailureKind.TIMEOUT and is_deadline(error):
            raise self.given_up(error, kind, attempts, "deadline")
        if not resend_after_disconnect and not nothing_sent(kind, error):
            raise self.given_up(error, kind, attempts, "no resend")
        if self.failures[kind] >= budget.attempts:
            raise self.given_up(error, kind, attempts, "attempts")
        target = self.url if reroute is None else reroute(error)
        if target not in self.tried_since_pause:
            pause = 0.0
        else:
            asked = retry_after_seconds(error.response) if isinstance(error, Backpressure) else None
            pause = self.retry.backoff_seconds(self.pauses + 1) if asked is None else asked
        if now + pause > ends:
            raise self.given_up(error, kind, attempts, "time" if ends == kind_ends else "deadline")
        if self.deadline is not None and now + 2 * pause > self.deadline:
            raise self.given_up(error, kind, attempts, "deadline")
        if pause:  # a failover to an instance not tried since the last pause goes out at once, taking no slot
            server_name = self.server_name
            if not await RESEND_BUDGET.acquire(server_name, self.retry.client_budget, ends - pause - now):
                held, in_flight, waiting = RESEND_BUDGET.snapshot(server_name)
                detail = (
                    f"{held} resend slot(s) of this server's held, {in_flight} first attempt(s) in flight, "
                    f"{waiting} call(s) of this server's waiting; http_client.retry.client_budget allows "
                    f"{self.retry.client_budget.slots(in_flight)} per server"
                )
                raise self.given_up(error, kind, attempts, "client budget", detail)
            try:
                await asyncio.sleep(pause)
            finally:
                RESEND_BUDGET.release(server_name)
        if pause:
            self.pauses += 1
            self.tried_since_pause = {target}
        else:
            self.tried_since_pause.add(target)
        if self.deadline is not None:
            left = self.deadline - monotonic()
            if left <= 0 or left < pause:
                raise self.given_up(error, kind, attempts, "deadline")
            self.kwargs["timeout"] = with_total(self.timeout, left)
        self.url = target
        return target

    def given_up(
        self, error: BaseException, kind: FailureKind, attempts: int, limit: ResendLimit, detail: str = ""
    ) -> ResendsExhaustedError:
        """The error the call ends with (its cause: `error`, the last attempt's)."""
        elapsed = monotonic() - self.started
        facts: GivenUpFacts = {
            "server_name": self.server_name,
            "method": self.method,
            "elapsed_seconds": elapsed,
            "limit": limit,
            "detail": detail,
        }
        given_up: ResendsExhaustedError
        if kind is FailureKind.REFUSED:
            reason = getattr(error, "os_error", None) or error
            given_up = ServerUnreachableError(self.url, attempts, str(reason), **facts)
        elif kind is FailureKind.TIMEOUT:
            timeout = self.timeout
            given_up = RequestTimeoutError(
                self.server_name, self.method, self.url, timeout.total, timeout.sock_connect, attempts=attempts,
                elapsed_seconds=elapsed, limit=limit, detail=detail,
            )  # fmt: skip
        else:
            reason = str(error) or type(error).__name__
            errno = error.errno if isinstance(error, OSError) else None
            given_up = ServerDroppedError(self.url, attempts, reason, kind=kind, errno=errno, **facts)
        given_up.__cause__ = error
        return given_up


def with_total(timeout: aiohttp.ClientTimeout, total: float) -> aiohttp.ClientTimeout:
    """`timeout` with `total` seconds: a resend gets the time left of the call's deadline, no more."""
    return aiohttp.ClientTimeout(
        total=total,
        connect=timeout.connect,
        sock_read=timeout.sock_read,
        sock_connect=timeout.sock_connect,
        ceil_threshold=timeout.ceil_threshold,
    )
