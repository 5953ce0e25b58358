"""The resend budget, per server name: each server's resends waiting out their backoff at once are at most a share
of the process's first attempts in flight (Envoy's retry budget), with a floor.

A call that must resend takes a slot of its server's for its backoff pause and frees it as its resend goes out.
When every slot of its server's is held, it waits for one (first come, first served among that server's calls): on
the budget, not on the server. Each server name has slots and a queue of its own, so one server's outage (thousands
of calls queued for its slots) never delays another server's resends; a resend without a pause (a failover to an
instance the call has not tried) takes no slot at all (gym_rpc.client.resend._resend). The slots are a share of the
first attempts in flight: resends, pausing, waiting or out at the server, never widen the budget. So when thousands
of calls find one server dead, the server sees a few resends at a time (the floor's worth: no first attempt is in
flight), not one stream per call, however long each resend takes to fail on a loaded machine; when it answers
again, calls end, new ones start, and the slots grow with their first attempts. A call whose own budget (its kind's
time, its deadline) runs out while it waits fails at once, saying so.

`ConcurrencyCap` is the same queue for another bound: a server entry's `max_concurrent_requests`, the calls of a
client in flight to it at once (NeMo Gym #1208, for rate-limited judges); the calls beyond it wait in order, each
within its deadline.

Threads: clients on several event loops share a process and this one budget. Calls in flight are counted per
event loop without a lock (a loop's calls start and end on its thread; a lock would cost the happy path), summed
only when a resend asks for a slot; the first attempts in flight are those calls less the ones pausing (holding a
slot), waiting for one, or resending. Slots and waiters are under a lock; a waiter on another loop is woken
through its loop's `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gym_rpc.client.resend._policy import ClientBudget


class CallCount:
    """One event loop's calls in flight (`ServerClient.request` counts them): changed only by its loop's thread,
    read by any (an int read is atomic)."""

    __slots__ = ("__weakref__", "value")

    def __init__(self) -> None:
        self.value = 0


_counts: weakref.WeakSet[CallCount] = weakref.WeakSet()  # a loop's count goes with its sessions
_counts_lock = threading.Lock()


def new_call_count() -> CallCount:
    count = CallCount()
    with _counts_lock:
        _counts.add(count)
    return count


def calls_in_flight() -> int:
    with _counts_lock:
        return sum(count.value for count in _counts)


@dataclass(eq=False)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    budget: ClientBudget | None  # None: a waiter for a ConcurrencyCap's place
    granted: bool = False  # a slot was taken for it (under the lock)
    abandoned: bool = False  # it stopped waiting (under the lock)


@dataclass(eq=False)
class _Pool:
    """One server name's slots held and its calls waiting for one, in order."""

    held: int = 0
    waiting: int = 0
    waiters: deque[_Waiter] = field(default_factory=deque)


@dataclass(eq=False)
class ResendBudget:
    """Slots for resends pausing before they go out, per server name, shared by every loop and client of the
    process. `held`, `waiting` and `resending` are the process's totals over every server."""

    held: int = 0
    waiting: int = 0  # the waiters that have neither been granted a slot nor given up
    resending: int = 0  # resends out at their server (each freed its slot as it went out)
    _pools: dict[str, _Pool] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self, server_name: str = "") -> tuple[int, int, int]:
        """(the server's slots held, first attempts in flight, the server's calls waiting): for the error of a
        call that waited in vain."""
        with self._lock:
            pool = self._pools.get(server_name) or _Pool()
            return pool.held, self._attempts_in_flight(), pool.waiting

    def _attempts_in_flight(self) -> int:
        """The process's calls in flight less those pausing, waiting or resending: the first attempts out at a
        server. (Granting a slot moves a call from waiting to pausing, and a resend going out from pausing to
        resending: neither changes this.)"""
        return max(calls_in_flight() - self.held - self.waiting - self.resending, 0)

    async def acquire(self, server_name: str, budget: ClientBudget, wait_seconds: float) -> bool:
        """Take a slot of `server_name`'s, waiting at most `wait_seconds` for one (first come, first served among
        that server's calls); False if none came."""
        with self._lock:
            pool = self._pools.get(server_name)
            if pool is None:
                pool = self._pools[server_name] = _Pool()
            if _nobody_waits(pool.waiters) and pool.held < budget.slots(self._attempts_in_flight()):
                pool.held += 1
                self.held += 1
                return True
            waiter = _queued(pool.waiters, budget)
            pool.waiting += 1
            self.waiting += 1

        def withdraw() -> None:
            pool.waiting -= 1
            self.waiting -= 1
            self._forget_if_idle(server_name, pool)

        return await _granted(waiter, wait_seconds, self._lock, withdraw, lambda: self.release(server_name))

    def release(self, server_name: str = "") -> None:
        """Free a slot of `server_name`'s, and hand as many as the budget now allows to its waiters, in order."""
        with self._lock:
            pool = self._pools[server_name]
            pool.held -= 1
            self.held -= 1
            in_flight = self._attempts_in_flight()
            waiters = pool.waiters
            while waiters:
                waiter = waiters[0]
                if waiter.abandoned:
                    waiters.popleft()
                    continue
                if waiter.budget is None or pool.held >= waiter.budget.slots(in_flight):
                    break
                waiters.popleft()
                pool.waiting -= 1
                self.waiting -= 1
                if _handed_over(waiter):
                    pool.held += 1
                    self.held += 1
            self._forget_if_idle(server_name, pool)

    def _forget_if_idle(self, server_name: str, pool: _Pool) -> None:
        """Drop a pool nobody holds or waits in (under the lock): the pools stay as many as the servers failing
        now, whatever names a process has called."""
        if not pool.held and not pool.waiting and self._pools.get(server_name) is pool:
            pool.waiters.clear()  # only abandoned waiters are left in it
            del self._pools[server_name]

    def resend_started(self) -> None:
        """A resend goes out (its slot freed): until `resend_ended`, it is no first attempt."""
        with self._lock:
            self.resending += 1

    def resend_ended(self) -> None:
        with self._lock:
            self.resending -= 1


@dataclass(eq=False)
class ConcurrencyCap:
    """A server's `max_concurrent_requests` for one client: at most `limit` of its calls in flight there at once
    (from the instance's pick to the answer's headers, resends included); the rest wait, first come first served,
    each at most until its deadline. Shared by the client's event loops (threads), like the resend budget."""

    limit: int
    in_flight: int = 0
    waiting: int = 0
    queued: int = 0  # calls that found every place taken and waited, for the log and the tests
    _waiters: deque[_Waiter] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    async def acquire(self, wait_seconds: float | None) -> bool:
        """Take a place, waiting at most `wait_seconds` (None: as long as it takes) for one; False if none came."""
        with self._lock:
            if _nobody_waits(self._waiters) and self.in_flight < self.limit:
                self.in_flight += 1
                return True
            waiter = _queued(self._waiters, None)
            self.waiting += 1
            self.queued += 1
        return await _granted(waiter, wait_seconds, self._lock, self._withdraw, self.release)

    def _withdraw(self) -> None:
        self.waiting -= 1

    def release(self) -> None:
        """Free a place, and hand it to the first waiter still waiting."""
        with self._lock:
            self.in_flight -= 1
            waiters = self._waiters
            while waiters and self.in_flight < self.limit:
                waiter = waiters.popleft()
                if waiter.abandoned:
                    continue
                self.waiting -= 1
                if _handed_over(waiter):
                    self.in_flight += 1


def _nobody_waits(waiters: deque[_Waiter]) -> bool:
    """Whether a newcomer may take a free slot or place, first come first served: no waiter is left in `waiters`
    (under the lock; the abandoned ones at its head are dropped)."""
    while waiters and waiters[0].abandoned:
        waiters.popleft()
    return not waiters


def _queued(waiters: deque[_Waiter], budget: ClientBudget | None) -> _Waiter:
    """A new waiter at the end of `waiters` (under the lock), to be woken in its own event loop."""
    loop = asyncio.get_running_loop()
    waiter = _Waiter(loop, loop.create_future(), budget)
    waiters.append(waiter)
    return waiter


async def _granted(
    waiter: _Waiter,
    wait_seconds: float | None,
    lock: threading.Lock,
    withdraw: Callable[[], None],
    give_back: Callable[[], None],
) -> bool:
    """Wait at most `wait_seconds` (None: as long as it takes) for `waiter`'s slot or place; False if none came.
    Timed out or cancelled, it gives up under `lock`: `withdraw` undoes its count as a waiter, or, when one was
    granted meanwhile, `give_back` (outside the lock) hands that one to the next waiter."""
    got_it = False
    try:
        if wait_seconds is None:
            await waiter.future
        else:
            async with asyncio.timeout(max(wait_seconds, 0.0)):
                await waiter.future
        got_it = True
    except TimeoutError:
        return False
    finally:
        if not got_it:
            with lock:
                waiter.abandoned = True
                granted = waiter.granted
                if not granted:
                    withdraw()
            if granted:
                give_back()
    return True


def _handed_over(waiter: _Waiter) -> bool:
    """Wake `waiter` with the slot or place it waited for (under the lock, taken off its queue); False when its
    loop is closed: nobody is waiting there any more."""
    try:
        waiter.loop.call_soon_threadsafe(_wake, waiter.future)
    except RuntimeError:
        waiter.abandoned = True
        return False
    waiter.granted = True
    return True


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


RESEND_BUDGET = ResendBudget()
