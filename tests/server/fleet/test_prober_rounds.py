"""The status prober, exactly: the watch history a watcher missed, shared probes counted once, its defaults, its
revision, its task and its log lines, its rounds.

Found by mutation testing (`make mutate`, bench/MUTATION.md; these tests were tests/test_exact_behaviour.py):
exact answers no other test pinned down. Each test names the mutant class it kills: a change to the code
that left the rest of the suite green.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time

from gym_rpc.config import (
    GlobalConfig,
    url_authority,
)
from gym_rpc.server._head import HeadOptions
from gym_rpc.server.fleet._prober import Changes, StatusProber
from gym_rpc.server.registry._registry import InstanceRegistry
from gym_rpc.wire import InstanceRegistration, StatusReport
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK
from tests.support.prober import registered_as


async def test_changes_since_is_exactly_what_a_watcher_missed() -> None:
    """StatusProber.changes_since: nothing at (or past) the current revision; the latest report per server of
    every change after the given revision; a compacted snapshot once that revision is older than the history."""
    config = GlobalConfig.from_document(document({"a": server_entry(1001), "b": server_entry(1002)}))
    told: list[tuple[StatusReport | None, str]] = []

    async def on_change(report: StatusReport | None, name: str) -> None:
        told.append((report, name))

    prober = StatusProber(config.servers, history_size=3, on_change=on_change)
    await prober.set_servers(config.servers)  # two changes: a and b appear, unprobed
    start = prober.revision
    assert prober.changes_since(start) == Changes(start, [], compacted=False)
    assert prober.changes_since(start + 5) == Changes(start, [], compacted=False)

    a_is = functools.partial(registered_as, config.servers["a"])
    await prober.set_instances("a", a_is("registered", "http://10.0.0.1:1001"))
    await prober.set_instances("a", a_is("registered", "http://10.0.0.1:1001"))  # no change: nothing recorded
    assert prober.revision == start + 1
    a_registered = prober.report("a")
    assert (a_registered.registration, a_registered.advertised_url) == ("registered", "http://10.0.0.1:1001")
    assert prober.changes_since(start) == Changes(start + 1, [a_registered], compacted=False)

    await prober.set_instances("b", registered_as(config.servers["b"], "expired"))
    await prober.set_instances("a", a_is("deregistered"))
    latest = prober.reports()
    assert [(r.server_name, r.registration) for r in latest] == [("a", "deregistered"), ("b", "expired")]
    # The history holds the last three changes (start+1 .. start+3): a watcher at `start` missed nothing older.
    assert prober.changes_since(start) == Changes(start + 3, [latest[0], latest[1]], compacted=False)
    assert prober.changes_since(start + 2) == Changes(start + 3, [latest[0]], compacted=False)
    assert prober.changes_since(start - 1) == Changes(start + 3, latest, compacted=True)
    await prober.set_instances("gone", a_is("registered", "http://x"))  # not a server of the config: ignored
    assert prober.revision == start + 3
    assert told[-3:] == [(a_registered, "a"), (latest[1], "b"), (latest[0], "a")]  # health follows each change


async def test_a_caller_that_outwaits_its_deadline_gets_an_exact_timeout_report(silent_server: int) -> None:
    """StatusProber.probe_now: joined to a longer probe in flight, a caller gets TIMEOUT after its own deadline,
    with the server's name and URL; with no probe in flight its own probe is bounded by its deadline."""
    config = GlobalConfig.from_document(document({"s": server_entry(silent_server)}))
    url = f"http://{LOOPBACK}:{silent_server}"
    prober = StatusProber(config.servers, interval_seconds=3600, probe_timeout_seconds=30)
    await prober.start()  # the first round's probe waits up to 30 s on the silent server
    try:
        before = time.time()
        report = await prober.probe_now("s", 0.2)
        assert (report.server_name, report.status, report.url, report.detail) == (
            "s",
            "timeout",
            url,
            "no answer within 0.2s",
        )
        assert 0.2 <= report.latency_seconds < 30 and before <= report.checked_at <= time.time()
    finally:
        await prober.stop()
    prober = StatusProber(config.servers, interval_seconds=3600, probe_timeout_seconds=0.1)
    await prober.start()
    try:
        if prober.report("s").status is None:  # the first round's result comes within its 0.1 s
            assert await prober.wait_for_change(prober.revision, 10)
        report = await prober.probe_now("s", 0.3)  # nothing in flight: a probe of its own, bounded by 0.3 s
        assert (report.status, report.detail) == ("timeout", "no answer within 0.3s")
    finally:
        await prober.stop()


async def test_wait_for_change_is_true_on_a_change_and_false_after_its_timeout() -> None:
    config = GlobalConfig.from_document(document({"a": server_entry(1001)}))
    prober = StatusProber({})
    revision = prober.revision
    assert await prober.wait_for_change(revision, 0.05) is False

    async def change_soon() -> None:
        await asyncio.sleep(0.05)
        await prober.set_servers(config.servers)

    changing = asyncio.create_task(change_soon())
    assert await prober.wait_for_change(revision, 0.9) is True  # under a second left is still worth waiting
    await changing
    assert await prober.wait_for_change(revision, 0) is True  # already past it: no wait at all


async def test_a_stored_probe_keeps_the_registration_and_counts_probes_in_a_row(caplog) -> None:
    servers = GlobalConfig.from_document(document({"s": server_entry(1)})).servers
    prober = StatusProber(servers)
    await prober.set_servers(servers)
    url = servers["s"].url
    ok = StatusReport(server_name="s", status="success", url=url, checked_at=time.time(), http_status=200)
    with caplog.at_level(logging.WARNING):
        instance_id = url_authority(url)
        for _ in range(3):
            await prober._store("s", instance_id, ok)
        await prober.set_instances("s", registered_as(servers["s"], None, "http://advertised:1"))
        failed = StatusReport(
            server_name="s", status="connection_error", url=url, checked_at=time.time(), detail="refused"
        )
        await prober._store("s", instance_id, failed)
        stored = prober.report("s")
        assert (stored.status, stored.advertised_url) == ("connection_error", "http://advertised:1")
        await prober._store("s", instance_id, failed)
        await prober._store(
            "s", instance_id, dataclasses.replace(failed, status="timeout", detail="no answer within 1s")
        )
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings == [
        "s: success -> connection_error after 3 probes (refused)",
        "s: connection_error -> timeout after 2 probes (no answer within 1s)",  # counted again from the change
    ]
    assert prober.fresh_report("s", 0) is None  # 0: no cached answer is fresh enough
    assert prober.fresh_report("s", 60) == prober.report("s")


async def test_every_probe_sent_is_counted_once(http_server) -> None:
    port = await http_server()
    servers = GlobalConfig.from_document(document({"s": server_entry(port)})).servers
    probed = asyncio.Event()

    async def on_change(report: StatusReport | None, name: str) -> None:
        if report is not None and report.status is not None:  # the first background round's probe
            probed.set()

    prober = StatusProber(servers, interval_seconds=3600, on_change=on_change)
    await prober.start()
    try:
        await asyncio.wait_for(probed.wait(), 10)
        await prober.probe_now("s", 5)
        await prober.probe_now("s", 5)
    finally:
        await prober.stop()
    assert (prober.probes_started, prober.probes_joined) == (3, 0)


async def test_each_caller_that_shares_a_probe_in_flight_counts_once(silent_server: int) -> None:
    servers = GlobalConfig.from_document(document({"s": server_entry(silent_server)})).servers
    prober = StatusProber(servers, interval_seconds=3600, probe_timeout_seconds=0.3)
    await prober.start()
    try:
        await asyncio.gather(*(prober.probe_now("s", 5) for _ in range(3)))
    finally:
        await prober.stop()
    assert (prober.probes_started, prober.probes_joined) == (1, 3)  # the background round's probe, joined by all 3


async def test_a_prober_made_without_settings_has_the_heads_defaults() -> None:
    """Kills StatusProber.__init__ mutants 1-3: a 2 s interval, a 1 s probe timeout, results fresh for half the
    interval, and a watch history of 1024 changes (a watcher 1024 changes behind resumes, one more behind does
    not), as HeadOptions has them."""
    options = HeadOptions()
    assert (options.probe_interval_seconds, options.probe_timeout_seconds, options.watch_history_size) == (
        2.0,
        1.0,
        1024,
    )
    servers = GlobalConfig.from_document(document({"a": server_entry(1001)})).servers
    prober = StatusProber(servers)
    assert (prober.interval_seconds, prober.probe_timeout_seconds, prober.default_max_age_seconds) == (
        2.0,
        1.0,
        1.0,
    )
    await prober.set_servers(servers)
    start = prober.revision
    for port in range(1, 1025):
        await prober.set_instances("a", registered_as(servers["a"], "registered", f"http://10.0.0.1:{port}"))
    assert prober.revision == start + 1024
    assert prober.changes_since(start) == Changes(start + 1024, [prober.report("a")], compacted=False)
    assert prober.changes_since(start - 1).compacted is True


def test_a_new_probers_revision_is_the_wall_clock_in_milliseconds() -> None:
    """Kills StatusProber.__init__ mutant 21: revisions start at the wall clock in ms (so they keep rising across
    head restarts), not at some other fraction of it."""
    before = time.time_ns() // 1_000_000
    revision = StatusProber({}).revision
    assert before <= revision <= time.time_ns() // 1_000_000


async def test_a_moved_config_instance_restarts_unprobed_and_its_process_stays_an_instance() -> None:
    """A server whose config address changes has a new config instance, unprobed at the new URL; the process that
    registered at the old address is still an instance (a registered one, there); the listener is told each
    change (never None: the server did not leave)."""
    told: list[tuple[StatusReport | None, str]] = []

    async def on_change(report: StatusReport | None, name: str) -> None:
        told.append((report, name))

    config = {"servers": GlobalConfig.from_document(document({"a": server_entry(1001)})).servers}
    prober = StatusProber(config["servers"], on_change=on_change)
    registry = InstanceRegistry(lambda: config["servers"])
    await prober.set_servers(config["servers"])
    await registry.register(
        InstanceRegistration("a", 7, 0.0, LOOPBACK, 1001, LOOPBACK, registered_at=0.0, peer_host=LOOPBACK)
    )
    await registry.update_prober(prober, ["a"])
    config["servers"] = GlobalConfig.from_document(document({"a": server_entry(1002)})).servers
    await registry.update_prober(prober)
    report = prober.report("a")
    assert (report.status, report.url, report.registration, report.advertised_url) == (
        None,
        f"http://{LOOPBACK}:1002",
        None,
        "",
    )
    assert [(i.instance_id, i.origin, i.registration, i.pid) for i in report.instances] == [
        (f"{LOOPBACK}:1002", "config", None, 0),
        (f"{LOOPBACK}:1001", "registered", "registered", 7),
    ]
    assert [(report and (report.url, report.registration), name) for report, name in told] == [
        ((f"http://{LOOPBACK}:1001", None), "a"),
        ((f"http://{LOOPBACK}:1001", "registered"), "a"),
        ((f"http://{LOOPBACK}:1002", None), "a"),
    ]


async def test_the_first_probe_line_says_no_probe_had_given_pending(http_server, caplog) -> None:
    """Kills set_servers mutant 32: `gym.probes` (the probes in a row that gave the old status) is 0 on the line
    of a server's first probe: a new server starts counting at 0."""
    port = await http_server()
    servers = GlobalConfig.from_document(document({"s": server_entry(port)})).servers
    prober = StatusProber(servers, interval_seconds=3600)
    caplog.set_level(logging.INFO, logger="gym_rpc.head")
    await prober.start()
    try:
        if prober.report("s").status is None:
            assert await prober.wait_for_change(prober.revision, 10)
    finally:
        await prober.stop()
    [line] = [record for record in caplog.records if record.name == "gym_rpc.head"]
    assert line.getMessage() == "s: pending -> success on the first probe"
    assert line.__dict__["gym.probes"] == 0


async def test_the_probers_task_is_named_and_ends_with_stop() -> None:
    """Kills start mutants 5, 8, 9 and stop mutant 1: one background task, named "gym_rpc status prober" (what a
    dump of a hung head's tasks shows), and stop() cancels it and waits for it to end."""
    prober = StatusProber({}, interval_seconds=3600)
    before = asyncio.all_tasks()
    await prober.start()
    tasks = asyncio.all_tasks() - before
    await prober.stop()
    assert [task.get_name() for task in tasks] == ["gym_rpc status prober"]
    assert all(task.cancelled() for task in tasks)


async def test_a_failed_probe_round_is_logged_by_name(http_server) -> None:
    """Kills _run mutants 11 and 12: a round that fails (here the change listener raises) is logged as
    "status probe round failed", with the exception."""
    port = await http_server()
    servers = GlobalConfig.from_document(document({"s": server_entry(port)})).servers
    broken = RuntimeError("the listener broke")

    async def on_change(report: StatusReport | None, name: str) -> None:
        if report is not None and report.status is not None:  # a probe result, not the server's arrival
            raise broken

    class Kept(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.ERROR)
            self.records: list[logging.LogRecord] = []
            self.logged = asyncio.Event()

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)
            self.logged.set()

    kept = Kept()
    prober_logger = logging.getLogger("gym_rpc.server._prober")
    prober_logger.addHandler(kept)
    prober = StatusProber(servers, interval_seconds=3600, on_change=on_change)
    await prober.start()
    try:
        await asyncio.wait_for(kept.logged.wait(), 10)
    finally:
        await prober.stop()
        prober_logger.removeHandler(kept)
    assert [(r.getMessage(), r.exc_info and r.exc_info[1]) for r in kept.records] == [
        ("status probe round failed", broken)
    ]


async def _probes_of_a_round_at_age(
    prober: StatusProber, name: str, age: float, within: tuple[float, float]
) -> int:
    """The probes a background round (probe_all) starts when the server's cached result is `age` s old.

    The round is run only when the loop woke with the result's age inside `within` and nothing in flight; a loaded
    machine that woke too late gets a fresh result and another try."""
    for _ in range(5):
        cached = prober.report(name)
        await asyncio.sleep(max(0.0, cached.checked_at + age - time.time()))
        started, waited = prober.probes_started, time.time() - cached.checked_at
        if prober.report(name) is cached and not prober.waiting_on_probe(name) and within[0] < waited < within[1]:
            await prober.probe_all()  # decides at once (no await before it looks at the age)
            return prober.probes_started - started
        await prober.probe_now(name, 5)
    raise AssertionError(f"the loop never woke with the result {within[0]} to {within[1]} s old")


async def test_a_round_asks_again_after_half_the_interval_even_with_a_longer_max_age(http_server) -> None:
    """Kills probe_all mutants 6 and 7: the background round's freshness window is half the interval when the
    stated default max age is longer (a 3 s interval: a 1.25 s old result is kept, a 2 s old one is asked
    again)."""
    port = await http_server()
    servers = GlobalConfig.from_document(document({"s": server_entry(port)})).servers
    prober = StatusProber(servers, interval_seconds=3.0, default_max_age_seconds=3600)
    await prober.start()
    try:
        if prober.report("s").status is None:
            assert await prober.wait_for_change(prober.revision, 10)
        assert await _probes_of_a_round_at_age(prober, "s", 1.25, (1.0, 1.5)) == 0
        assert await _probes_of_a_round_at_age(prober, "s", 2.0, (1.5, 3.0)) == 1
    finally:
        await prober.stop()
