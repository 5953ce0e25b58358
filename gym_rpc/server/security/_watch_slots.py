"""How many long-lived streams (status watches, health watches) the head holds open, and for whom, and what it does
with one whose reader stopped reading.

* `WatchSlots` counts open streams per client address and in total, so one client cannot take every slot and lock
  the others out. Every loopback address (127.0.0.0/8, ::1) is one client: a local process could otherwise bind
  127.0.0.2, 127.0.0.3, ... and take a full share from each.
* `write_all_or_drop` bounds each write of a gRPC stream: a reader that gives no window back (HTTP/2 window 0, or a
  full one) holds up only its own stream, and only for `stall_seconds`; then its stream ends. A writer waiting on
  such a reader never holds anything another part of the head needs.
* A dropped or vanished reader is logged at most once per interval (RateLimitedLog), never with a traceback: the
  reader's network is not the head's fault, and a flood of them must not flood the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any
from urllib.parse import unquote

import grpc

from gym_rpc._logging import RateLimitedLog
from gym_rpc.server.security._host_check import ip_literal

logger = logging.getLogger("gym_rpc.server._watch_slots")  # its name from before the move

DEFAULT_STALL_SECONDS = 10.0  # a stream write blocked this long drops the stream (HeadOptions.watch_stall_seconds)
LOOPBACK_PEER = "loopback"


def peer_address(peer: str) -> str:
    """The client address of a gRPC peer string without its port: `ipv4:10.0.0.7:53211` -> `10.0.0.7`,
    `ipv6:[::1]:53211` (which grpc may write `ipv6:%5B::1%5D:53211`) -> `::1`; anything else (a unix socket) as
    it is."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        return unquote(rest.rpartition(":")[0]).strip("[]") or rest
    return peer


def client_key(address: str) -> str:
    """Whose share a stream counts against: its address, or LOOPBACK_PEER for any loopback address."""
    parsed = ip_literal(address)
    if parsed is None:
        return address
    return LOOPBACK_PEER if parsed.is_loopback else str(parsed)


class WatchSlots:
    """Open streams of one kind (`what`: "status watches", "health watches"), at most `max_total` and at most
    `max_per_peer` per client; a refusal suggests `instead` ("poll ListServerStatuses")."""

    def __init__(self, what: str, max_total: int, max_per_peer: int, *, instead: str) -> None:
        self.what = what
        self.instead = instead
        self.max_total = max_total
        self.max_per_peer = max_per_peer
        self.open = 0
        self._by_client: dict[str, int] = {}

    def refusal(self, address: str) -> str | None:
        """Why a stream from `address` may not open now (RESOURCE_EXHAUSTED's message); None when it may."""
        if self.open >= self.max_total:
            return f"the head already serves {self.max_total} {self.what}; retry later or {self.instead}"
        key = client_key(address)
        held = self._by_client.get(key, 0)
        if held >= self.max_per_peer:
            whose = f"{address} (every loopback address counts as one client)" if key == LOOPBACK_PEER else address
            return (
                f"{whose} already holds {held} {self.what}, the most one client address may; close one, share one "
                f"per process, or {self.instead}"
            )
        return None

    async def take_or_abort(self, context: grpc.aio.ServicerContext[Any, Any], address: str) -> str:
        """`take` for a gRPC stream from `address`; when `refusal` says it may not open, its call ends with
        RESOURCE_EXHAUSTED and that message instead. Awaited once, as the stream opens: it holds nothing after."""
        refusal = self.refusal(address)
        if refusal is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        return self.take(address)

    @contextlib.contextmanager
    def held(self, address: str) -> Iterator[None]:
        """One slot for `address` while the block runs (check `refusal` first)."""
        key = self.take(address)
        try:
            yield
        finally:
            self.release(key)

    def take(self, address: str) -> str:
        """One slot for `address` (check `refusal` first) until `release` of what this returns: for a stream that
        holds no context manager of its own (a try/finally costs it nothing per stream)."""
        key = client_key(address)
        self.open += 1
        self._by_client[key] = self._by_client.get(key, 0) + 1
        return key

    def release(self, key: str) -> None:
        self.open -= 1
        left = self._by_client[key] - 1
        if left:
            self._by_client[key] = left
        else:
            del self._by_client[key]


_dropped = RateLimitedLog(logger)
_gone = RateLimitedLog(logger)
# How long the head waits to hand a dropped stream its final status (its reader may never take it).
END_STATUS_SECONDS = 1.0
STALLED_DETAILS = "dropped: this stream's reader took no message for {seconds:g} s; reconnect and resume"


async def write_all_or_drop(
    context: grpc.aio.ServicerContext[Any, Any], messages: AsyncIterator[Any], stall_seconds: float, peer: str
) -> None:
    """Write every message of `messages` to a gRPC stream, each write bounded by `stall_seconds`.

    A reader that takes nothing for that long (HTTP/2 window 0, or full) has its stream ended with UNAVAILABLE
    (its client reconnects and resumes), and one that went away mid-write ends it as well: either is logged at
    most once an interval, without a traceback. The initial metadata goes first and on its own: headers are not
    flow-controlled, so the only write a stalled reader can hold up is a message, which a final status may
    follow. `peer`: the caller's peer string, for the log (`PeerMap.caller`)."""
    await context.send_initial_metadata(())
    async with contextlib.aclosing(messages) as stream:  # type: ignore[type-var]
        async for message in stream:
            try:
                await asyncio.wait_for(context.write(message), stall_seconds)
            except TimeoutError:
                _dropped.log(
                    f"dropped a stream to {peer_address(peer)}: its reader took nothing for {stall_seconds:g} s"
                )
                await _end(context, STALLED_DETAILS.format(seconds=stall_seconds))
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the call ended under the write: the client cancelled or disconnected
                _gone.log(f"a stream's reader went away during a write ({type(exc).__name__})")
                return


class BoundedWrites:
    """`write_all_or_drop`'s rule for many streams at the cost of none: each write bounded by `stall_seconds`,
    checked by one sweep of every write in progress (a few times per `stall_seconds`, and only while one is)
    instead of a timeout per write, which in asyncio is a task of its own. A write that stalls cancels its
    stream's task, which ends the stream with UNAVAILABLE, as write_all_or_drop does."""

    SWEEPS_PER_STALL = 4  # a stalled stream is dropped between stall_seconds and 1.25 times that

    def __init__(self, stall_seconds: float) -> None:
        self.stall_seconds = stall_seconds
        self._writing: dict[asyncio.Task[Any], float] = {}  # stream task -> loop.time() its write began
        self._stalled: set[asyncio.Task[Any]] = set()
        self._sweep: asyncio.TimerHandle | None = None

    async def write_all(
        self, context: grpc.aio.ServicerContext[Any, Any], next_message: Callable[[], Awaitable[Any]], peer: str
    ) -> None:
        """Write `await next_message()` after `await next_message()` to the stream until its reader goes away or
        stalls (the initial metadata first, on its own, as write_all_or_drop does). `peer`: the caller's peer
        string, for the log (`PeerMap.caller`)."""
        await context.send_initial_metadata(())
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        writing = self._writing
        try:
            while True:
                message = await next_message()
                writing[task] = loop.time()
                if self._sweep is None:
                    self._sweep = loop.call_later(self.stall_seconds / self.SWEEPS_PER_STALL, self._swept)
                try:
                    await context.write(message)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the call ended under the write: the client cancelled or disconnected
                    _gone.log(f"a stream's reader went away during a write ({type(exc).__name__})")
                    return
                finally:
                    writing.pop(task, None)
        except asyncio.CancelledError:
            if task not in self._stalled:
                raise
            self._stalled.discard(task)
            task.uncancel()  # this cancellation was the sweep's: the stream ends with its status instead
            _dropped.log(
                f"dropped a stream to {peer_address(peer)}: its reader took nothing for {self.stall_seconds:g} s"
            )
            await _end(context, STALLED_DETAILS.format(seconds=self.stall_seconds))

    def _swept(self) -> None:
        """Cancel the streams whose write began `stall_seconds` ago or more; look again while any write is on."""
        self._sweep = None
        if not self._writing:
            return
        loop = asyncio.get_running_loop()
        since = loop.time() - self.stall_seconds
        for task in [task for task, began in self._writing.items() if began <= since]:
            del self._writing[task]
            self._stalled.add(task)
            task.cancel()
        if self._writing:
            self._sweep = loop.call_later(self.stall_seconds / self.SWEEPS_PER_STALL, self._swept)


async def _end(context: grpc.aio.ServicerContext[Any, Any], details: str) -> None:
    """End the stream with UNAVAILABLE; when its reader will not even take that, leave the status queued behind
    the stuck message (grpc ends the call with its connection) and return."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(context.abort(grpc.StatusCode.UNAVAILABLE, details), END_STATUS_SECONDS)
