"""Waiting for something a test cannot be told about: one `eventually` (awaited, or blocking in synchronous
tests), and a detector of a blocked event loop.

A test that can be told (an event, a line a process prints, a watch event) waits for that instead. Otherwise it
polls with `eventually`: the probe runs at once and then every `every` seconds until `accept` takes its result, and
after `within` seconds the test fails naming `what` it waited for and the last result seen, never hanging. Each
deadline is the caller's, generous for a loaded machine: a deadline bounds a wait, it does not measure one.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")


class _Polls:
    """One wait: its deadline, the last result seen, and the failure that names them."""

    def __init__(self, within: float, what: str, ignoring: tuple[type[BaseException], ...]) -> None:
        self.within = within
        self.what = what
        self.ignoring = ignoring
        self.deadline = time.monotonic() + within
        self.last: Any = "nothing (no probe finished)"

    def over(self) -> bool:
        return time.monotonic() >= self.deadline

    def fail(self) -> AssertionError:
        return AssertionError(f"not within {self.within} s: {self.what}; last seen: {self.last!r}")


@overload
async def eventually(
    probe: Callable[[], Awaitable[T]],
    accept: Callable[[T], object] = ...,
    *,
    within: float,
    what: str = ...,
    every: float = ...,
    ignoring: tuple[type[BaseException], ...] = ...,
) -> T: ...


@overload
async def eventually(
    probe: Callable[[], T],
    accept: Callable[[T], object] = ...,
    *,
    within: float,
    what: str = ...,
    every: float = ...,
    ignoring: tuple[type[BaseException], ...] = ...,
) -> T: ...


async def eventually(
    probe: Callable[[], Any],
    accept: Callable[[Any], object] = bool,
    *,
    within: float,
    what: str = "the condition",
    every: float = 0.05,
    ignoring: tuple[type[BaseException], ...] = (),
) -> Any:
    """Call `probe` (a function or a coroutine function) until `accept` takes its result (truthy by default), and
    return that result; errors of the types `ignoring` count as "not yet". Fails the test after `within` s."""
    polls = _Polls(within, what, ignoring)
    while True:
        try:
            result = probe()
            if inspect.isawaitable(result):
                result = await result
            if accept(result):
                return result
            polls.last = result
        except ignoring as error:
            polls.last = error
        if polls.over():
            raise polls.fail()
        await asyncio.sleep(every)


def eventually_blocking(
    probe: Callable[[], T],
    accept: Callable[[T], object] = bool,
    *,
    within: float,
    what: str = "the condition",
    every: float = 0.05,
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """`eventually` for a synchronous test (a CLI subprocess, a blocking client): the same loop, sleeping."""
    polls = _Polls(within, what, ignoring)
    while True:
        try:
            result = probe()
            if accept(result):
                return result
            polls.last = result
        except ignoring as error:
            polls.last = error
        if polls.over():
            raise polls.fail()
        time.sleep(every)


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
