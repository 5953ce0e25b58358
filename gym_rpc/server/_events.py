"""What the head tells its operators about, in one place: status changes, reloads, registrations.

Each event is one log line (the text an operator greps for, plus `extra` fields that `--log-format json` keeps as
keys) and, where it counts something, a metric (gym_rpc.server._metrics). The prober, the servicer and the head
call these functions instead of logging themselves, so every event has one wording and one level.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gym_rpc.server import _metrics as metrics
from gym_rpc.server._instances import instance_label
from gym_rpc.wire import InstanceReport

logger = logging.getLogger("gym_rpc.head")

SERVER_NAME_KEY = "gym.server.name"
INSTANCE_ID_KEY = "gym.instance.id"
PENDING = "pending"


def probe_stored(
    name: str, previous: InstanceReport, instance: InstanceReport, probes_at_previous: int, instances: int
) -> None:
    """A probe result of an instance was stored; `probes_at_previous` probes had given the previous status in a
    row; the server has `instances` instances.

    A change is logged once: WARNING when an instance stops answering (or answers differently badly), INFO when it
    comes up or is probed for the first time. A server of one instance is named alone, as before replicas; one of
    several instances is named with its instance id.
    """
    metrics.probe_recorded(name, instance)
    if previous.status == instance.status:
        return
    before, after = previous.status or PENDING, instance.status or PENDING
    metrics.status_changed(name, before, after)
    level = logging.INFO if after == "success" or previous.status is None else logging.WARNING
    detail = f" ({instance.detail})" if instance.detail and after != "success" else ""
    label = instance_label(name, instance.instance_id, instances)
    if previous.status is None:
        message = "%s: %s -> %s on the first probe%s"
        arguments: tuple[object, ...] = (label, before, after, detail)
    else:
        message = "%s: %s -> %s after %d probes%s"
        arguments = (label, before, after, probes_at_previous, detail)
    logger.log(
        level,
        message,
        *arguments,
        extra={
            SERVER_NAME_KEY: name,
            INSTANCE_ID_KEY: instance.instance_id,
            "gym.status.from": before,
            "gym.status.to": after,
            "gym.probes": probes_at_previous,
            "url.full": instance.url,
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
