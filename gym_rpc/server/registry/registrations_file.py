"""Registrations kept across a head restart: an atomic file beside the config, written on change, read at start.

A head that restarts (a crash, `kill -9`, an upgrade) would otherwise know only its config's instances until every
registered process renews, and workers following it would drop live instances in the meantime (their rollouts
moved, their calls failed). With the file, the restarted head lists every instance it had from its first answer
on, each with a fresh lease: a process that is still alive renews it as usual, one that died meanwhile is probed
down in the first round and expires one lease later, as it would have had the head stayed up.

The file is written by a background task at most every `interval` seconds after a change (a renewal is no change),
to a temporary file in the same folder, flushed to disk, then renamed over the old one: a crash leaves the old file
or the new one, never half of one. A missing, unreadable or foreign file starts the head with no registrations and
one WARNING line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gym_rpc._tasks import cancel_and_wait
from gym_rpc.wire import InstanceRegistration

logger = logging.getLogger("gym_rpc.server._registrations_file")  # its name from before the move

FORMAT = "gym-rpc registrations v1"
SUFFIX = ".registrations.json"
DEFAULT_INTERVAL_SECONDS = 0.2
_FIELDS = (
    "server_name",
    "pid",
    "start_time",
    "listen_host",
    "port",
    "advertised_host",
    "lease_ttl",
    "draining",
    "server_type",
    "peer_host",
)


def beside(config_path: Path) -> Path:
    """Where a head serving `config_path` keeps its registrations: `<config>.registrations.json`."""
    return config_path.with_name(config_path.name + SUFFIX)


def encode(entries: Iterable[tuple[str, InstanceRegistration]]) -> bytes:
    """The file's bytes for (instance id, registration) pairs; lease times and calls in flight are not kept."""
    rows = []
    for instance_id, registration in entries:
        row: dict[str, Any] = {field: getattr(registration, field) for field in _FIELDS}
        row["instance_id"] = instance_id
        row["labels"] = dict(registration.labels)
        rows.append(row)
    return json.dumps({"format": FORMAT, "registrations": rows}, sort_keys=True, indent=1).encode()


def decode(data: bytes, now: float) -> list[tuple[str, InstanceRegistration]]:
    """(instance id, registration) pairs from the file's bytes, each with a fresh lease from `now`
    (time.monotonic()); ValueError when the bytes are no registrations file."""
    document = json.loads(data)
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT!r} file")
    entries = []
    for row in document.get("registrations", []):
        fields = {field: row[field] for field in _FIELDS}
        labels = row.get("labels", {})
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            raise ValueError("labels must map strings to strings")
        registration = InstanceRegistration(**fields, registered_at=now, labels=labels)
        entries.append((str(row["instance_id"]), registration))
    return entries


def read(path: Path) -> list[tuple[str, InstanceRegistration]]:
    """The registrations in `path` (none when it does not exist; none and a WARNING when it cannot be read)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as error:
        logger.warning("cannot read the registrations kept in %s (%s); starting without them", path, error)
        return []
    try:
        return decode(data, time.monotonic())
    except (ValueError, KeyError, TypeError) as error:
        logger.warning("%s holds no registrations this head can read (%s); starting without them", path, error)
        return []


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: a temporary file beside it, flushed to disk, renamed over it."""
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


class RegistrationsFile:
    """Keeps `path` equal to what `entries()` returns, rewritten at most every `interval` s after `changed()`."""

    def __init__(
        self,
        path: Path,
        entries: Callable[[], Iterable[tuple[str, InstanceRegistration]]],
        interval: float = DEFAULT_INTERVAL_SECONDS,
    ) -> None:
        self.path = path
        self._entries = entries
        self._interval = interval
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._written: bytes | None = None
        self.writes = 0
        self._warned = False
        self._writing = threading.Lock()

    def changed(self) -> None:
        self._dirty.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="gym_rpc registrations file")

    async def stop(self) -> None:
        """Stop the writer, writing what changed last (a clean stop keeps everything)."""
        await cancel_and_wait(self._task)
        self._task = None
        if self._dirty.is_set():
            self._write()

    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            data = encode(self._entries())
            if data != self._written:
                # The disk's time (fsync) is a thread's: the head's loop serves on meanwhile.
                await asyncio.to_thread(self._write_data, data)
            await asyncio.sleep(self._interval)

    def _write(self) -> None:
        self._dirty.clear()
        self._write_data(encode(self._entries()))

    def _write_data(self, data: bytes) -> None:
        with self._writing:  # a stop's last write waits for the one a thread may still be making
            self._write_locked(data)

    def _write_locked(self, data: bytes) -> None:
        if data == self._written:
            return
        try:
            write_atomically(self.path, data)
        except OSError as error:  # a read-only folder, a full disk: said once, then the head serves on without it
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
            logger.log(
                level, "cannot keep the registrations in %s (%s); a restart will not know them", self.path, error
            )
            return
        self._written = data
        self.writes += 1
