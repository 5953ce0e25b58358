"""Waiting for something a test cannot be told about: one `eventually`, and a detector of a blocked event loop."""

from __future__ import annotations

import asyncio
import contextlib


class LoopStallDetector:
    """Measures the longest time the running event loop went without running a 5 ms ticker.

    A blocking call made on the loop (a control call to a head this same loop serves, say) shows up as a stall as
    long as the call's own deadline, far above anything scheduling noise causes.
    """

    def __init__(self) -> None:
        self.longest_stall = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(0.005)
            now = loop.time()
            self.longest_stall = max(self.longest_stall, now - last)
            last = now

    async def __aenter__(self) -> LoopStallDetector:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)  # the ticker runs from here on
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
