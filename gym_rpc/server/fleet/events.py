"""What the head tells its operators about, in one place: status changes, reloads, registrations.

Each event is one log line (the text an operator greps for, plus `extra` fields that `--log-format json` keeps as
keys) and, where it counts something, a metric (gym_rpc.server.observability.head_metrics). The prober, the
servicer and the head call these functions instead of logging themselves, so every event has one wording and one
level.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from gym_rpc.server.fleet._server_instances import instance_label
from gym_rpc.server.observability import head_metrics as metrics
from gym_rpc.wire import InstanceRegistration, InstanceReport

logger = logging.getLogger("gym_rpc.head")

SERVER_NAME_KEY = "gym.server.name"
INSTANCE_ID_KEY = "gym.instance.id"
PENDING = "pending"
REPEAT_INTERVAL_SECONDS = 10.0  # the same reload outcome again within this is not logged again


class _Repeats:
    """Which lines were logged in the last interval: a caller repeating the same reload (the same refusal, the same
    unchanged file) in a loop gets its answer each time, the log one line per interval."""

    def __init__(self) -> None:
        self._logged: dict[tuple[object, ...], float] = {}

    def first(self, *key: object) -> bool:
        now = time.monotonic()
        if now - self._logged.get(key, -REPEAT_INTERVAL_SECONDS) < REPEAT_INTERVAL_SECONDS:
            return False
        if len(self._logged) > 64:
            self._logged = {k: t for k, t in self._logged.items() if now - t < REPEAT_INTERVAL_SECONDS}
        self._logged[key] = now
        return True


_repeats = _Repeats()


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
    if previous.status == "success":
        metrics.instance_went_down(name, instance.instance_id)
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
    source: Path | str,
    old_version: str,
    new_version: str,
    added: list[str],
    removed: list[str],
    instances: dict[str, tuple[list[str], list[str]]] | None = None,
) -> None:
    """A reload (SIGHUP, ReloadGlobalConfig) that changed the config: one INFO line, naming the servers added and
    removed, and the instances the config names (its own and its static replicas) added and removed per server."""
    changes = [f"added {', '.join(added)}"] if added else []
    changes += [f"removed {', '.join(removed)}"] if removed else []
    for name, (came, went) in (instances or {}).items():
        moved = [f"+{instance_id}" for instance_id in came] + [f"-{instance_id}" for instance_id in went]
        changes.append(f"instances of {name}: {' '.join(moved)}")
    logger.info(
        "config reloaded from %s: version %s -> %s%s",
        source,
        old_version,
        new_version,
        f" ({'; '.join(changes)})" if changes else "",
        extra={"gym.config.version": new_version},
    )


def config_unchanged(source: Path | str, version: str) -> None:
    """A reload that found the same config: one INFO line (the operator asked, so the answer is logged), once per
    interval."""
    if not _repeats.first("unchanged", str(source), version):
        return
    logger.info(
        "config reload from %s: unchanged (version %s)", source, version, extra={"gym.config.version": version}
    )


def config_refused(source: Path | str, version: str, error: Exception) -> None:
    """A reload whose config was bad: one WARNING line (the head serves on, the old config stays; the caller of
    ReloadGlobalConfig gets the reason too), once per interval for the same reason. No traceback: the reason is the
    operator's file."""
    if not _repeats.first("refused", str(source), version, str(error)):
        return
    logger.warning(
        "config reload from %s refused, old config kept (version %s): %s",
        source,
        version,
        error,
        extra={"gym.config.version": version},
    )


def server_registered(
    name: str,
    instance_id: str,
    registration: InstanceRegistration,
    previous: InstanceRegistration | None,
    instances: int,
) -> None:
    """RegisterServerInstance that changed an instance (`previous`: the registration it replaced or changed): INFO,
    naming the process it replaced, if any, and (when the server has several instances) the instance and how many
    there are."""
    pid, url = registration.pid, registration.advertised_url
    where = f" ({instance_id}, {instances} instances)" if instances > 1 else ""
    if previous is not None and previous.pid == pid:
        message = f"{name}: pid {pid} at {url}{where} {_what_changed(previous, registration)}"
    else:
        replaced = f", replacing pid {previous.pid}" if previous is not None and previous.pid != pid else ""
        message = f"{name}: registered pid {pid} at {url}{where}{replaced}"
    logger.info(message, extra={SERVER_NAME_KEY: name, INSTANCE_ID_KEY: instance_id, "process.pid": pid})


def _what_changed(previous: InstanceRegistration, registration: InstanceRegistration) -> str:
    if previous.draining != registration.draining:
        return "is draining" if registration.draining else "is no longer draining"
    if previous.advertised_url != registration.advertised_url:
        return f"moved from {previous.advertised_url}"
    labels = ", ".join(f"{key}={value}" for key, value in sorted(registration.labels.items()))
    return f"has labels {labels}" if labels else "has no labels"


def server_renewed(name: str, pid: int, url: str) -> None:
    """RegisterServerInstance that changed nothing but the lease (a renewal, every few seconds): DEBUG only."""
    logger.debug("%s: renewed pid %d at %s", name, pid, url, extra={SERVER_NAME_KEY: name, "process.pid": pid})


def server_deregistered(name: str, pid: int, instance_id: str, instances: int) -> None:
    """DeregisterServerInstance that removed a registration: INFO (naming the instance, and how many the server
    has left, when it has several)."""
    left = f" at {instance_id} ({instances} instances left)" if instances > 1 else ""
    logger.info(
        "%s: deregistered pid %d%s",
        name,
        pid,
        left,
        extra={SERVER_NAME_KEY: name, INSTANCE_ID_KEY: instance_id, "process.pid": pid},
    )


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
