"""How the CLI and the demo show server statuses: one table and one JSON row shape, shared by both."""

from __future__ import annotations

import time
from collections.abc import Sequence

from gym_rpc.wire import ServerInstance, StatusReport


def status_text(report: StatusReport) -> str:
    return report.status or "pending"


def status_row(report: StatusReport, instance: ServerInstance | None) -> dict[str, object]:
    return {
        "name": report.server_name,
        "type": instance.server_type if instance else "",
        "url": report.url,
        "status": report.status,
        "latency_ms": round(report.latency_seconds * 1000, 3) if report.checked_at else None,
        "checked_at": report.checked_at or None,
        "detail": report.detail,
    }


def format_status_table(reports: Sequence[StatusReport], instances: dict[str, ServerInstance]) -> str:
    header = ("NAME", "TYPE", "URL", "STATUS", "LATENCY", "LAST CHECKED")
    now = time.time()
    rows = [header]
    for report in reports:
        instance = instances.get(report.server_name)
        checked = report.checked_at
        rows.append(
            (
                report.server_name,
                instance.server_type if instance else "",
                report.url,
                status_text(report),
                f"{report.latency_seconds * 1000:.1f} ms" if checked else "-",
                f"{max(0.0, now - checked):.1f}s ago" if checked else "never",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )
