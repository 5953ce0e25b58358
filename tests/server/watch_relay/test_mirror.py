"""The relay's copy of the head's statuses (gym_rpc.server.watch_relay.StatusMirror): a revision of its own per
changed server, a resume from its history, a snapshot after the first (a fresh head) replacing everything and
reaching local watchers as a snapshot, a new config version heard at once, the engines' load passed on."""

from __future__ import annotations

from gym_rpc.server.watch_relay import StatusMirror
from gym_rpc.wire import EngineLoad, StatusReport, WatchEvent


def report(name: str, url: str = "http://127.0.0.1:1") -> StatusReport:
    return StatusReport(server_name=name, status="success", url=url)


def event(kind: str, revision: int, *reports: StatusReport, version: str = "v1") -> WatchEvent:
    return WatchEvent(kind=kind, revision=revision, reports=list(reports), compacted=False, config_version=version)


async def test_changes_are_revisions_of_its_own_and_a_resume_gets_only_what_it_missed() -> None:
    mirror = StatusMirror()
    assert not mirror.synced
    mirror.apply(event("snapshot", 500, report("a"), report("b")))
    assert mirror.synced and [r.server_name for r in mirror.reports()] == ["a", "b"]
    seen = mirror.revision
    mirror.apply(event("change", 507, report("b", "http://127.0.0.1:2")))
    mirror.apply(event("change", 512, report("a"), version="v1"))  # the same report again: no revision
    assert mirror.revision == seen + 1 and mirror.head_revision == 512
    changes = mirror.changes_since(seen)
    assert not changes.compacted and [r.url for r in changes.reports] == ["http://127.0.0.1:2"]


async def test_a_fresh_heads_snapshot_replaces_the_view_and_reaches_watchers_as_a_snapshot() -> None:
    mirror = StatusMirror()
    mirror.apply(event("snapshot", 500, report("a"), report("b")))
    seen = mirror.revision
    mirror.apply(event("snapshot", 9, report("a")))  # another head, or the head restarted: it lists only `a`
    assert [r.server_name for r in mirror.reports()] == ["a"]
    changes = mirror.changes_since(seen)
    assert changes.compacted and [r.server_name for r in changes.reports] == ["a"]


async def test_a_new_config_version_is_a_revision_and_the_engines_load_is_passed_on() -> None:
    mirror = StatusMirror()
    mirror.apply(event("snapshot", 500, report("a")))
    seen = mirror.revision
    mirror.apply(event("heartbeat", 500, version="v2"))
    assert mirror.config_version == "v2" and mirror.revision == seen + 1
    load = EngineLoad("policy", "127.0.0.1:1", waiting=3, running=1, kv_cache_usage=0.5, age_seconds=0.2)
    version = mirror.engine_loads.version
    mirror.apply(WatchEvent(kind="engine_load", revision=501, reports=[], compacted=False, engine_loads=[load]))
    assert mirror.engine_loads.version == version + 1 and mirror.revision == seen + 1
    [passed] = mirror.engine_loads.loads()
    assert (passed.waiting, passed.running, passed.kv_cache_usage) == (3, 1, 0.5)
    assert passed.age_seconds is not None and passed.age_seconds >= 0.2
