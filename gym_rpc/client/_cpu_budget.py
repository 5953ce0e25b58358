"""A background thread's share of the CPU: how long it must pause so its work costs the process at most `share` of
one core over time.

The instance follower (gym_rpc.client._follower) runs in the worker's own process: every message it converts and
applies holds the interpreter the worker's event loop needs. A head pushing a flood (a refit relabelling every
instance, a misbehaving or hostile head) would otherwise take the worker's data plane with it. A token bucket over
the thread's own CPU time (`time.thread_time`): work beyond the share is paid back by pausing, and a short burst
(the first snapshot, an occasional big change) is not delayed at all.
"""

from __future__ import annotations

import time

DEFAULT_SHARE = 0.1  # a tenth of one core: the worker keeps at least 90 % of its rate
DEFAULT_BURST_SECONDS = 0.1  # CPU seconds spent at once after a quiet spell without pausing


class CpuBudget:
    """Call `pause()` after each piece of work, then sleep what it says (0: go on at once)."""

    def __init__(self, share: float = DEFAULT_SHARE, burst_seconds: float = DEFAULT_BURST_SECONDS) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.share = share
        self.burst_seconds = burst_seconds
        self._cpu = time.thread_time()
        self._wall = time.monotonic()
        self._debt = -burst_seconds  # CPU seconds used beyond the share (negative: what may still be spent)
        self.paused_seconds = 0.0  # pauses asked for so far (tests and metrics read it)

    def pause(self) -> float:
        """Seconds to pause now so that this thread's CPU stays within the share (0.0 when it is)."""
        cpu, wall = time.thread_time(), time.monotonic()
        self._debt += (cpu - self._cpu) - (wall - self._wall) * self.share
        self._cpu, self._wall = cpu, wall
        self._debt = max(self._debt, -self.burst_seconds)
        if self._debt <= 0:
            return 0.0
        pause = self._debt / self.share
        self.paused_seconds += pause
        return pause
