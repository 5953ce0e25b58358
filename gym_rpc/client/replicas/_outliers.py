"""Passive outlier ejection: an instance that fails calls several times in a row is taken out of rotation for a
while, then let back on probation; Envoy's outlier detection, with its defaults as the guide.

A failure is what a user feels of an instance: a connection refused, reset or timed out while connecting, no answer
within the call's deadline, a connection dropped before or after the answer's headers, a body that broke off or
went silent, or a 5xx answer. An answer whose body arrived whole is a success and resets the count (a caller that
lets an answer go before its end says nothing either way). The n-th ejection in a row lasts n times the base
(capped), and at most half of a server's instances are ever ejected at once, so a fault on the client's side (or
one that hits every instance alike) cannot empty a server.

An ejection ends on evidence, never on a change of the head's report alone:
* its time runs out, and the instance is back on probation: its next call decides, a success ends the probation,
  a failure ejects it again at once (for longer);
* or, for an ejection by failures to connect, a head's probe made since saw the instance answer below 500. A probe
  is evidence only of what it tests (a connection, and `GET /` below 500), so it never ends an ejection for
  timeouts, drops, broken bodies or 5xx answers to calls: a wedged instance answers its `GET /` and still never
  answers a POST.

`http_client.outlier_detection` in the global config sets the policy (every key has a default).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

if TYPE_CHECKING:  # the policy is read with the config: the instances themselves come with the first routed call
    from gym_rpc.client.replicas._instance_state import Instance

logger = logging.getLogger("gym_rpc.client.replicas")


class OutlierDetection(BaseModel):
    """When an instance is ejected and for how long (Envoy's `consecutive_5xx` and `base_ejection_time`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    consecutive_failures: PositiveInt = 5
    base_ejection_seconds: PositiveFloat = 30.0
    max_ejection_seconds: PositiveFloat = 300.0
    # Never more than this share of a server's instances ejected at once (rounded down: one of two, two of four).
    max_ejected_fraction: float = Field(default=0.5, ge=0.0, le=1.0)

    def ejection_seconds(self, level: int) -> float:
        """The length of the `level`-th ejection in a row (1, 2, ...)."""
        return min(self.base_ejection_seconds * level, self.max_ejection_seconds)


def record_failure(
    policy: OutlierDetection,
    server_name: str,
    instance: Instance,
    instances: tuple[Instance, ...],
    reason: str,
    now: float,
    connect: bool = False,
) -> bool:
    """Count one failure of `instance` (`connect`: nothing took the connection); returns whether this one ejected
    it (then the route must refresh). An instance on probation is ejected at its first failure."""
    instance.consecutive_failures += 1
    instance.last_failure = reason
    if instance.ejected(now):
        return False
    if not instance.on_probation and instance.consecutive_failures < policy.consecutive_failures:
        return False
    ejected = sum(1 for other in instances if other.ejected(now))
    if ejected + 1 > int(len(instances) * policy.max_ejected_fraction):
        return False  # the cap: it stays in rotation, and each of its failures still fails over
    if now - instance.last_ejection_ended > policy.max_ejection_seconds:
        instance.ejection_level = 0  # it served long enough since its last ejection: start from the base again
    instance.ejection_level += 1
    seconds = policy.ejection_seconds(instance.ejection_level)
    instance.ejected_until = now + seconds
    instance.ejected_checked_at = instance.checked_at
    instance.ejected_for_connect = connect
    instance.on_probation = False
    instance.ejections += 1
    instance.alive = False
    logger.warning(
        "instance %s of %s ejected for %.3g s after %d failures in a row (last: %s); %d of %d instances stay in "
        "rotation",
        instance.instance_id,
        server_name,
        seconds,
        instance.consecutive_failures,
        reason,
        len(instances) - ejected - 1,
        len(instances),
    )
    return True


def end_ejection(server_name: str, instance: Instance, now: float, why: str) -> None:
    """Let an ejected instance back on probation: its count starts again, and a new run of failures ejects it for
    longer."""
    instance.ejected_until = 0.0
    instance.consecutive_failures = 0
    instance.last_ejection_ended = now
    instance.on_probation = True
    logger.info("instance %s of %s returns to rotation (%s)", instance.instance_id, server_name, why)


def succeeded(server_name: str, instance: Instance) -> None:
    """A call of `instance` ended well (its answer whole): a run of failures ends, and so does a probation."""
    instance.consecutive_failures = 0
    if instance.on_probation:
        instance.on_probation = False
        logger.info("instance %s of %s passed its probation (a call succeeded)", instance.instance_id, server_name)


def ejection_over(instance: Instance, now: float) -> str | None:
    """Why an ejected instance may return now (its time is up; or, ejected for failures to connect, a head's
    probe since connected and was answered below 500), or None while it stays out. A report that changed for any
    other reason (another instance relabelled, a probe that got a 5xx) is no evidence."""
    if instance.ejected_until <= now:
        return "its ejection ended; on probation"
    if (
        instance.ejected_for_connect
        and instance.status == "success"
        and instance.http_status < 500
        and instance.checked_at != instance.ejected_checked_at
    ):
        return "the head's probe connected since it was ejected; on probation"
    return None
