"""Draining on SIGTERM: a registered server told to stop first gets no new work, finishes what it has, then leaves.

On SIGTERM the registration helpers (register_aiohttp_app, with_registration) register again as draining (the
head's watch tells every client within about a second, and they send new work to other instances), wait until the
calls in flight are done (at least DRAIN_SETTLE_SECONDS, so the flag reaches clients first; at most the drain
grace), deregister, and only then let the server stop the way SIGTERM stops it: aiohttp's graceful exit, or the
SIGTERM handler that was there before (uvicorn's). A second SIGTERM cuts the wait short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator
from types import FrameType
from typing import Any

from aiohttp import web

logger = logging.getLogger("gym_rpc.integrations._registration")

DEFAULT_DRAIN_GRACE_SECONDS = 20.0  # under the 30 s Kubernetes leaves between SIGTERM and SIGKILL
DRAIN_SETTLE_SECONDS = 1.0  # how long the draining flag may take to reach the clients, through the head's watch
DRAIN_POLL_SECONDS = 0.05

Handler = Callable[[int, FrameType | None], Any] | int | None


class InFlight:
    """The calls a server process has in flight, counted by the aiohttp middleware or the ASGI wrapper."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> int:
        return self.count

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1


def counting_middleware(in_flight: InFlight) -> Any:
    """An aiohttp middleware that counts the requests in flight (every one, whatever the handler does)."""

    @web.middleware
    async def count_in_flight(request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        with in_flight.call():
            return await handler(request)

    return count_in_flight


async def wait_until_drained(in_flight: Callable[[], int], grace_seconds: float, hurry: asyncio.Event) -> int:
    """Wait until no call is in flight, but at least DRAIN_SETTLE_SECONDS and at most `grace_seconds` (less when
    `hurry` is set); the calls still in flight then."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    settled = started + min(DRAIN_SETTLE_SECONDS, grace_seconds)
    while not hurry.is_set():
        now = loop.time()
        if now >= started + grace_seconds or (now >= settled and in_flight() == 0):
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(hurry.wait(), DRAIN_POLL_SECONDS)
    return in_flight()


class SigtermDrain:
    """While installed, SIGTERM runs `drain` (given an event set by a second SIGTERM), then `stop`.

    Installed only where a signal can be handled (the main thread of a loop that supports it) and SIGTERM is not
    ignored; `previous` is the handler it replaced, for `stop` to hand the signal on to."""

    def __init__(
        self, drain: Callable[[asyncio.Event], Awaitable[object]], stop: Callable[[SigtermDrain], None]
    ) -> None:
        self._drain = drain
        self._stop = stop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hurry = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.previous: Handler = None

    @property
    def draining(self) -> bool:
        return self._task is not None

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(signal.SIGTERM)
        if previous == signal.SIG_IGN:
            return False
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        except (NotImplementedError, RuntimeError, ValueError):  # no signals here (Windows, a nested loop)
            return False
        self._loop, self.previous = loop, previous
        return True

    def uninstall(self) -> None:
        """Give SIGTERM back to the handler it had (unless a drain is under way: it ends with `stop`)."""
        if self._loop is not None and self._task is None:
            self.hand_back()

    def hand_back(self) -> None:
        if self._loop is None:
            return
        self._loop.remove_signal_handler(signal.SIGTERM)
        self._loop = None
        if callable(self.previous) or self.previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self.previous)

    def _on_sigterm(self) -> None:
        if self._task is not None:
            self._hurry.set()  # a second SIGTERM: stop waiting for the calls in flight
            return
        assert self._loop is not None
        self._task = self._loop.create_task(self._drain_then_stop(), name="gym_rpc drain on SIGTERM")

    async def _drain_then_stop(self) -> None:
        try:
            await self._drain(self._hurry)
        except Exception:  # the server must stop all the same
            logger.exception("draining on SIGTERM failed; stopping anyway")
        finally:
            self._stop(self)


def stop_aiohttp(drain: SigtermDrain) -> None:
    """Stop an aiohttp server as its own SIGTERM handler does: a GracefulExit out of the loop (web.run_app then
    closes the sites, finishes what is left within its shutdown_timeout and runs the cleanup)."""

    def graceful_exit() -> None:
        raise web.GracefulExit()

    drain.hand_back()
    asyncio.get_running_loop().call_soon(graceful_exit)


def hand_on_sigterm(drain: SigtermDrain) -> None:
    """Give SIGTERM back to the handler it had before (uvicorn's, say, or the default) and raise it again."""
    drain.hand_back()
    signal.raise_signal(signal.SIGTERM)
