"""One replicated server's route (`ServerRoute`): which of its instances each call goes to, and where it goes next
when that one fails.

* A call of a rollout sticks to the rollout's instance: the first call pins it by rendezvous hashing over the
  instances that take new work, and later calls go where the pin says while that instance is alive (not down by
  the head's probe, not ejected, still listed), even if it drains or stops matching the worker's labels since: a
  rollout in flight finishes where it started. When its instance is gone the rollout is pinned again (counted, and
  logged once per instance it left).
* A rollout may be known by several keys: its rollout id, and the NeMo Gym session its cookies carry (a tool call
  made where no rollout is bound carries only the cookie). Every key of one rollout shares one `Pin`: a call
  carrying two keys makes them one (the session's instance wins: it holds the session's state), an answer that
  opens a session pins it with the call's rollout, and moving the pin moves every key with it.
* A call of no rollout goes to the less loaded of two random instances that take new work.
* A model server's route (`responses_api_models`, `affine`) picks by prompt instead (`pick_affine`): a call goes
  where its rollout's (or model session's) last turn went while that instance is not overloaded, else where its
  prompt's group went (`Group`: a GRPO group's rollouts share the prompt's prefix, so they stay together), else to
  the least loaded of its prompt's eight preferred instances (the prompt's slot's rendezvous order: the same in
  every worker) while under a bound, else by two random choices. Load is the calls in flight from this process
  plus the other workers' calls the engine reports (`engine_load`: its waiting and running less this process's
  own calls there lately, 0 while unknown), less the calls of the call's own group there: a group's own burst
  never splits it. An instance whose answers take SLOW_RATIO times the median instance's (`slow`) takes no new
  group and keeps no rollout while another can take them. See docs/replicas.md (prefix-affine picking) for why.
* A failed attempt counts against its instance (gym_rpc.client.replicas._outliers): refused, timed out, dropped, a
  5xx, or a body that broke off once the caller read it; a refused connection, or any resent call of no rollout,
  moves to another instance not tried yet by that call (its `reroute`: gym_rpc.client.replicas._call_in_flight).

Which names have a route, and how the follower keeps them current: gym_rpc.client.replicas._routing.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from gym_rpc.client.nemo_gym import session_key_from_cookies
from gym_rpc.client.replicas._engine_load_table import EngineLoadTable
from gym_rpc.client.replicas._instance_state import (
    Instance,
    InstanceView,
    distinct,
    matches,
    selector_text,
)
from gym_rpc.client.replicas._outliers import (
    OutlierDetection,
    ejection_over,
    end_ejection,
    record_failure,
    succeeded,
)
from gym_rpc.client.replicas._picker import SLOTS, heaviest, slot_of, top_choices, two_choices
from gym_rpc.client.resend import Backpressure, ConcurrencyCap
from gym_rpc.errors import NoHealthyInstanceError, ServerUnreachableError

logger = logging.getLogger("gym_rpc.client.replicas")

# Rollouts pinned per server, oldest forgotten first: a forgotten rollout is pinned again by the same rendezvous,
# so the bound only matters for rollouts whose instance set changed while they ran.
MAX_PINS = 65536
# Instances no longer listed, remembered per server (oldest forgotten first) so that one listed again is the same
# instance: a lease that lapsed and was renewed, or a deregistration and a registration at the same address.
MAX_GONE = 1024
# Keys of NeMo Gym sessions among the pins: never a rollout id (a rollout id cannot hold a NUL).
_SESSION_PREFIX = "\0"
_monotonic = time.monotonic
_NEVER = math.inf  # refresh_at while no instance is ejected: picks then never read the clock
_MAX_JOINS = 64
# Prefix-affine picking (model servers). With `avg` = (the route's load + 1) / its candidates: a call follows its
# rollout's last instance (or its group's) while that one's load < STICK_RATIO * avg + STICK_SLACK, and a new
# group takes the least loaded of its prompt's PREFERRED instances if that load < FRESH_RATIO * avg + FRESH_SLACK.
# Staying costs a queue; moving costs the prefill of everything the engine held for it: the bound to stay is the
# looser.
PREFERRED = 8
ENGINE_LOAD_READ_SECONDS = 0.1  # the head pushes at most 4 tables a second; a pick reads them at most 10 times
FRESH_RATIO, FRESH_SLACK = 1.5, 1.0
STICK_RATIO, STICK_SLACK = 2.0, 2.0
# Groups (prompt numbers) remembered per route, oldest forgotten first: a forgotten group is placed afresh.
MAX_GROUPS = 16384
# An instance is slow while its answers' latency (an EWMA, weight LATENCY_WEIGHT per answer) is over SLOW_RATIO
# times the median over the instances that answered lately, and over it by SLOW_MARGIN_SECONDS at least (a few
# milliseconds' jitter is no slowness): a slow engine (or one with a long queue) gets no new group. The bound is
# made at each read of the loads; an answer over it makes its instance slow at once. A verdict stands until an
# answer from the instance comes after it: the others answering slower (under more load than the slow one had)
# does not clear it. A figure with no answer for SLOW_FORGET_SECONDS is forgotten, so a slow instance is tried
# again.
SLOW_RATIO = 2.5
SLOW_MARGIN_SECONDS = 0.1
LATENCY_WEIGHT = 0.25
SLOW_FORGET_SECONDS = 30.0
# How far back this process's own calls at an instance are taken off its engine's figure: the head reads each
# engine every 0.5 s and pushes at most every 0.25 s, so a figure is up to about a second old when read here.
OWN_PEAK_SECONDS = 1.0
# A worker's next group goes where its last one ended (no call of its own left there) within this long: a GRPO
# dispatcher starts the next group as the last ends, within milliseconds.
HOME_SECONDS = 0.25

Selector = Mapping[str, str]


def is_refused(error: BaseException) -> bool:
    """A connection refused: nothing listens at the instance's address (it is gone, not slow)."""
    return isinstance(error, aiohttp.ClientConnectorError) and isinstance(error.os_error, ConnectionRefusedError)


def failure_text(error: BaseException) -> str:
    """A failure as the log lines of an ejection or a re-pin name it."""
    if is_refused(error):
        return "connection refused"
    if isinstance(error, aiohttp.ClientConnectorError):
        return f"cannot connect: {error.os_error.strerror or type(error.os_error).__name__}"
    if isinstance(error, TimeoutError):
        return "no answer in time"
    return type(error).__name__


def _is_connect_failure(error: BaseException) -> bool:
    """Nothing took the connection (refused, unreachable, no connection in time): what the head's probe tests."""
    return isinstance(
        error, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError | ServerUnreachableError
    )


# Errors that say the instance failed the call (counted towards its ejection): it refused, dropped or never
# answered (a timeout: a wedged instance answers its probes and nothing else). A cancelled call says nothing.
_INSTANCE_FAILURES = (aiohttp.ClientConnectionError, ServerUnreachableError, TimeoutError)
# What a body that did not arrive whole was cut off by, on the instance's side (a caller that let the answer go
# leaves aiohttp's plain "Connection closed", which says nothing of the instance).
_BODY_FAILURES = (
    aiohttp.ClientPayloadError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ServerTimeoutError,
)


class Pin:
    """Where one rollout's calls go, shared by every key the rollout is known by (its rollout id, its NeMo Gym
    sessions): re-pinning it, when its instance is gone, moves them all at once."""

    __slots__ = ("instance",)

    def __init__(self, instance: Instance) -> None:
        self.instance = instance


class Group:
    """Where one prompt's rollouts (a GRPO group) go, and how many of its calls are in flight there from this
    process: those are not counted against the instance when the group's next rollout is placed."""

    __slots__ = ("calls", "instance")

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self.calls = 0


class ServerRoute:
    """The instances of one server name and how calls are spread over them."""

    __slots__ = (
        "affine",
        "any_slow",
        "by_id",
        "by_task",
        "cap",
        "engine_loads",
        "engine_total",
        "generation",
        "gone",
        "groups",
        "homes",
        "in_flight_total",
        "instances",
        "joins",
        "key_order",
        "loads_at",
        "lock",
        "moves_rollouts",
        "name",
        "pins",
        "policy",
        "pool",
        "preferred",
        "preferred_pool",
        "refresh_at",
        "repins",
        "selector",
        "slow_bound",
        "winners",
    )

    def __init__(
        self,
        name: str,
        states: Sequence[InstanceView],
        policy: OutlierDetection,
        selector: Selector | None = None,
        affine: bool = False,
        engine_loads: EngineLoadTable | None = None,
    ) -> None:
        self.name = name
        self.affine = affine  # a model server's route: calls picked by prompt under a bound on load
        self.in_flight_total = 0  # calls in flight over all its instances (kept with theirs, under `lock`)
        # The engines' load the head pushes (gym_rpc.client.replicas._engine_load_table), read into each instance's
        # `engine_load` at most every ENGINE_LOAD_READ_SECONDS by a prefix-affine pick; `engine_total` is their
        # sum.
        self.engine_loads = engine_loads
        self.engine_total = 0
        self.loads_at = 0.0
        # prompt slot -> its PREFERRED instances, for the pool they were ranked in (`preferred_pool`)
        self.preferred: dict[int, tuple[Instance, ...]] = {}
        self.preferred_pool: tuple[Instance, ...] = ()
        # task number modulo the pool's size -> its PREFERRED instances: the pool in its keys' order (`key_order`),
        # from that position on
        self.by_task: dict[int, tuple[Instance, ...]] = {}
        self.key_order: tuple[Instance, ...] = ()
        # instance -> when a group's call there last left none of this process's calls in flight: its homes (a
        # worker running several groups at once has one for each that just ended)
        self.homes: dict[Instance, float] = {}
        self.groups: dict[int, Group] = {}  # prompt number -> where its group goes
        self.any_slow = False  # whether an instance is `slow` now (the picks then leave it out)
        # the latency over which an instance is `slow`, as of the last read (`_read_loads`): an answer over it
        # makes its instance slow at once (RoutedCall.answered), not at the next read
        self.slow_bound = math.inf
        self.policy = policy
        self.selector = selector
        self.instances: tuple[Instance, ...] = ()
        self.by_id: dict[str, Instance] = {}
        # id -> an instance no longer listed, with its pins, groups and counts: listed again, it takes them up
        self.gone: dict[str, Instance] = {}
        self.pins: dict[str, Pin] = {}  # rollout ids and session keys; aliases of one rollout share a Pin
        self.repins = 0  # rollouts moved off an instance that was gone, for the worker metrics
        self.pool: tuple[Instance, ...] = ()  # the instances that take new work (`candidate` set on each)
        # slot -> (its heaviest candidate, the generation it was found in): kept across changes of the pool. A
        # winner that left is found again among the candidates; one found before instances joined is weighed
        # against those (`joins`: (generation, instance) of each instance that joined since), so after a change
        # only the slots it concerns cost a rendezvous. It pays once a run has filled them: 1.35x at 4 instances,
        # 2.3x at 16, 6.4x at 64 against plain rendezvous over the candidates (bench/replicas.py, replicas-pick).
        self.winners: dict[int, tuple[Instance, int]] = {}
        self.joins: list[tuple[int, Instance]] = []
        self.generation = 0
        self.refresh_at = 0.0  # time.monotonic() at which the pool must be made again (an ejection ends)
        self.lock = threading.Lock()  # for updates from the watch's thread against refreshes from calls
        self.cap: ConcurrencyCap | None = None  # its `max_concurrent_requests` (gym_rpc.client.resend._budget)
        # Whether a rollout's call that got a 429 or 503 may go to another instance (its pin kept): not for a
        # resources server, whose rollouts keep state on their instance.
        self.moves_rollouts = False
        self.update(states)

    def update(self, states: Sequence[InstanceView]) -> None:
        """The instance set as the head (or the config) lists it now; each instance keeps the client's counts. An
        instance listed again (its lease lapsed and was renewed, its process registered again at its address) is
        the one it was: the rollouts pinned to it that made no call meanwhile stay, with their sessions and groups,
        and its calls still in flight are counted where they end."""
        with self.lock:
            kept = []
            gone = self.gone
            for state in distinct(states):
                instance = self.by_id.get(state.instance_id) or gone.pop(state.instance_id, None)
                if instance is None:
                    instance = Instance(state)
                else:
                    instance.apply(state)
                kept.append(instance)
            listed = {instance.instance_id for instance in kept}
            for instance in self.instances:
                if instance.instance_id not in listed:
                    instance.alive = False  # rollouts pinned to it move at their next call
                    gone[instance.instance_id] = instance
            while len(gone) > MAX_GONE:
                del gone[next(iter(gone))]
            self.instances = tuple(kept)
            self.by_id = {instance.instance_id: instance for instance in kept}
            self._refresh(_monotonic())

    def set_selector(self, selector: Selector | None) -> None:
        with self.lock:
            self.selector = selector
            self._refresh(_monotonic())

    def refresh(self) -> None:
        with self.lock:
            self._refresh(_monotonic())

    def _refresh(self, now: float) -> None:
        soonest = _NEVER
        for instance in self.instances:
            if instance.ejected_until:
                why = ejection_over(instance, now)
                if why is not None:
                    end_ejection(self.name, instance, now, why)
                else:
                    soonest = min(soonest, instance.ejected_until)
            instance.alive = not (instance.down or instance.ejected_until)
            if instance.alive:
                instance.repins_logged = False
        selector = self.selector
        candidates = tuple(
            instance
            for instance in self.instances
            if instance.alive and not instance.draining and matches(instance.labels, selector)
        )
        if candidates != self.pool:
            previous = set(self.pool)
            joined = [instance for instance in candidates if instance not in previous]
            for instance in self.pool:
                instance.candidate = False
            for instance in candidates:
                instance.candidate = True
            if joined:
                self.generation += 1
                if len(self.joins) + len(joined) > _MAX_JOINS:  # weighing them all costs more than starting over
                    self.winners, self.joins = {}, []
                else:
                    self.joins = [*self.joins, *((self.generation, instance) for instance in joined)]
            self.pool = candidates
        self.refresh_at = soonest

    # --- picking ---------------------------------------------------------------------------------------------

    def pick(self, key: str | None) -> Instance:
        """The instance for a call of rollout (or session) `key`, or of no rollout (None)."""
        if key is None:
            if self.refresh_at != _NEVER and _monotonic() >= self.refresh_at:
                self.refresh()
            candidates = self.pool
            if not candidates:
                raise self.no_instance()
            return two_choices(candidates)
        return self.pin_of(key, None).instance

    def pin_of(self, rollout: str | None, session: str | None) -> Pin:
        """The pin of a call known by its rollout key, its session key or both (one at least): the first alive pin
        of the session, then of the rollout; else pinned by rendezvous on the rollout (the same in every worker),
        else on the session. A call carrying both leaves them sharing that pin."""
        if self.refresh_at != _NEVER and _monotonic() >= self.refresh_at:
            self.refresh()
        pins = self.pins
        if session is None or rollout is None:
            key = rollout if session is None else session
            assert key is not None
            pin = pins.get(key)
            if pin is not None and pin.instance.alive:
                return pin
            return self.repin(key, pin, ())
        by_session, by_rollout = pins.get(session), pins.get(rollout)
        if by_session is not None and by_session.instance.alive:
            pin = by_session
        elif by_rollout is not None and by_rollout.instance.alive:
            pin = by_rollout
        else:  # neither alive: the rollout's rendezvous, moving a known pin (and its other aliases) along
            pin = self.repin(rollout, by_rollout or by_session, ())
        if by_session is not pin:
            self.pins_put(session, pin)
        if by_rollout is not pin:
            self.pins_put(rollout, pin)
        return pin

    def repin(self, key: str, pin: Pin | None, tried: tuple[Instance, ...], why: str = "") -> Pin:
        """Pin `key` by rendezvous over the instances that take new work (those not `tried` by the call, when any
        remain): `pin` moved there (with every key sharing it), or a new pin. The instance it leaves, if any, is
        counted and logged once."""
        candidates = self.pool
        if not candidates:
            raise self.no_instance()
        slot = slot_of(key)
        untried = tuple(instance for instance in candidates if instance not in tried) if tried else ()
        # Instances `tried` (and failed) by this call: the next heaviest, where the rollout goes once they are out.
        chosen = heaviest(slot, untried) if untried else self.slot_winner(slot, candidates)
        if pin is None:
            pin = Pin(chosen)
            self.pins_put(key, pin)
            return pin
        previous, pin.instance = pin.instance, chosen
        if self.pins.get(key) is not pin:
            self.pins_put(key, pin)
        self._moved(previous, chosen, key, why)
        return pin

    def _moved(self, previous: Instance, chosen: Instance, key: str, why: str = "") -> None:
        """A rollout left `previous`, an instance gone (or refusing): counted, and logged once per instance."""
        if previous is not chosen:
            self.repins += 1
            if not previous.repins_logged:
                previous.repins_logged = True
                if not why:
                    listed = previous.instance_id in self.by_id
                    why = f"it is {previous.describe(_monotonic())}" if listed else "it is no longer listed"
                logger.warning(
                    "rollouts pinned to instance %s of %s move to other instances (%s); first: %s -> %s",
                    previous.instance_id,
                    self.name,
                    why,
                    _shown_key(key),
                    chosen.instance_id,
                )

    def pick_affine(
        self, rollout: str | None, session: str | None, prompt: int | None, now: float
    ) -> tuple[Instance, Pin | None, Group | None]:
        """A model call's instance, the pin its rollout (or model session) keeps its turns on, if it has one, and
        its prompt's group when the call goes where the group is: the pin's instance while alive, not slow and
        under the bound to stay; else the group's instance under the same bound; else the least loaded of its
        prompt's preferred instances under the bound for new work (two random choices when none is, or the call
        has no prompt), where the pin and the group then move. `now`: time.monotonic(), read by the caller."""
        if now >= self.refresh_at:  # an ejection ended (never while none is ejected: refresh_at is infinite)
            self.refresh()
        candidates = self.pool
        if not candidates:
            raise self.no_instance()
        if now >= self.loads_at:
            self._read_loads()
        average = (self.in_flight_total + self.engine_total + 1) / len(candidates)
        stay = STICK_RATIO * average + STICK_SLACK
        group = None if prompt is None else self.groups.get(prompt)
        pins = self.pins
        pin = None if session is None else pins.get(session)
        if rollout is not None and (pin is None or not pin.instance.alive):
            pin = pins.get(rollout)
        if pin is not None:
            last = pin.instance
            if last.alive and not last.slow:
                # _load_beside(last, group), inlined: a rollout's later turn, the commonest model call
                at_group = group if group is not None and group.instance is last else None
                load = last.in_flight + last.engine_load
                if at_group is not None:
                    load -= at_group.calls
                if load < stay:
                    if rollout is not None and session is not None:
                        self._alias(pin, rollout, session)
                    return last, pin, at_group
        if prompt is None:
            chosen = _two_fast_choices(candidates) if self.any_slow else two_choices(candidates)
        else:
            fresh = FRESH_RATIO * average + FRESH_SLACK
            if group is None:
                chosen = self._place_group(prompt, rollout, candidates, fresh, None, now)
            else:
                chosen = group.instance
                if not chosen.candidate or chosen.slow or _load_beside(chosen, group) >= stay:
                    chosen = self._place_group(prompt, rollout, candidates, fresh, group, now)
            if group is None or group.instance is not chosen:
                group = self._group_at(prompt, chosen)
        if pin is None:
            if rollout is None and session is None:
                return chosen, None, group
            pin = Pin(chosen)
        else:  # the rollout's later turns follow (its aliases too); leaving a gone instance is a re-pin
            previous, pin.instance = pin.instance, chosen
            shown = rollout if rollout is not None else session
            if not previous.alive and shown is not None:
                self._moved(previous, chosen, shown)
        self._alias(pin, rollout, session)
        return chosen, pin, group

    def _group_at(self, prompt: int, instance: Instance) -> Group:
        """The prompt's group, now going to `instance`: a new one (its calls elsewhere are not counted there)."""
        groups = self.groups
        if len(groups) >= MAX_GROUPS and prompt not in groups:
            groups = self.groups = dict(itertools.islice(groups.items(), MAX_GROUPS // 2, None))
        groups[prompt] = group = Group(instance)
        return group

    def _place_group(
        self,
        prompt: int,
        rollout: str | None,
        candidates: tuple[Instance, ...],
        bound: float,
        group: Group | None,
        now: float,
    ) -> Instance:
        """Where a group (new, or leaving an instance it cannot stay on) goes.

        * While other calls run on the route: where a group of this process just ended (a `home`: none of its
          calls left there, within HOME_SECONDS; the latest first), if the engine reports no other worker's
          calls there. This
          process knows that instance is free now; the figures of the others are up to a second old, and two
          workers placing at once by them pile onto one instance while another idles.
        * If the engine there reports no more calls than this process had (two workers' groups met there and may
          end together, or the figure is from before they did), the home counts as free among the prompt's
          preferred instances: each prompt's order differs, so one of the two workers stays and the other goes.
        * Else the least loaded of the group's preferred instances under `bound`, the first on a tie
          (`preferred_for`: by its task number when its rollout id has one, so that groups dispatched in task
          order spread over the instances before any load shows)."""
        if self.homes and self.in_flight_total + self.engine_total:
            with self.lock:  # the homes of the last HOME_SECONDS, latest first; older ones forgotten
                fresh = sorted(
                    ((at, home) for home, at in self.homes.items() if now - at < HOME_SECONDS),
                    key=_first,
                    reverse=True,
                )
                self.homes = {home: at for at, home in fresh}
            met = None
            for _, home in fresh:
                if home.in_flight or not home.candidate or home.slow:
                    continue
                if not home.engine_load:
                    return home
                if met is None and home.engine_load <= home.own_peak:  # no more than its own were: met there?
                    met = home
            if met is not None:
                preferred = self._by_prompt(prompt, candidates)
                if met in preferred:
                    return self._least_loaded(preferred, candidates, bound, group, met)
        return self._least_loaded(self.preferred_for(prompt, rollout, candidates), candidates, bound, group, None)

    def preferred_for(
        self, prompt: int, rollout: str | None, candidates: tuple[Instance, ...]
    ) -> tuple[Instance, ...]:
        """A new group's PREFERRED instances, in order, the same in every worker: when its rollout id is NeMo
        Gym's `<task>-<rollout>`, the instances (in their keys' order) from its task number modulo their count
        on, so consecutive tasks start on consecutive instances; else its prompt's slot's rendezvous order."""
        task = _task_of(rollout)
        if task is None:
            return self._by_prompt(prompt, candidates)
        if self.preferred_pool is not candidates:
            self._rank(candidates)
        start = task % len(candidates)
        preferred = self.by_task.get(start)
        if preferred is None:
            ordered = self.key_order
            count = min(PREFERRED, len(ordered))
            preferred = self.by_task[start] = tuple(ordered[(start + i) % len(ordered)] for i in range(count))
        return preferred

    def _by_prompt(self, prompt: int, candidates: tuple[Instance, ...]) -> tuple[Instance, ...]:
        """The prompt's PREFERRED instances: its slot's rendezvous order (Group placement when no task number)."""
        if self.preferred_pool is not candidates:
            self._rank(candidates)
        slot = prompt % SLOTS
        preferred = self.preferred.get(slot)
        if preferred is None:
            preferred = self.preferred[slot] = top_choices(slot, candidates, PREFERRED)
        return preferred

    def _rank(self, candidates: tuple[Instance, ...]) -> None:
        """The pool changed: every order is made again when next used."""
        self.preferred, self.by_task, self.preferred_pool = {}, {}, candidates
        self.key_order = tuple(sorted(candidates, key=lambda instance: instance.key))

    def _least_loaded(
        self,
        preferred: tuple[Instance, ...],
        candidates: tuple[Instance, ...],
        bound: float,
        group: Group | None,
        free: Instance | None,
    ) -> Instance:
        """The least loaded (beside the group's own calls; `free` taken as 0) of the preferred instances that are
        not slow, the first preferred on a tie, while its load is under `bound`; else two random choices among the
        instances that are not slow. Of d choices the least loaded spreads whole groups evenly (Mitzenmacher),
        and every worker has the same d to choose from."""
        best, least = None, bound
        for instance in preferred:
            if not instance.slow:
                load = 0 if instance is free else _load_beside(instance, group)
                if load < least:
                    best, least = instance, load
        if best is not None:
            return best
        return _two_fast_choices(candidates) if self.any_slow else two_choices(candidates)

    def _read_loads(self) -> None:
        """Each instance's engine load (requests waiting + running) from the table the head pushes, 0 where unknown
        (no figure, or one older than the table's bound: the calls in flight then stand alone); and which instances
        are slow: answering in over SLOW_RATIO times the median instance's latency, with two answering at least."""
        now = _monotonic()
        table, name, total = self.engine_loads, self.name, 0
        latencies = []
        for instance in self.instances:
            if table is not None:
                load = table.of(name, instance.instance_id)
                # The figure, read up to a second ago, counts this process's calls of then too: those are taken
                # off as the most this process had there within OWN_PEAK_SECONDS (never counted twice), as each
                # call sent there counts it (RoutedCall), and here its count now.
                own = instance.in_flight
                if own >= instance.own_peak or now - instance.own_peak_at > OWN_PEAK_SECONDS:
                    instance.own_peak, instance.own_peak_at = own, now
                figure = 0 if load is None else int((load.waiting or 0) + (load.running or 0))
                mine = instance.own_peak
                read_at = None if load is None or load.age_seconds is None else now - load.age_seconds
                if not own and read_at is not None and read_at > instance.left_at:  # read after they all ended
                    mine = 0
                instance.engine_load = figure - mine if figure > mine else 0
                total += instance.engine_load
            if instance.latency and now - instance.latency_at > SLOW_FORGET_SECONDS:
                instance.latency = 0.0  # no answer lately: forgotten, so a slow instance gets a try again
            if instance.latency:
                latencies.append(instance.latency)
        self.engine_total = total
        if len(latencies) >= 2:
            latencies.sort()
            median = latencies[(len(latencies) - 1) // 2]
            bound = self.slow_bound = max(SLOW_RATIO * median, median + SLOW_MARGIN_SECONDS)
            any_slow = False
            for instance in self.instances:
                latency = instance.latency
                if latency > bound:
                    instance.slow, instance.slow_at = True, now
                elif instance.slow:  # cleared by an answer since the verdict, or its figure forgotten
                    instance.slow = bool(latency) and instance.latency_at <= instance.slow_at
                any_slow = any_slow or instance.slow
            self.any_slow = any_slow
        else:
            for instance in self.instances:
                instance.slow = False
            self.any_slow, self.slow_bound = False, math.inf
        self.loads_at = now + ENGINE_LOAD_READ_SECONDS

    def _alias(self, pin: Pin, rollout: str | None, session: str | None) -> None:
        pins = self.pins
        if rollout is not None and pins.get(rollout) is not pin:
            self.pins_put(rollout, pin)
        if session is not None and pins.get(session) is not pin:
            self.pins_put(session, pin)

    def slot_winner(self, slot: int, candidates: tuple[Instance, ...]) -> Instance:
        """The heaviest candidate for `slot`, remembered (`winners`): weighed against every candidate when none is
        remembered or the remembered one takes no new work now, else only against the candidates that joined since
        it was found (an instance leaving changes no other slot's winner)."""
        remembered = self.winners.get(slot)
        if remembered is None or not remembered[0].candidate:
            winner = heaviest(slot, candidates)
        else:
            winner, found_in = remembered
            if found_in == self.generation:
                return winner
            joined = [instance for since, instance in self.joins if since > found_in and instance.candidate]
            if joined:
                winner = heaviest(slot, [winner, *joined])
        self.winners[slot] = (winner, self.generation)
        return winner

    def other(self, tried: tuple[Instance, ...]) -> Instance:
        """For a call of no rollout that failed: two choices among the instances it has not tried yet, else among
        all that take new work (the resend bound still ends the call)."""
        candidates = self.pool
        untried = tuple(instance for instance in candidates if instance not in tried)
        if untried or candidates:
            return two_choices(untried or candidates)
        raise self.no_instance()

    def any_url(self, key: str | None) -> str:
        """One URL for `_resolve_base_url`: the rollout's instance, else one that takes new work (no call is
        counted)."""
        if key is not None:
            return self.pick(key).url
        candidates = self.pool
        if not candidates:
            raise self.no_instance()
        return min(candidates, key=lambda instance: instance.in_flight).url

    def no_instance(self) -> NoHealthyInstanceError:
        now = _monotonic()
        why = ""
        open_ones = [instance for instance in self.instances if instance.alive and not instance.draining]
        if self.selector is not None and open_ones:
            why = f"none matches the labels {selector_text(self.selector)}"
        listed = [(instance.instance_id, instance.describe(now)) for instance in self.instances]
        return NoHealthyInstanceError(self.name, listed, why)

    # --- outcomes --------------------------------------------------------------------------------------------

    def failed(self, instance: Instance, error: BaseException) -> None:
        # NoHealthyInstanceError is the route's own word (a failover found nowhere to go), not the instance's.
        if isinstance(error, _INSTANCE_FAILURES) and not isinstance(error, NoHealthyInstanceError):
            self.failed_with(instance, failure_text(error), _is_connect_failure(error))
        elif isinstance(error, Backpressure) and error.response.status >= 500:  # a 503 is a 5xx; a 429 is busy
            self.failed_with(instance, f"HTTP {error.response.status}")

    def failed_with(self, instance: Instance, reason: str, connect: bool = False) -> None:
        if record_failure(self.policy, self.name, instance, self.instances, reason, _monotonic(), connect):
            self.refresh()

    def succeeded(self, instance: Instance) -> None:
        succeeded(self.name, instance)

    def body_ended(self, instance: Instance, response: aiohttp.ClientResponse, deadline: float | None) -> None:
        """The answer's connection was let go (aiohttp's connection callback): a body read whole is a success; one
        cut off by the instance (a reset, a broken chunk, a silent socket) or still arriving at the call's
        deadline is a failure; one the caller let go early says nothing."""
        content = response.content
        if content.is_eof():
            self.succeeded(instance)
            return
        error = content.exception()
        if isinstance(error, _BODY_FAILURES):
            self.failed_with(instance, f"its answer's body broke off ({type(error).__name__})")
        elif deadline is not None and _monotonic() >= deadline:
            self.failed_with(instance, "its answer's body did not arrive in time")

    def learn_session(self, response: aiohttp.ClientResponse, instance: Instance, pin: Pin | None) -> None:
        """Pin the NeMo Gym session the answer opened (a session cookie named for this server in its Set-Cookie)
        to the instance that opened it, with the call's rollout (`pin`, when it is there), so the session's later
        calls, which carry the cookie, go there, whatever else they carry."""
        session = session_key_from_cookies(response.cookies, self.name)
        if session is not None:
            self.pins_put(
                _SESSION_PREFIX + session, pin if pin is not None and pin.instance is instance else Pin(instance)
            )

    def pins_put(self, key: str, pin: Pin) -> None:
        """Pin `key`; past MAX_PINS the older half is forgotten at once (popping a dict's first key one at a time
        costs a scan over every key popped before it)."""
        pins = self.pins
        if len(pins) >= MAX_PINS and key not in pins:
            pins = self.pins = dict(itertools.islice(pins.items(), MAX_PINS // 2, None))
        pins[key] = pin


def _first(pair: tuple[float, Instance]) -> float:
    return pair[0]


def _task_of(rollout: str | None) -> int | None:
    """The task number of a NeMo Gym rollout id (`<task>-<rollout>`, `-a<n>` after for a retry), else None."""
    if rollout is None:
        return None
    task, dash, _ = rollout.partition("-")
    if not dash or not task.isdigit() or len(task) > 18:
        return None
    return int(task)


def _load_beside(instance: Instance, group: Group | None) -> int:
    """The instance's load (this process's calls in flight, and the other workers' its engine reports) beside
    the group's own calls there: a GRPO group's rollouts arriving together never push it off its own instance."""
    load = instance.in_flight + instance.engine_load
    if group is not None and group.instance is instance:
        return load - group.calls
    return load


def _two_fast_choices(candidates: tuple[Instance, ...]) -> Instance:
    """Two random choices among the candidates that are not slow (among all when every one is)."""
    fast = tuple(instance for instance in candidates if not instance.slow)
    return two_choices(fast if fast and len(fast) < len(candidates) else candidates)


def _shown_key(key: str) -> str:
    return f"session {key[1:]}" if key.startswith(_SESSION_PREFIX) else f"rollout {key}"


def session_pin_key(cookies: Any, server_name: str) -> str | None:
    """The pin key of the NeMo Gym session a call's cookies carry for this server, if any."""
    session = session_key_from_cookies(cookies, server_name)
    return None if session is None else _SESSION_PREFIX + session
