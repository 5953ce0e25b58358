"""The commands that ask a running head, as its client: `config`, `reload`, `status` (and its watch) and `wait`.

None of them loads server code (tests/cli/test_cli_operability.py checks); the output is drawn by `_render`,
imported when a command prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gym_rpc.cli._exit_codes import EXIT_DOWN, EXIT_OK, UsageError
from gym_rpc.cli._parser import security_from_flags
from gym_rpc.client import DEFAULT_TIMEOUT_SECONDS, SyncControlClient, SyncStatusWatch
from gym_rpc.config import load_config_file
from gym_rpc.errors import ControlPlaneError, GymRpcError, HeadUnreachableError, UnknownServerError
from gym_rpc.wire import EngineLoad, InstanceReport, ServerInstance, StatusReport, StatusSnapshot, WatchEvent

WARM_UP_POLL_SECONDS = 0.1  # `status` asks a warming head again this often

# How often `status --watch` (table) and `wait` hear from the head while nothing changes: the table's LAST CHECKED
# is redrawn from the head's latest probes, and `wait` notices its deadline.
WATCH_REFRESH_SECONDS = 1.0


def _client(args: argparse.Namespace, timeout: float | None = None) -> SyncControlClient:
    seconds: float = timeout if timeout is not None else args.timeout
    return SyncControlClient(args.head, timeout_seconds=seconds, security=security_from_flags(args))


def cmd_config(args: argparse.Namespace) -> int:
    from gym_rpc.cli._render import render_document

    if args.check is not None:
        return _check_config(args.check)
    client = _client(args)
    if args.include_secrets and client.security.token is None:
        raise UsageError(
            "--include-secrets needs the head's token (--token-file FILE or GYM_RPC_TOKEN): without it the head "
            "sends the secrets redacted"
        )
    config = client.get_global_config(include_secrets=args.include_secrets)
    print(render_document(config.document, args.output))
    return EXIT_OK


def _check_config(path: Path) -> int:
    """`config --check FILE`: the file loaded and validated exactly as `gym-rpc head --config FILE` would."""
    config = load_config_file(path)  # a malformed file raises ConfigError: one line, exit 1
    for name, reason in config.malformed_servers.items():
        print(f"gym-rpc config: warning: {path}: {name} is not served: {reason}", file=sys.stderr)
    print(f"{path}: valid, version {config.version}, {len(config.servers)} servers ({', '.join(config.servers)})")
    return EXIT_OK


def cmd_reload(args: argparse.Namespace) -> int:
    version, changed = _client(args).reload_global_config()
    print(f"config version {version} ({'changed' if changed else 'unchanged'})")
    return EXIT_OK


def _instances(client: SyncControlClient) -> list[ServerInstance]:
    return client.list_server_instances()


def _require_known(names: Sequence[str], reports: Sequence[StatusReport], flag: str) -> None:
    known = [r.server_name for r in reports]
    for name in names:
        if name not in known:
            raise UsageError(f"{flag}: {UnknownServerError(name, known)}")


def _not_up(reports: Sequence[StatusReport], exempt: Sequence[str] = ()) -> list[StatusReport]:
    return [r for r in reports if r.status != "success" and r.server_name not in exempt]


def _print_statuses(
    reports: Sequence[StatusReport],
    instances: Sequence[ServerInstance],
    output: str,
    exempt: Sequence[str],
    engine_loads: Sequence[EngineLoad] = (),
) -> None:
    from gym_rpc.cli._render import format_status_table, format_wide_table, render_rows, status_rows, summary_line

    if output == "wide":
        print(format_wide_table(reports, instances, color=sys.stdout.isatty()))
        print(summary_line(reports, exempt))
    elif output == "table":
        print(format_status_table(reports, instances, color=sys.stdout.isatty(), engine_loads=engine_loads))
        print(summary_line(reports, exempt))
    else:
        print(render_rows(status_rows(reports, instances, engine_loads=engine_loads), output))  # type: ignore[arg-type]
    sys.stdout.flush()


def cmd_status(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.watch:
        return _watch_status(client, args)
    snapshot = client.list_server_statuses()
    reports = snapshot.reports
    _require_known(args.allow_down, reports, "--allow-down")
    _require_known(args.servers, reports, "status")
    if args.servers:
        reports = [r for r in reports if r.server_name in args.servers]
    snapshot, reports = _after_warm_up(client, snapshot, args.servers, time.monotonic() + args.timeout)
    instances = _instances(client)
    _print_statuses(reports, instances, args.output, args.allow_down, snapshot.engine_loads)
    return EXIT_DOWN if _not_up(reports, args.allow_down) else EXIT_OK


def _after_warm_up(
    client: SyncControlClient, snapshot: StatusSnapshot, names: Sequence[str], deadline: float
) -> tuple[StatusSnapshot, list[StatusReport]]:
    """The head's statuses (those of `names`, or all) once it has probed every server among them: a head that just
    started (or restarted) has not yet, and its servers are pending, not down. Asked again every
    WARM_UP_POLL_SECONDS until `deadline`."""

    def chosen(statuses: StatusSnapshot) -> list[StatusReport]:
        return [r for r in statuses.reports if not names or r.server_name in names]

    reports = chosen(snapshot)
    while any(report.status is None for report in reports) and time.monotonic() < deadline:
        time.sleep(WARM_UP_POLL_SECONDS)
        snapshot = client.list_server_statuses()
        reports = chosen(snapshot)
    return snapshot, reports


def watch_events(
    client: SyncControlClient,
    *,
    heartbeat_seconds: float | None = None,
    deadline: float | None = None,
    max_wait: float | None = None,
) -> Iterator[WatchEvent]:
    """The head's status events from the library's watch (gym_rpc.client.control._watch), which reconnects with
    capped, jittered backoff and resumes from the last revision. It gives up, raising the last
    HeadUnreachableError, once the head has been unreachable `max_wait` seconds or at `deadline`
    (time.monotonic()); else never."""

    def retrying(error: ControlPlaneError, pause: float) -> None:
        print(f"gym-rpc: {error}; retrying in {pause:.1f}s", file=sys.stderr)

    watch = SyncStatusWatch(
        client, heartbeat_seconds=heartbeat_seconds, max_wait_seconds=max_wait, until=deadline, on_retry=retrying
    )
    yield from watch


def _watch_status(client: SyncControlClient, args: argparse.Namespace) -> int:
    """Redraw on every change; the table also every WATCH_REFRESH_SECONDS, so LAST CHECKED stays true.

    Every drawing is taken from ListServerStatuses, not from the events alone: a change event carries only the
    servers that changed, and the head probes the others on without telling the watch (their last check moves
    on while their status stays).
    """
    from gym_rpc.cli._render import render_document, status_rows

    table = args.output in ("table", "wide")
    terminal = sys.stdout.isatty()
    _require_known(args.allow_down, client.list_server_statuses().reports, "--allow-down")  # fails fast too
    heartbeat = WATCH_REFRESH_SECONDS if table else None
    for event in watch_events(client, heartbeat_seconds=heartbeat, max_wait=args.max_wait):
        if event.kind == "heartbeat" and not (table and terminal):
            continue  # piped output gets a drawing per change, not per second
        snapshot, instances = client.list_server_statuses(), _instances(client)
        reports, loads = snapshot.reports, snapshot.engine_loads
        if table:
            if terminal:
                print("\x1b[H\x1b[2J", end="")
            print(f"revision {event.revision}")
            _print_statuses(reports, instances, args.output, args.allow_down, loads)
        else:
            servers = status_rows(reports, instances, engine_loads=loads)
            document = {"revision": event.revision, "kind": event.kind, "servers": servers}
            print(render_document(document, "jsonl" if args.output == "json" else args.output), flush=True)
            if args.output == "yaml":
                print("---", flush=True)
    return EXIT_OK  # the stream never ends by itself: Ctrl-C or giving up ends the command


def cmd_wait(args: argparse.Namespace) -> int:
    """Block on the watch until every named server (or all) is up, or the timeout passes."""
    from gym_rpc.cli._render import summary_line

    deadline = time.monotonic() + args.timeout
    client = _client(args, DEFAULT_TIMEOUT_SECONDS)
    progress = _WaitProgress(args.timeout, deadline)
    need = WaitNeed(args.instances, dict(args.label))
    reports: dict[str, StatusReport] = {}
    try:
        for event in watch_events(client, heartbeat_seconds=WATCH_REFRESH_SECONDS, deadline=deadline):
            if event.kind == "snapshot":
                reports = {}
                _require_known(args.servers, event.reports, "wait")
            reports.update((r.server_name, r) for r in event.reports)
            watched = [r for name, r in reports.items() if not args.servers or name in args.servers]
            if not need.waiting_for(watched):
                progress.done()
                _print_wait_result(watched, client, args.output)
                return EXIT_OK
            progress.show(need.waiting_for(watched))
            if time.monotonic() >= deadline:
                break
    except HeadUnreachableError:
        progress.done()
        if not reports:
            raise
    progress.done()
    watched = [r for name, r in reports.items() if not args.servers or name in args.servers]
    down = need.waiting_for(watched)
    missing = f"; waiting for {', '.join(down)}" if down and need.counts_instances else ""
    print(f"gym-rpc wait: timed out after {args.timeout:g}s; {summary_line(watched)}{missing}", file=sys.stderr)
    _print_wait_result(watched, client, args.output)
    return EXIT_DOWN if down else EXIT_OK


@dataclass(frozen=True)
class WaitNeed:
    """What `wait` waits for: every server up (the default), or at least `instances` instances of each up and not
    draining, counting only those carrying every label of `labels`."""

    instances: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def counts_instances(self) -> bool:
        return self.instances is not None or bool(self.labels)

    def ready_instances(self, report: StatusReport) -> int:
        members = report.instances or (InstanceReport(instance_id="", url=report.url, status=report.status),)
        return sum(
            1
            for i in members
            if i.status == "success"
            and not i.draining
            and all(i.labels.get(k) == v for k, v in self.labels.items())
        )

    def waiting_for(self, reports: Sequence[StatusReport]) -> list[str]:
        """Each server not there yet, with why: `name (status)`, or `name (1/4 instances up with k=v)`."""
        if not self.counts_instances:
            return [f"{r.server_name} ({r.status or 'pending'})" for r in _not_up(reports)]
        need = self.instances or 1
        with_labels = (
            f" with {','.join(f'{k}={v}' for k, v in sorted(self.labels.items()))}" if self.labels else ""
        )
        return [
            f"{r.server_name} ({ready}/{need} instances up{with_labels})"
            for r in reports
            if (ready := self.ready_instances(r)) < need
        ]


def _print_wait_result(reports: Sequence[StatusReport], client: SyncControlClient, output: str) -> None:
    from gym_rpc.cli._render import render_rows, status_rows, summary_line

    if output == "table":
        print(summary_line(reports), flush=True)
        return
    try:
        instances = _instances(client)
    except GymRpcError:
        instances = []
    print(render_rows(status_rows(reports, instances), output), flush=True)  # type: ignore[arg-type]


class _WaitProgress:
    """What `wait` shows on stderr while it waits: one line redrawn in place on a terminal, a line per change
    otherwise."""

    def __init__(self, timeout: float, deadline: float) -> None:
        self._deadline = deadline
        self._last = ""
        self._live = sys.stderr.isatty()
        if self._live:
            self._draw("gym-rpc wait: waiting for the head")

    def _draw(self, line: str) -> None:
        sys.stderr.write(f"\r\x1b[2K{line}")  # back to the line's start, clear it, draw
        sys.stderr.flush()

    def show(self, waiting: Sequence[str]) -> None:
        names = ", ".join(waiting)
        if self._live:
            left = max(0.0, self._deadline - time.monotonic())
            self._draw(f"gym-rpc wait: waiting for {names} ({left:.0f}s left)")
        elif names != self._last:
            print(f"gym-rpc wait: waiting for {names}", file=sys.stderr, flush=True)
        self._last = names

    def done(self) -> None:
        if self._live:
            self._draw("")
            self._live = False
