"""Background work runs and ends one way everywhere (the prober, the bridge's refresher, a registration's
refresher): a loop that outlives any bad round, and a cancel that waits for the task to end. What a process keeps
for reuse (the client's followers and channels) is closed one way too: taken out under its lock, closed outside.

A cancel can be lost: aiohttp (3.14, Python 3.11) turns a task's cancel into a TimeoutError when the request's
ClientTimeout(total=...) fires in the same loop iteration (its timer is entered twice per request and takes back
both cancels; aio-libs/aiohttp#5979 is the open issue of that family). A loop that catches the TimeoutError as a
bad round would go on forever and its stop would never return, so `cancel_and_wait` also marks the task, and
`run_every` ends at the round's end when marked: a stop takes at most the round in flight, which its own
timeouts bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

Held = TypeVar("Held")

# Tasks a stop has cancelled: a `run_every` loop among them ends at its round's end even if the cancel was lost.
_stopping: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (None: nothing to do) and wait until it has ended, so nothing it does outlives the caller."""
    if task is None:
        return
    _stopping.add(task)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class _Closable(Protocol):
    def close(self) -> Awaitable[object]: ...


async def stop_poller(task: asyncio.Task[Any] | None, session: _Closable | None) -> None:
    """End background work that reads over a session of its own (the bridge's refresher, the engines' load): the
    task first, then the session it may use (or open) until it has ended. None: nothing to end."""
    await cancel_and_wait(task)
    if session is not None:
        await session.close()


async def run_every(
    seconds: float, step: Callable[[], Awaitable[object]], what: str, logger: logging.Logger, *, now: bool
) -> None:
    """Run `step` (at once when `now`) and again `seconds` after each run began, until cancelled. A failed round is
    logged with `what` and the loop goes on: one bad round must not end a head's background work. Stopped by
    `cancel_and_wait`, it ends at the latest when the round in flight does (a cancel the round lost included)."""
    this = asyncio.current_task()
    if not now:
        await asyncio.sleep(seconds)
    while True:
        started = time.monotonic()
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%s failed", what)
        if this in _stopping:
            raise asyncio.CancelledError(f"{what}: stopped (its round ended without the cancel)")
        await asyncio.sleep(max(0.0, seconds - (time.monotonic() - started)))


def taken(registry: dict[Any, Held], lock: threading.Lock) -> list[Held]:
    """Everything `registry` held, which is left empty, under `lock`: the caller closes it outside the lock (a
    follower's stop joins its thread), and the next lookup makes a new one."""
    with lock:
        held = list(registry.values())
        registry.clear()
    return held
