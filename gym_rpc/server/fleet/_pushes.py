"""When the head pushes status changes to its watchers: changes that come close together go out as one message.

Istio's idea (its debounce of config pushes): a change is pushed once nothing has changed for `quiet_seconds`,
and never later than `max_delay_seconds` after the first change it holds, however the changes keep coming. A
change after a quiet spell (nothing pushed for `quiet_seconds`) goes out at once, so a lone change (an instance
dies) costs no delay. A storm of a thousand changes in a second thus reaches each watcher as a few merged messages,
the last one `quiet_seconds` after the storm ends, and every watcher waiting on the same pushed revision gets the
same message (gym_rpc.server.fleet._watch_feed builds and encodes it once).

A push is written to thousands of watchers one after another on the head's one event loop, and while it is, the
loop takes new calls only between those writes (a few a second at W = 1,000 under load). So the debounce's clock
starts when the watchers woken by the last push have written it and come back to wait, not when it began: a change
made while they are still writing is held, and goes out `quiet_seconds` after they are done (or `max_delay_seconds`
after that, while changes keep coming). Pushed back to back instead, each push carried the one registration the
loop took during the last, and a storm of 1,000 changes took a minute to register (bench/SCALE.md). Watchers that
have not come back after `max_delay_seconds` of no other coming back (a stream that ended mid-write) are not
waited for; before the first comes back (the loop's first pass over 10,000 of them can take longer than that on a
loaded machine) a push is waited for up to MAX_PUSH_DELAY_SECONDS.

The prober tells `Pushes` of every revision it makes (`changed`, in its event loop, synchronously); watchers wait
on `wake` and read `revision`, the last revision pushed. A push wakes every waiting watcher, and watchers that also
look again every so often (heartbeats, engine loads) share one timer per period: a waiting watcher costs one
future, no timer, task or callback of its own. Timers are the loop's own (`call_later`), so nothing is left running
when the loop ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

DEFAULT_QUIET_SECONDS = 0.05
DEFAULT_MAX_DELAY_SECONDS = 0.5
MAX_PUSH_DELAY_SECONDS = 10.0  # Istio's own upper bound: a change held longer is a stale view


class Pushes:
    """The revision watchers are told of (`revision`), which follows the prober's through the debounce."""

    def __init__(
        self,
        current: Callable[[], int],
        *,
        quiet_seconds: float = DEFAULT_QUIET_SECONDS,
        max_delay_seconds: float = DEFAULT_MAX_DELAY_SECONDS,
    ) -> None:
        self._current = current  # the prober's revision now
        self.quiet_seconds = quiet_seconds
        self.max_delay_seconds = max(quiet_seconds, max_delay_seconds)
        self.revision = current()
        self.pushed = 0  # pushes made (tests and the scale bench read it)
        self._last_push = -float("inf")  # time.monotonic() of the last push
        self._first_held = 0.0  # when the oldest change not pushed yet came
        self._last_change = 0.0
        self._out = 0  # watchers a push woke that have not come back to wait (still writing it)
        self._last_back = -float("inf")  # when the last of them came back
        self._timer: asyncio.TimerHandle | None = None
        self._wakes: dict[float, list[asyncio.Future[bool]]] = {}  # period -> its watchers' futures (`wake`)

    def changed(self) -> None:
        """The prober made a revision: push it now (after a quiet spell), or hold it for the debounce."""
        now = time.monotonic()
        self._last_change = now
        if self._timer is not None:
            return  # held: the timer pushes it with the rest
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a prober driven synchronously): nobody waits, nothing to hold
            self._push(now)
            return
        if self.quiet_seconds == 0 or (not self._writing(now) and now - self._written_at() >= self.quiet_seconds):
            self._push(now)
            return
        self._first_held = now
        self._timer = loop.call_later(self.quiet_seconds, self._due)

    def _writing(self, now: float) -> bool:
        """Whether watchers are still writing the last push: some have not come back, and either none has yet
        (the loop's first pass over thousands of them can outlast the max delay; waited for up to
        MAX_PUSH_DELAY_SECONDS) or one came back less than `max_delay_seconds` ago. Those that stay away longer
        after the rest (a stream that ended mid-write) are not waited for."""
        if self._out:
            if self._last_back < self._last_push:  # none back yet
                if now - self._last_push < MAX_PUSH_DELAY_SECONDS:
                    return True
            elif now - self._last_back < self.max_delay_seconds:
                return True
        self._out = 0
        return False

    def _written_at(self) -> float:
        """When the last push was written to the watchers that came back for more (when it was made, before)."""
        return max(self._last_push, self._last_back)

    def _due(self) -> None:
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        if self._writing(now) and now < self._first_held + MAX_PUSH_DELAY_SECONDS:
            # the debounce starts once they are done: look again a quiet time from now
            self._timer = loop.call_later(self.quiet_seconds, self._due)
            return
        written = self._written_at()
        quiet_at = max(self._last_change, written) + self.quiet_seconds
        latest_at = min(
            max(self._first_held, written) + self.max_delay_seconds, self._first_held + MAX_PUSH_DELAY_SECONDS
        )
        if now >= min(quiet_at, latest_at):
            self._timer = None
            self._push(now)
            return
        self._timer = loop.call_later(min(quiet_at, latest_at) - now, self._due)

    def _push(self, now: float) -> None:
        self._last_push = now
        revision = self._current()
        if revision == self.revision:
            return
        self.revision = revision
        self.pushed += 1
        wakes, self._wakes = self._wakes, {}
        for waiters in wakes.values():
            for waiter in waiters:
                if not waiter.done():  # a watcher cancelled meanwhile cancelled its own future
                    waiter.set_result(True)
                    self._out += 1

    def wake(self, period: float) -> asyncio.Future[bool]:
        """What a watcher that looks again every `period` seconds awaits: True at the next push, False at the next
        tick of its period. A future of its own (cancelling its watcher cancels nothing else), kept in a list per
        period that one timer of that period ends: a waiting watcher costs the future, no timer or callback."""
        if self._out:  # back from writing a push
            self._out -= 1
            self._last_back = time.monotonic()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        waiters = self._wakes.get(period)
        if waiters is None:
            waiters = self._wakes[period] = []
            loop.call_later(period, self._tick, period, waiters)
        waiters.append(waiter)
        return waiter

    def _tick(self, period: float, waiters: list[asyncio.Future[bool]]) -> None:
        if self._wakes.get(period) is waiters:
            del self._wakes[period]
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(False)

    def close(self) -> None:
        """Push what is held now and stop the timer (the head stops)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._push(time.monotonic())
