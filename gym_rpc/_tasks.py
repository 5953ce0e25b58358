"""Background work runs and ends one way everywhere (the prober, the bridge's refresher, a registration's
refresher): a loop that outlives any bad round, and a cancel that waits for the task to end. What a process keeps
for reuse (the client's followers and channels) is closed one way too: taken out under its lock, closed outside."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

Held = TypeVar("Held")


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (None: nothing to do) and wait until it has ended, so nothing it does outlives the caller."""
    if task is None:
        return
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
    logged with `what` and the loop goes on: one bad round must not end a head's background work."""
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
        await asyncio.sleep(max(0.0, seconds - (time.monotonic() - started)))


def taken(registry: dict[Any, Held], lock: threading.Lock) -> list[Held]:
    """Everything `registry` held, which is left empty, under `lock`: the caller closes it outside the lock (a
    follower's stop joins its thread), and the next lookup makes a new one."""
    with lock:
        held = list(registry.values())
        registry.clear()
    return held
