"""What the `gym-rpc` command prints: status rows, the status table, the one-line summary, and rows as JSON,
JSON lines or YAML.

Imported by the CLI (and the demo) only: `import gym_rpc` or ServerClient in a rollout worker must not pay for
it (tests/cli/test_cli_operability.py checks).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import yaml

from gym_rpc.wire import EngineLoad, InstanceReport, ServerInstance, StatusReport

# The plain text table.
# A plain text table for the CLI, with the little of rich's Table the status table uses (no dependency).
#
# Columns are separated by two spaces, each as wide as its widest cell, no trailing spaces, never wrapped (scripts
# split lines on runs of spaces). A cell may be marked `[green]text[/]`: with colour on, the text is shown in that
# colour (ANSI SGR codes), without it the mark is dropped. The header is bold with colour on.
_MARK = re.compile(r"\[(\w+)\](.*)\[/\]\Z", re.S)
_ANSI = {"bold": "1", "red": "31", "green": "32", "yellow": "33"}
_RESET = "\x1b[0m"


def _styled(text: str, style: str, color: bool) -> str:
    return f"\x1b[{_ANSI[style]}m{text}{_RESET}" if color and style in _ANSI else text


class Table:
    """Columns, then rows of one text per column; `render` joins them into lines."""

    def __init__(self) -> None:
        self._columns: list[str] = []
        self._rows: list[list[tuple[str, str]]] = []  # (plain text, style) per cell

    def add_column(self, header: str) -> None:
        self._columns.append(header)

    def add_row(self, *cells: str) -> None:
        if len(cells) != len(self._columns):
            raise ValueError(f"a row of {len(cells)} cells for {len(self._columns)} columns")
        row = []
        for cell in cells:
            mark = _MARK.match(cell)
            row.append((mark.group(2), mark.group(1)) if mark else (cell, ""))
        self._rows.append(row)

    def render(self, *, color: bool = False) -> str:
        widths = [len(header) for header in self._columns]
        for row in self._rows:
            widths = [max(width, len(text)) for width, (text, _) in zip(widths, row, strict=True)]
        header = "  ".join(_styled(h.ljust(w), "bold", color) for h, w in zip(self._columns, widths, strict=True))
        lines = [header.rstrip()]
        for row in self._rows:
            cells = [
                _styled(text, style, color) + " " * (width - len(text))
                for (text, style), width in zip(row, widths, strict=True)
            ]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)


OutputFormat = Literal["table", "json", "jsonl", "yaml"]
OUTPUT_FORMATS: tuple[OutputFormat, ...] = ("table", "json", "jsonl", "yaml")
TABLE_COLUMNS = ("NAME", "TYPE", "URL", "STATUS", "HTTP", "LATENCY", "LAST CHECKED", "PID", "UPTIME")
# `status -o wide`: a line per instance, with what its registration says (labels) and what its process reported.
WIDE_COLUMNS = (*TABLE_COLUMNS, "LABELS", "IN FLIGHT")
# Shown after the others only when the config has engines (entries with session_affinity_header).
ENGINE_LOAD_COLUMN = "ENGINE LOAD"
# (server name, instance id) -> that engine instance's load as the head last read it
Loads = dict[tuple[str, str], EngineLoad]
UP = "success"
PENDING = "pending"  # shown for a server the head has not probed yet
_STATUS_STYLES = {UP: "green", PENDING: "yellow"}


def status_text(report: StatusReport) -> str:
    return report.status or PENDING


def is_up(report: StatusReport) -> bool:
    return report.status == UP


def duration_text(seconds: float) -> str:
    """A short human duration: 42s, 5m03s, 2h05m, 3d04h."""
    whole = int(max(0.0, seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def instances_up(report: StatusReport) -> int:
    return sum(1 for instance in report.instances if instance.status == UP)


def _started(start_time: float) -> float | None:
    return start_time if start_time > 0 else None


def _probe_fields(probed: StatusReport | InstanceReport) -> dict[str, Any]:
    """The probe result of a server or an instance as JSON/YAML rows show it."""
    return {
        "status": probed.status,
        # any HTTP answer is "success" (a 503 too, as in NeMo Gym): the code itself says whether it was healthy
        "http_status": probed.http_status or None,
        "latency_ms": round(probed.latency_seconds * 1000, 3) if probed.checked_at else None,
        "checked_at": probed.checked_at or None,
        "detail": probed.detail,
    }


def engine_load_fields(load: EngineLoad | None) -> dict[str, Any] | None:
    """An engine instance's load as JSON/YAML rows show it (None: not an engine); null figures are unknown."""
    if load is None:
        return None
    return {
        "waiting": load.waiting,
        "running": load.running,
        "kv_cache_usage": load.kv_cache_usage,
        "age_seconds": None if load.age_seconds is None else round(load.age_seconds, 3),
    }


def engine_load_text(load: EngineLoad | None) -> str:
    """`3 waiting, 5 running, kv 42%` (`?` for a figure unknown); `-` for an instance that is no engine."""
    if load is None:
        return "-"

    def count(value: float | None) -> str:
        return "?" if value is None else f"{value:g}"

    usage = "?" if load.kv_cache_usage is None else f"{load.kv_cache_usage * 100:.0f}%"
    return f"{count(load.waiting)} waiting, {count(load.running)} running, kv {usage}"


def loads_by_instance(loads: Iterable[EngineLoad]) -> Loads:
    return {(load.server_name, load.instance_id): load for load in loads}


def instance_row(
    instance: InstanceReport, row: ServerInstance | None, now: float, load: EngineLoad | None = None
) -> dict[str, Any]:
    """One instance of a server as JSON/YAML output shows it (`in_flight`: the calls its process reported;
    `engine_load`: an engine's queue and cache use, null for other servers)."""
    started = _started(instance.start_time)
    return {
        "instance_id": instance.instance_id,
        "url": instance.url,
        "origin": instance.origin,
        **_probe_fields(instance),
        "registration": instance.registration,
        "draining": instance.draining,
        "labels": dict(instance.labels),
        "in_flight": row.in_flight if row is not None else 0,
        "pid": instance.pid or None,
        "start_time": started,
        "uptime_seconds": round(now - started, 3) if started is not None else None,
        "engine_load": engine_load_fields(load),
    }


def status_row(
    report: StatusReport, rows: Sequence[ServerInstance], now: float, loads: Loads | None = None
) -> dict[str, Any]:
    """One server as JSON/YAML output shows it (`rows`: its ListServerInstances rows, the config instance's first).
    pid, start_time and uptime are null until the server registers; `instances` lists every instance."""
    instance = rows[0] if rows else None
    registered = instance is not None and instance.pid > 0
    started = _started(instance.start_time) if instance is not None else None
    by_id = {row.instance_id: row for row in rows}
    return {
        "name": report.server_name,
        "type": instance.server_type if instance else "",
        "url": report.url,
        **_probe_fields(report),
        "pid": instance.pid if registered and instance is not None else None,
        "start_time": started,
        "uptime_seconds": round(now - started, 3) if started is not None else None,
        "instances_up": instances_up(report),
        "instances": [
            instance_row(i, by_id.get(i.instance_id), now, (loads or {}).get((report.server_name, i.instance_id)))
            for i in report.instances
        ],
    }


def by_name(instances: Iterable[ServerInstance]) -> dict[str, list[ServerInstance]]:
    """ListServerInstances rows grouped by server name, in their order (a server's config instance first)."""
    grouped: dict[str, list[ServerInstance]] = {}
    for instance in instances:
        grouped.setdefault(instance.name, []).append(instance)
    return grouped


def status_rows(
    reports: Iterable[StatusReport],
    instances: Iterable[ServerInstance],
    now: float | None = None,
    engine_loads: Iterable[EngineLoad] = (),
) -> list[dict[str, Any]]:
    moment = time.time() if now is None else now
    rows = by_name(instances)
    loads = loads_by_instance(engine_loads)
    return [status_row(r, rows.get(r.server_name, []), moment, loads) for r in reports]


def _instance_cells(instance: InstanceReport, now: float) -> list[str]:
    """The probe columns of one instance: HTTP, LATENCY, LAST CHECKED, PID, UPTIME."""
    checked = instance.checked_at
    started = instance.start_time
    return [
        str(instance.http_status) if instance.http_status else "-",
        f"{instance.latency_seconds * 1000:.1f} ms" if checked else "-",
        f"{max(0.0, now - checked):.1f}s ago" if checked else "never",
        str(instance.pid) if instance.pid > 0 else "-",
        duration_text(now - started) if started > 0 else "-",
    ]


def _add_replicated(table: Table, report: StatusReport, server_type: str, now: float, loads: Loads | None) -> None:
    """A server of several instances: its row says how many are up, then one row per instance under it."""
    up, total = instances_up(report), len(report.instances)
    style = "green" if up == total else "yellow" if up else "red"
    load_cells = ["-"] if loads is not None else []
    table.add_row(
        report.server_name, server_type, report.url, f"[{style}]{up}/{total} up[/]", *["-"] * 5, *load_cells
    )
    for instance in report.instances:
        text = instance.status or PENDING
        shown = f"{text} (draining)" if instance.draining else text
        style = "yellow" if instance.draining else _STATUS_STYLES.get(text, "red")
        table.add_row(
            f"  {instance.instance_id}",
            instance.origin or "-",
            instance.url,
            f"[{style}]{shown}[/]",
            *_instance_cells(instance, now),
            *_load_cells(loads, report.server_name, instance.instance_id),
        )


def _load_cells(loads: Loads | None, server_name: str, instance_id: str) -> list[str]:
    """The ENGINE LOAD cell of an instance's row, when the table has that column (`loads` is not None)."""
    if loads is None:
        return []
    return [engine_load_text(loads.get((server_name, instance_id)))]


def _table(
    reports: Sequence[StatusReport], instances: Iterable[ServerInstance], now: float, loads: Loads | None
) -> Table:
    table = Table()
    for column in (*TABLE_COLUMNS, ENGINE_LOAD_COLUMN) if loads is not None else TABLE_COLUMNS:
        table.add_column(column)
    rows = {name: found[0] for name, found in by_name(instances).items()}  # each server's config instance row
    for report in reports:
        instance = rows.get(report.server_name)
        if len(report.instances) > 1:
            _add_replicated(table, report, instance.server_type if instance else "-", now, loads)
            continue
        checked = report.checked_at
        text = status_text(report)
        started = instance.start_time if instance is not None and instance.start_time > 0 else 0.0
        table.add_row(
            report.server_name,
            instance.server_type if instance else "-",
            report.url,
            f"[{_STATUS_STYLES.get(text, 'red')}]{text}[/]",
            str(report.http_status) if report.http_status else "-",
            f"{report.latency_seconds * 1000:.1f} ms" if checked else "-",
            f"{max(0.0, now - checked):.1f}s ago" if checked else "never",
            str(instance.pid) if instance is not None and instance.pid > 0 else "-",
            duration_text(now - started) if started else "-",
            *_load_cells(loads, report.server_name, report.instances[0].instance_id if report.instances else ""),
        )
    return table


def format_status_table(
    reports: Sequence[StatusReport],
    instances: Iterable[ServerInstance],
    *,
    now: float | None = None,
    color: bool = False,
    engine_loads: Iterable[EngineLoad] = (),
) -> str:
    """The status table as text: one header line, one line per server (a server of several instances: a line of
    how many are up, then an indented line per instance); cells never empty ("-" instead), columns two spaces
    apart, no trailing spaces. ANSI colours only when `color`. With engines (`engine_loads` not empty) an
    ENGINE LOAD column last: each engine instance's queue, running requests and KV-cache use."""
    moment = time.time() if now is None else now
    loads = loads_by_instance(engine_loads) or None
    return _table(reports, instances, moment, loads).render(color=color)


def labels_text(labels: Mapping[str, str]) -> str:
    """`key=value` pairs, comma-separated and sorted by key; "-" for none."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items())) or "-"


def format_wide_table(
    reports: Sequence[StatusReport],
    instances: Iterable[ServerInstance],
    *,
    now: float | None = None,
    color: bool = False,
) -> str:
    """`status -o wide`: the status table with LABELS and IN FLIGHT, and a line per instance for every server (a
    server of one instance too: its line is the server's, under its name)."""
    moment = time.time() if now is None else now
    table = Table()
    for column in WIDE_COLUMNS:
        table.add_column(column)
    rows = by_name(instances)
    for report in reports:
        found = rows.get(report.server_name, [])
        server_type = found[0].server_type if found else "-"
        by_id = {row.instance_id: row for row in found}
        members = report.instances or (InstanceReport(instance_id="", url=report.url, status=report.status),)
        if len(members) > 1:
            up, total = instances_up(report), len(members)
            style = "green" if up == total else "yellow" if up else "red"
            flights = sum(row.in_flight for row in found)
            table.add_row(
                report.server_name,
                server_type,
                report.url,
                f"[{style}]{up}/{total} up[/]",
                *["-"] * 6,
                str(flights),
            )
        for instance in members:
            text = instance.status or PENDING
            shown = f"{text} (draining)" if instance.draining else text
            style = "yellow" if instance.draining else _STATUS_STYLES.get(text, "red")
            row = by_id.get(instance.instance_id)
            first = len(members) == 1
            table.add_row(
                report.server_name if first else f"  {instance.instance_id}",
                server_type if first else instance.origin or "-",
                instance.url,
                f"[{style}]{shown}[/]",
                *_instance_cells(instance, moment),
                labels_text(instance.labels),
                str(row.in_flight) if row is not None and instance.registration == "registered" else "-",
            )
    return table.render(color=color)


def summary_line(reports: Sequence[StatusReport], allowed_down: Iterable[str] = ()) -> str:
    """`3/4 up`, then the servers that are not (`; down: gone (connection_error)`), exempted ones marked, and those
    the head has not probed yet (`; warming, not probed yet: new`)."""
    allowed = set(allowed_down)
    up = sum(1 for r in reports if is_up(r))
    down = [r for r in reports if not is_up(r) and r.status is not None]
    pending = [r.server_name for r in reports if r.status is None]
    line = f"{up}/{len(reports)} up"
    if down:
        names = ", ".join(
            f"{r.server_name} ({status_text(r)}{', allowed' if r.server_name in allowed else ''})" for r in down
        )
        line += f"; down: {names}"
    if pending:  # the head has not probed them yet (it just started, or they just came): warming, not down
        line += f"; warming, not probed yet: {', '.join(pending)}"
    return line


def render_rows(rows: list[dict[str, Any]], output: OutputFormat) -> str:
    """Rows as one JSON array (json), one object per line (jsonl) or a YAML list; never the table."""
    if output == "json":
        return json.dumps(rows, indent=2, ensure_ascii=False)
    if output == "jsonl":
        return "\n".join(json.dumps(row, ensure_ascii=False) for row in rows)
    if output == "yaml":
        return yaml.safe_dump(rows, sort_keys=False, allow_unicode=True).rstrip("\n")
    raise ValueError(f"render_rows does not render {output!r}")


def render_document(document: Any, output: OutputFormat) -> str:
    """One document (a watch event, the config): pretty JSON, one JSON line, or YAML (table: YAML too)."""
    if output == "json":
        return json.dumps(document, indent=2, ensure_ascii=False)
    if output == "jsonl":
        return json.dumps(document, ensure_ascii=False)
    return yaml.safe_dump(document, sort_keys=False, allow_unicode=True).rstrip("\n")
