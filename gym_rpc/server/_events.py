"""What the head tells its operators about, in one place: status changes, reloads, registrations.

Each event is one log line (the text an operator greps for, plus `extra` fields that `--log-format json` keeps as
keys) and, where it counts something, a metric (gym_rpc.server._metrics). The prober, the servicer and the head
call these functions instead of logging themselves, so every event has one wording and one level.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gym_rpc.server import _metrics as metrics
from gym_rpc.wire import StatusReport

logger = logging.getLogger("gym_rpc.head")

SERVER_NAME_KEY = "gym.server.name"
PENDING = "pending"


def probe_stored(previous: StatusReport, report: StatusReport, probes_at_previous: int) -> None:
    """A probe result was stored; `probes_at_previous` probes had given the previous status in a row.

    A change is logged once: WARNING when a server stops answering (or answers differently badly), INFO when it
    comes up or is probed for the first time.
    """
    metrics.probe_recorded(report)
    if previous.status == report.status:
        return
    before, after = previous.status or PENDING, report.status or PENDING
    metrics.status_changed(report.server_name, before, after)
    level = logging.INFO if after == "success" or previous.status is None else logging.WARNING
    detail = f" ({report.detail})" if report.detail and after != "success" else ""
    if previous.status is None:
        message = "%s: %s -> %s on the first probe%s"
        arguments: tuple[object, ...] = (report.server_name, before, after, detail)
    else:
        message = "%s: %s -> %s after %d probes%s"
        arguments = (report.server_name, before, after, probes_at_previous, detail)
    logger.log(
        level,
        message,
        *arguments,
        extra={
            SERVER_NAME_KEY: report.server_name,
            "gym.status.from": before,
            "gym.status.to": after,
            "gym.probes": probes_at_previous,
            "url.full": report.url,
        },
    )


def config_reloaded(
    source: Path | str, old_version: str, new_version: str, added: list[str], removed: list[str]
) -> None:
    """A reload (SIGHUP, ReloadGlobalConfig) that changed the config: one INFO line."""
    changes = [f"added {', '.join(added)}"] if added else []
    changes += [f"removed {', '.join(removed)}"] if removed else []
    logger.info(
        "config reloaded from %s: version %s -> %s%s",
        source,
        old_version,
        new_version,
        f" ({'; '.join(changes)})" if changes else "",
        extra={"gym.config.version": new_version},
    )


def config_unchanged(source: Path | str, version: str) -> None:
    """A reload that found the same config: one INFO line (the operator asked, so the answer is logged)."""
    logger.info(
        "config reload from %s: unchanged (version %s)", source, version, extra={"gym.config.version": version}
    )


def config_refused(source: Path | str, version: str, error: Exception) -> None:
    """A reload whose config was bad: one WARNING line (the head serves on, the old config stays; the caller of
    ReloadGlobalConfig gets the reason too). No traceback: the reason is the operator's file."""
    logger.warning(
        "config reload from %s refused, old config kept (version %s): %s",
        source,
        version,
        error,
        extra={"gym.config.version": version},
    )


def server_registered(name: str, pid: int, url: str, replaced_pid: int | None) -> None:
    """RegisterServerInstance: INFO, naming the process it replaced, if any."""
    replaced = f", replacing pid {replaced_pid}" if replaced_pid is not None and replaced_pid != pid else ""
    logger.info(
        "%s: registered pid %d at %s%s",
        name,
        pid,
        url,
        replaced,
        extra={SERVER_NAME_KEY: name, "process.pid": pid},
    )


def server_renewed(name: str, pid: int, url: str) -> None:
    """RegisterServerInstance that changed nothing but the lease (a renewal, every few seconds): DEBUG only."""
    logger.debug("%s: renewed pid %d at %s", name, pid, url, extra={SERVER_NAME_KEY: name, "process.pid": pid})


def server_deregistered(name: str, pid: int) -> None:
    """DeregisterServerInstance that removed a registration: INFO."""
    logger.info("%s: deregistered pid %d", name, pid, extra={SERVER_NAME_KEY: name, "process.pid": pid})


def server_lease_expired(name: str, pid: int, lease_seconds: float, url: str) -> None:
    """A registration's lease ran out unrenewed (its process likely died without deregistering): WARNING."""
    logger.warning(
        "%s: lease of pid %d expired (not renewed for %gs); dropped, with its advertised address %s",
        name,
        pid,
        lease_seconds,
        url,
        extra={SERVER_NAME_KEY: name, "process.pid": pid},
    )
