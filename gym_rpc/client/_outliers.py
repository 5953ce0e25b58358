"""Passive outlier ejection: an instance that fails calls several times in a row is taken out of rotation for a
while, then let back on probation; Envoy's outlier detection, with its defaults as the guide.

A failure is what says the instance, not the call, is at fault: a connection refused, reset or timed out while
connecting, a connection dropped, or a 5xx answer. Any other answer is a success and resets the count. The n-th
ejection in a row lasts n times the base (capped), and at most half of a server's instances are ever ejected at
once, so a fault on the client's side (or one that hits every instance alike) cannot empty a server. The head's
probe is the other input: an instance the head probes successfully after its ejection returns at once.

`http_client.outlier_detection` in the global config sets the policy (every key has a default).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

if TYPE_CHECKING:  # the policy is read with the config: the instances themselves come with the first routed call
    from gym_rpc.client._instances import Instance

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
) -> bool:
    """Count one failure of `instance`; returns whether this one ejected it (then the route must refresh)."""
    instance.consecutive_failures += 1
    instance.last_failure = reason
    if instance.consecutive_failures < policy.consecutive_failures or instance.ejected(now):
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
    logger.info("instance %s of %s returns to rotation (%s)", instance.instance_id, server_name, why)


def ejection_over(instance: Instance, now: float) -> str | None:
    """Why an ejected instance may return now (its time is up, or the head probed it successfully since it was
    ejected), or None while it stays out."""
    if instance.ejected_until <= now:
        return "its ejection ended; on probation"
    if instance.status == "success" and instance.checked_at != instance.ejected_checked_at:
        return "the head's probe answered since it was ejected; on probation"
    return None
