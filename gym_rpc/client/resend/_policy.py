"""`http_client.retry`: how long and how often a data-plane call is resent, per kind of failure, and the share of
the client's calls that may be resending at once. docs/failures.md gives the defaults and their reasons.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt, model_validator


class FailureKind(StrEnum):
    """How an attempt failed (gym_rpc.client.resend._failures tells which): each kind has its own budget below.
    Here, not with that classification, because this module must not import aiohttp (config is read before any
    call)."""

    REFUSED = "refused"
    DROPPED_BEFORE_WRITE = "dropped_before_write"
    DROPPED_AFTER_WRITE = "dropped_after_write"
    TIMEOUT = "timeout"
    # An answer of 429 or 503: the instance is busy, not broken, and did not act on the call. Resent elsewhere (a
    # replicated server) or after its Retry-After; when its budget ends, the caller gets that answer, no error.
    BACKPRESSURE = "backpressure"


# The answers that say "busy, come back later" (RFC 6585 429 Too Many Requests, RFC 9110 503 Service Unavailable).
BACKPRESSURE_STATUSES = frozenset({429, 503})


class KindBudget(BaseModel):
    """One kind's budget: at most `attempts` attempts of the call failing so, and no resend after such a failure
    later than `seconds` after the call first failed (of any kind: one clock, so the longest budget bounds a call
    however its failures alternate); the call's own deadline bounds both."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    attempts: PositiveInt
    seconds: NonNegativeFloat = Field(allow_inf_nan=False)


# Each kind's budget when the config gives none, and why (docs/failures.md).
KIND_DEFAULTS: Mapping[FailureKind, KindBudget] = {
    # Nothing was sent: always safe to resend. 30 s outlasts a process or container restart.
    FailureKind.REFUSED: KindBudget(attempts=100, seconds=30.0),
    FailureKind.DROPPED_BEFORE_WRITE: KindBudget(attempts=100, seconds=30.0),
    # The server may have acted on the request: a few attempts (a request that crashes its server is not sent
    # 30 times); in a restart the next attempt is refused, and that kind's budget rides the restart out.
    FailureKind.DROPPED_AFTER_WRITE: KindBudget(attempts=3, seconds=30.0),
    # A timeout has spent its time already, and resending to a server too slow to answer adds to its load.
    FailureKind.TIMEOUT: KindBudget(attempts=1, seconds=0.0),
    # A busy server is asked again a few times, not millions (NeMo Gym #2527: a 429 storm of 6.17 million
    # retries); a Retry-After beyond the time left is not waited for: the caller gets the 429 or 503 at once.
    FailureKind.BACKPRESSURE: KindBudget(attempts=4, seconds=60.0),
}
# The kinds `retry.attempts` (the one budget before there were kinds) still sets, where a kind sets none itself.
LEGACY_ATTEMPT_KINDS = (FailureKind.REFUSED, FailureKind.DROPPED_BEFORE_WRITE, FailureKind.DROPPED_AFTER_WRITE)


class ClientBudget(BaseModel):
    """The client's resend budget (Envoy's retry budget), per server name: a server's resends waiting out their
    backoff at once, in the whole process, at most `share` of the process's first attempts in flight, and never
    fewer than `floor` (gym_rpc.client.resend._budget)."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    share: float = Field(default=0.2, gt=0, le=1)
    floor: PositiveInt = 3

    def slots(self, attempts_in_flight: int) -> int:
        return max(self.floor, int(self.share * attempts_in_flight))


class RetryPolicy(BaseModel):
    """Resends of a data-plane call: a budget per kind of failure, jittered exponential backoff between attempts,
    and the client's budget. `attempts`, when given, is the attempts of every kind but timeouts that does not set
    its own (what it meant before there were kinds)."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    attempts: PositiveInt | None = None
    initial_backoff_seconds: PositiveFloat = 0.05
    max_backoff_seconds: PositiveFloat = 2.0
    multiplier: float = Field(default=2.0, ge=1.0)  # below 1 the backoff shrinks (or flips sign) per attempt
    refused: KindBudget = KIND_DEFAULTS[FailureKind.REFUSED]
    dropped_before_write: KindBudget = KIND_DEFAULTS[FailureKind.DROPPED_BEFORE_WRITE]
    dropped_after_write: KindBudget = KIND_DEFAULTS[FailureKind.DROPPED_AFTER_WRITE]
    timeout: KindBudget = KIND_DEFAULTS[FailureKind.TIMEOUT]
    backpressure: KindBudget = KIND_DEFAULTS[FailureKind.BACKPRESSURE]
    client_budget: ClientBudget = ClientBudget()

    @model_validator(mode="before")
    @classmethod
    def _kind_defaults(cls, data: Any) -> Any:
        """Each kind's block completed from its defaults and the legacy `attempts`: a block may give one key."""
        if not isinstance(data, Mapping):
            return data
        filled = dict(data)
        legacy = filled.get("attempts")
        for kind, default in KIND_DEFAULTS.items():
            given = filled.get(kind.value)
            if isinstance(given, KindBudget):
                continue
            if given is None:
                given = {}
            if not isinstance(given, Mapping):
                continue  # validation names the bad value
            inherited = {"attempts": legacy} if legacy is not None and kind in LEGACY_ATTEMPT_KINDS else {}
            filled[kind.value] = {**default.model_dump(), **inherited, **given}
        return filled

    def budget(self, kind: FailureKind) -> KindBudget:
        budget: KindBudget = getattr(self, kind.value)
        return budget

    def backoff_seconds(self, failed_attempts: int) -> float:
        """The pause after the n-th failure: exponential, capped, with half of it random (no thundering herd)."""
        try:
            grown = self.initial_backoff_seconds * self.multiplier ** (failed_attempts - 1)
        except OverflowError:  # a hundred attempts with a large multiplier
            grown = self.max_backoff_seconds
        ceiling = min(self.max_backoff_seconds, grown)
        return ceiling / 2 + random.uniform(0, ceiling / 2)
