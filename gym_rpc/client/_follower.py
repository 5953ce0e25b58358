"""Each server's instances, followed from the head's status watch in the background and pushed to every client's
routes: the xDS idea (endpoints pushed, never looked up per call).

One follower per head per process: a daemon thread with an event loop of its own runs a `StatusWatch` (which
reconnects and resumes from its last revision by itself) and hands every snapshot and change to the routes of the
clients that subscribed (a head that turns out to be NeMo Gym's HTTP head has no watch: nothing to follow). Of
several heads (`a:11000,b:11000`) it follows the one the process follows, and takes the next one's snapshot when
that one goes away.
Workers' event loops never run any of it, and a call never waits on the head. It takes at most a tenth of a core
over time (`CpuBudget`, below): a head pushing a flood pauses it, and after a long pause it resumes from
its revision, so it gets the latest state merged instead of every message that queued. The
follower stops when its last client is gone (it looks at each event and each reconnect, and the watch asks for a
heartbeat, so it looks at least that often), at `close_instance_followers()`, and at interpreter exit.
A snapshot after the first (a head restarted, or another head of the list) that leaves out instances the follower
knew does not drop them at once: they are kept for a grace while the fresh head relearns them
(gym_rpc.client._relearn_grace), so their rollouts stay where they are.

With a node's watch relay (GYM_RPC_WATCH_RELAY=unix:PATH or 127.0.0.1:PORT; `gym-rpc relay`) the follower follows
the head's watch through it: the head then holds one stream per node, not per process. Nothing else goes there
(config, registrations and every unary call still go to the head). A relay that cannot be reached, or that has
not reached the head yet, is logged once, and the follower follows the head directly meanwhile, trying the relay
again every RELAY_RETRY_SECONDS.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

import grpc

from gym_rpc._environment import environment
from gym_rpc._tasks import taken
from gym_rpc.client._relearn_grace import RelearnGrace
from gym_rpc.client.control import (
    ClientSecurity,
    ControlClient,
    StatusWatch,
    close_aio_channels,
    head_for,
)
from gym_rpc.config import checked_watch_relay
from gym_rpc.errors import ConfigError, ControlPlaneError
from gym_rpc.wire import WATCH_RELAY_ENV_VAR

if TYPE_CHECKING:
    from gym_rpc.client.replicas import Routing
    from gym_rpc.wire import StatusReport, WatchEvent

logger = logging.getLogger("gym_rpc.client.replicas")

# The head sends a heartbeat this often on a quiet watch, so the follower notices within that long that its last
# client is gone.
HEARTBEAT_SECONDS = 5.0
_STOP_JOIN_SECONDS = 2.0
# A follower over its CPU share pauses (`CpuBudget`), at most this long at a time; after a pause
# this long it resumes the watch from its revision instead of reading what queued meanwhile (the head merges it).
MAX_PAUSE_SECONDS = 5.0
RESUME_AFTER_PAUSE_SECONDS = 1.0
# Following the head directly because the node's watch relay could not be reached: the relay is tried again this
# often (a relay restarted takes its node's processes back within this long).
RELAY_RETRY_SECONDS = 30.0
# How a watch of the head followed meanwhile ends when RELAY_RETRY_SECONDS are over: connected (its deadline) or
# still waiting for the head (the last error of its retries).
_FALLBACK_OVER = frozenset(
    {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
)


# A background thread's share of the CPU: how long it must pause so its work costs the process at most `share` of
# one core over time. The follower runs in the worker's own process: every message it converts and applies holds
# the interpreter the worker's event loop needs. A head pushing a flood (a refit relabelling every instance, a
# misbehaving or hostile head) would otherwise take the worker's data plane with it. A token bucket over the
# thread's own CPU time (`time.thread_time`): work beyond the share is paid back by pausing, and a short burst (the
# first snapshot, an occasional big change) is not delayed at all.
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


class _NoClientsLeft(Exception):
    """Raised inside the watch's retry callback to end a follower nobody listens to."""


class InstanceFollower:
    """Follows one head's watch for the routes of every client of that head in this process."""

    def __init__(self, address: str, security: ClientSecurity, relay: str | None = None) -> None:
        self.address = address
        self._security = security
        self._subscribers: weakref.WeakSet[Routing] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._reports: dict[str, StatusReport] = {}
        self.first_snapshot: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.revision = 0
        # The head the last event came from (of several heads, the one followed): `revision` counts there.
        self.source: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._outage_logged = False
        self._grace = RelearnGrace()
        self._expiry: asyncio.TimerHandle | None = None  # pushes the view without the kept instances run out
        self._thread = threading.Thread(target=self._run, name=f"gym-rpc instances of {address}", daemon=True)
        self.relay = relay  # the node's watch relay (None: the head's watch directly)
        self.via_relay = False  # whether the watch followed now is the relay's
        self._relay_down_logged = False

    @property
    def running(self) -> bool:
        """Started and not stopped (a follower is started by its first subscriber)."""
        return self._thread.is_alive() or self._thread.ident is None

    def subscribe(self, routing: Routing) -> None:
        """Push every report the follower has to `routing` now, and every later change as it comes."""
        with self._lock:
            self._subscribers.add(routing)
            reports = list(self._reports.values())
            if self._thread.ident is None:
                self._thread.start()
        routing.apply_reports(reports)

    def reports(self) -> dict[str, StatusReport]:
        """Each server's report as the follower knows it now (what its clients' routes were given)."""
        with self._lock:
            return dict(self._reports)

    def unsubscribe(self, routing: Routing) -> None:
        with self._lock:
            self._subscribers.discard(routing)

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            client = ControlClient(self.address, security=self._security)
            if not head_for(client.following(), self._security).pushes_instances:
                logger.info("the head at %s is NeMo Gym's HTTP head: it has no instances to follow", self.address)
                return
            self._task = loop.create_task(self._follow(client))
            loop.run_until_complete(self._task)
        except (asyncio.CancelledError, _NoClientsLeft):
            pass
        except ControlPlaneError as error:  # not worth retrying (a wrong token, a head that is no gym_rpc head)
            logger.warning("stopped following the instances of the head at %s: %s", self.address, error)
        finally:
            with contextlib.suppress(Exception):
                loop.run_until_complete(close_aio_channels())
            loop.close()
            if not self.first_snapshot.done():
                self.first_snapshot.set_result(None)

    async def _follow(self, client: ControlClient) -> None:
        budget = CpuBudget()  # made here: it reads this thread's CPU time
        relay = None
        if self.relay is not None:  # plaintext on the node, the node's token (the relay asks it of its callers)
            relay = ControlClient(self.relay, security=ClientSecurity(token=self._security.token))
        relay_due = time.monotonic()  # when to try the relay (again)
        while True:
            via_relay = relay is not None and time.monotonic() >= relay_due
            source = relay if via_relay and relay is not None else client
            watch = StatusWatch(
                source,
                start_revision=self.revision if self.source in (None, source.following()) else 0,
                heartbeat_seconds=HEARTBEAT_SECONDS,
                on_retry=self._retrying,
                engine_load=True,  # the engines' load too (gym_rpc.client.replicas._engine_load_table)
                # Through a relay, its first failure says to follow the head; following the head instead, the
                # relay is tried again after a while.
                max_wait_seconds=0.0 if via_relay else None,
                until=time.monotonic() + RELAY_RETRY_SECONDS if relay is not None and not via_relay else None,
            )
            self.via_relay = via_relay
            try:
                async with contextlib.aclosing(watch.events()) as events:
                    async for event in events:
                        if not self._apply(event):
                            return
                        self.source = watch.source
                        if via_relay and self._relay_down_logged:
                            self._relay_down_logged = False
                            logger.info(
                                "following the instances of the head through the watch relay at %s again",
                                self.relay,
                            )
                        pause = budget.pause()
                        if pause > 0:
                            # Over its share of the CPU: the head pushes more than this process should spend on it.
                            await asyncio.sleep(min(pause, MAX_PAUSE_SECONDS))
                            if pause >= RESUME_AFTER_PAUSE_SECONDS:
                                break  # what queued meanwhile is stale: resume, and the head sends it merged
                    else:
                        return
            except ControlPlaneError as error:
                if relay is None or (not via_relay and error.code not in _FALLBACK_OVER):
                    raise  # the head refuses the watch (a wrong token, say): as without a relay
                if via_relay:
                    relay_due = time.monotonic() + RELAY_RETRY_SECONDS
                    self._relay_failed(error)
                elif not self._subscribers:
                    return
                # else: the head followed directly for RELAY_RETRY_SECONDS: the relay is tried again

    def _relay_failed(self, error: ControlPlaneError) -> None:
        if not self._relay_down_logged:
            self._relay_down_logged = True
            logger.warning(
                "cannot follow the instances through the watch relay at %s (%s: %s); following the head at %s "
                "directly, and trying the relay again every %g s",
                self.relay,
                error.code.name,
                error,
                self.address,
                RELAY_RETRY_SECONDS,
            )

    def _apply(self, event: WatchEvent) -> bool:
        """Fold one event into what the follower knows and push it to every subscriber; False when none is left."""
        if event.kind == "engine_load":  # the engines' load, no instance changed: to every client's routes
            subscribers = list(self._subscribers)
            for routing in subscribers:
                routing.engine_loads.apply(event.engine_loads)
            return bool(subscribers)
        now = time.monotonic()
        with self._lock:
            subscribers = list(self._subscribers)
            reports = self._expired(now)
            if event.kind == "snapshot":
                replaced = self._reports  # a view to replace: instances the snapshot leaves out are kept a while
                merged = self._grace.snapshot(replaced, event.reports, now) if replaced else event.reports
                self._reports = {}
                self._log_kept(merged, event.reports)
            else:
                merged = self._grace.merged(event.reports, now) if self._grace else event.reports
            self._reports.update((report.server_name, report) for report in merged)
            self.revision = event.revision
        if not subscribers:
            return False
        if self._outage_logged:
            self._outage_logged = False
            logger.info("following the instances of the head at %s again", self.address)
        for routing in subscribers:
            routing.apply_reports([*reports, *merged])
        if event.kind == "snapshot" and not self.first_snapshot.done():
            self.first_snapshot.set_result(None)
        self._expire_later()
        return True

    def _expired(self, now: float) -> list[StatusReport]:
        """The view without the kept instances whose grace ran out (held: self._lock)."""
        if not self._grace:
            return []
        reports = self._grace.expired(self._reports, now)
        self._reports.update((report.server_name, report) for report in reports)
        return reports

    def _expire_later(self) -> None:
        """Push the view again when the earliest kept instance's grace runs out (in the follower's loop)."""
        when = self._grace.next_expiry()
        if when is None or self._expiry is not None:
            return  # nothing kept, or a timer already due no later (graces only start later)
        self._expiry = asyncio.get_running_loop().call_later(max(0.0, when - time.monotonic()), self._expire)

    def _expire(self) -> None:
        self._expiry = None
        with self._lock:
            subscribers = list(self._subscribers)
            reports = self._expired(time.monotonic())
        if reports:
            logger.info(
                "the head at %s has not listed again, within %g s, instances it had: dropped them",
                self.address,
                self._grace.grace_seconds,
            )
        for routing in subscribers:
            routing.apply_reports(reports)
        self._expire_later()

    def _log_kept(self, merged: list[StatusReport], listed: list[StatusReport]) -> None:
        kept = sum(len(report.instances) for report in merged) - sum(len(report.instances) for report in listed)
        if kept > 0:
            logger.info(
                "the head at %s does not list %d instances it had (a fresh head, relearning its registrations): "
                "kept for up to %g s meanwhile",
                self.address,
                kept,
                self._grace.grace_seconds,
            )

    def _retrying(self, error: ControlPlaneError, pause: float) -> None:
        if not self._subscribers:
            raise _NoClientsLeft
        if not self.first_snapshot.done():
            self.first_snapshot.set_result(None)  # nobody waits for a head that is not there
        if not self._outage_logged:
            self._outage_logged = True
            logger.info(
                "cannot follow the instances of the head at %s (%s); calls go to the instances known, and the "
                "watch resumes when the head is back",
                self.address,
                error.code.name,
            )

    def stop(self) -> None:
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(task.cancel)
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(_STOP_JOIN_SECONDS)


def watch_relay_address(configured: str | None = None) -> str | None:
    """The node's watch relay: GYM_RPC_WATCH_RELAY, else `configured` (the config's `head_server.watch_relay`);
    None: neither. A malformed variable is logged and left out, never a worker's failure."""
    relay = environment().watch_relay
    if not relay:
        return configured
    try:
        return checked_watch_relay(relay, WATCH_RELAY_ENV_VAR)
    except ConfigError as error:
        logger.warning("%s; it is ignored", error)
        return configured


_followers: dict[tuple[int, str, ClientSecurity, str | None], InstanceFollower] = {}
_followers_lock = threading.Lock()


def follower_for(address: str, security: ClientSecurity, watch_relay: str | None = None) -> InstanceFollower:
    """This process's follower of the head at `address` (started on first use, again if it stopped), through the
    node's watch relay when GYM_RPC_WATCH_RELAY or `watch_relay` (`head_server.watch_relay`) names one."""
    relay = watch_relay_address(watch_relay)
    key = (os.getpid(), address, security, relay)  # a forked child never shares its parent's thread
    with _followers_lock:
        follower = _followers.get(key)
        if follower is None or not follower.running:
            follower = _followers[key] = InstanceFollower(address, security, relay)
        return follower


def close_instance_followers() -> None:
    """Stop every follower of this process (tests; interpreter exit); clients start new ones at their next call."""
    for follower in taken(_followers, _followers_lock):
        follower.stop()


atexit.register(close_instance_followers)
