"""One call to a replicated server, from its pick to its end (`RoutedCall`): the one place a call's counts change
(in flight at its instance, its picks, its group's calls there; under the route's lock), where its next attempt
goes after a failure (`reroute`, which the resend loop asks), and what its answer or failure tells the route
(gym_rpc.client.replicas._server_route: the picks, the pins, the failure classification). Runs per call.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

from gym_rpc.client.replicas._server_route import LATENCY_WEIGHT, failure_text, is_refused
from gym_rpc.client.resend import Backpressure

if TYPE_CHECKING:
    import aiohttp

    from gym_rpc.client.replicas._instance_state import Instance
    from gym_rpc.client.replicas._server_route import Group, Pin, ServerRoute

logger = logging.getLogger("gym_rpc.client.replicas")
_monotonic = time.monotonic


class RoutedCall:
    """One call to a replicated server: the instance it is at, counted in flight there until it ends. `key` is
    its rollout's, `session` the NeMo Gym session its cookies carry; with neither, it is a call of no rollout.

    The counts change under the route's lock: one client may serve the event loops of several threads, and
    `+= 1` from two of them at once could lose one (a count off for good skews every later two-choices pick).
    Only replicated calls come here; a server of one instance takes no lock."""

    __slots__ = ("counted", "group", "instance", "key", "path", "pin", "route", "session", "started", "tried")

    def __init__(
        self,
        route: ServerRoute,
        key: str | None,
        path: str,
        session: str | None = None,
        prompt: int | None = None,
    ) -> None:
        self.route = route
        self.key = key
        self.session = session
        self.path = path
        self.tried: tuple[Instance, ...] = ()
        self.counted = 0  # the attempts whose failure `reroute` counted: the call's end counts none twice
        self.pin: Pin | None
        group: Group | None = None  # a model call's group, while the call is at the group's instance
        if route.affine:
            # when a model call was placed (its answer's latency counts for its instance)
            self.started = now = _monotonic()
            instance, self.pin, group = route.pick_affine(key, session, prompt, now)
        else:
            self.started = now = 0.0
            if key is None and session is None:
                self.pin = None
                instance = route.pick(None)
            else:
                self.pin = pin = route.pin_of(key, session)
                instance = pin.instance
        self.instance = instance
        self.group = group
        lock = route.lock  # acquire/release, not `with`: a third of the cost on CPython 3.11 (replicas-pick rows)
        lock.acquire()
        try:
            instance.in_flight += 1
            instance.picks += 1
            route.in_flight_total += 1
            if group is not None:
                group.calls += 1
            if now and instance.in_flight >= instance.own_peak:  # a model call: see `Instance.own_peak`
                instance.own_peak, instance.own_peak_at = instance.in_flight, now
        finally:
            lock.release()

    def reroute(self, error: BaseException) -> str:
        """The URL of the next attempt after `error` (the resend loop asks): another instance after a refused
        connection, or for a call of no rollout; the same one for a rollout whose instance is still alive."""
        route, old, pin = self.route, self.instance, self.pin
        route.failed(old, error)
        self.counted = len(self.tried) + 1
        self.tried += (old,)
        if isinstance(error, Backpressure) and pin is not None and not route.moves_rollouts:
            with route.lock:  # a stateful rollout waits for its own instance (its Retry-After, else a backoff)
                old.picks += 1
            return old.url + self.path
        if pin is None or isinstance(error, Backpressure):  # busy: another instance, the rollout's pin kept
            new = route.other(self.tried)
        elif is_refused(error) or not old.alive:
            key = self.key if self.key is not None else self.session
            assert key is not None
            new = route.repin(key, pin, self.tried, failure_text(error)).instance
        else:  # a dropped call of a rollout whose instance lives: resent there
            with route.lock:
                old.picks += 1
            return old.url + self.path
        with route.lock:  # the route's total stays: the call moves
            old.in_flight -= 1
            new.in_flight += 1
            new.picks += 1
            if self.started and new.in_flight >= new.own_peak:
                new.own_peak, new.own_peak_at = new.in_flight, _monotonic()
            if self.group is not None:  # no longer at its group's instance
                self.group.calls -= 1
                self.group = None
        self.instance = new
        if self.started:  # the latency figure is the new instance's
            self.started = _monotonic()
        return new.url + self.path

    def answered(self, response: aiohttp.ClientResponse, deadline: float | None = None) -> None:
        """The answer's headers came: a 5xx is a failure; any other answer succeeds once its body is read whole
        (told by its connection's release: `ServerRoute.body_ended`), or at once when it came whole already."""
        instance, route, group, started = self.instance, self.route, self.group, self.started
        now = _monotonic() if started else 0.0  # a model call's (prefix-affine picking reads these)
        lock = route.lock
        lock.acquire()
        try:
            instance.in_flight -= 1
            route.in_flight_total -= 1
            if now and not instance.in_flight:  # this process's last call there ended
                instance.left_at = now
                if group is not None:  # a group's: a home for its worker's next group
                    route.homes[instance] = now
            if group is not None:
                group.calls -= 1
                self.group = None
        finally:
            lock.release()
        status = response.status
        if status >= 500:
            route.failed_with(instance, f"HTTP {status}")
            return
        if now and status < 400:  # an answer, not a refusal (a 429 comes back fast): the instance's latency
            seconds, previous = now - started, instance.latency  # an EWMA of its answers' times (`slow`)
            latency = seconds if not previous else previous + LATENCY_WEIGHT * (seconds - previous)
            instance.latency, instance.latency_at = latency, now
            # Slow from this answer on, not from the next read (up to ENGINE_LOAD_READ_SECONDS later): a group's
            # rollouts are answered together and send their next turns at once, which would all stay there. The
            # next read judges it again by a bound made then (a verdict stands from a read's on: `slow_at`).
            if latency > route.slow_bound and not instance.slow:
                instance.slow = route.any_slow = True
        connection = response.connection
        if connection is None:  # no body, or all of it read with the headers: the connection is free already
            if instance.consecutive_failures or instance.on_probation:  # else a success ends nothing
                route.succeeded(instance)
        else:
            connection.add_callback(functools.partial(route.body_ended, instance, response, deadline))
        # A call that carried no session may have opened one (a NeMo Gym server sets its cookie on every answer;
        # a call carrying one keeps it): pinned with the call's rollout.
        if self.session is None and "Set-Cookie" in response.headers:
            try:
                route.learn_session(response, instance, self.pin)
            except Exception:  # a malformed cookie must not fail an answered call
                logger.debug("cannot read the session cookie of an answer", exc_info=True)

    def failed(self, error: BaseException) -> None:
        """The call ended in `error`: counted against its instance unless `reroute` counted that attempt already
        (a call given up on after its failover was chosen: no attempt reached the new instance)."""
        with self.route.lock:
            self.instance.in_flight -= 1
            self.route.in_flight_total -= 1
            if self.group is not None:
                self.group.calls -= 1
                self.group = None
        attempts = getattr(error, "attempts", None)
        if attempts is None or attempts > self.counted:
            self.route.failed(self.instance, error)
