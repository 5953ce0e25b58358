"""Where the control-plane server's config comes from: the one thing the head and the bridge do differently.

`FileSource` reads a YAML file (at start, and again on SIGHUP or ReloadGlobalConfig): that is `gym-rpc head`. A
reload of an unchanged file costs a read and a hash: the same bytes as last time (served, or refused) give the same
answer without a parse. A changed file is taken only once its size and mtime have held still for STABLE_SECONDS,
longer than editors and `cp` pause mid-write, and only if they still hold after the read: a file cut off mid-write
is not served. Writing the new file elsewhere and renaming it into place (`mv`, which is atomic) is the safe way.
`gym_rpc.server._bridge.UpstreamSource` fetches from an unmodified NeMo Gym HTTP head on an interval: that is
`gym-rpc bridge`. All else (serving, security, prober, health, watches, HTTP head) is `HeadServer`'s, shared.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc

from gym_rpc.config import GlobalConfig, config_from_bytes, read_config_file
from gym_rpc.errors import ConfigError
from gym_rpc.server.security import ServerSecurity
from gym_rpc.wire import ReportedProcess

logger = logging.getLogger(__name__)

STABLE_SECONDS = 1.0  # a changed file's size and mtime must hold still this long before a reload takes it
STABILITY_POLL_SECONDS = 0.1
MAX_STABILITY_WAIT_SECONDS = 15.0  # a file still changing after this is refused (the old config stays)


class ConfigTarget(Protocol):
    """What a source feeds: the server (`HeadServer`), as far as a source needs it."""

    config: GlobalConfig
    problem: str | None

    def served(self, config: GlobalConfig) -> GlobalConfig: ...

    async def apply_config(self, config: GlobalConfig) -> bool: ...

    async def set_problem(self, problem: str | None) -> None: ...


class ConfigSource(Protocol):
    """What `HeadServer` asks of its config source."""

    name: Path | str  # what logs call it: the file, or the upstream URL

    @property
    def processes(self) -> Mapping[str, ReportedProcess]:
        """pid and start time per server name, as the source reports them (empty: it reports none)."""
        ...

    def interceptors(self) -> Sequence[grpc.aio.ServerInterceptor[Any, Any]]:
        """Interceptors the source adds to the server (the bridge refuses calls while its upstream is away)."""
        ...

    def check(self, config: GlobalConfig) -> None:
        """Refuse the config the server starts with, naming what is wrong (ConfigError)."""
        ...

    async def start(self, head: ConfigTarget) -> None:
        """Begin feeding `head` (after it serves): `head.apply_config` for each new config, `head.set_problem`."""
        ...

    async def stop(self) -> None: ...

    async def reload(self, head: ConfigTarget) -> bool:
        """Load the config now (SIGHUP, ReloadGlobalConfig); True when it changed; ConfigError keeps the old."""
        ...


class FileSource:
    """The head's config file; without a file (the embedded config) there is nothing to reload."""

    def __init__(self, path: Path | None, loaded: bytes | None = None) -> None:
        """`loaded`: the bytes of `path` the head's first config was made from, when the caller read them (then
        even the first reload of the unchanged file costs a hash, not a parse)."""
        self.path = path
        self.name: Path | str = path if path is not None else "the embedded config"  # what logs call this source
        self.processes: Mapping[str, ReportedProcess] = {}
        self._lock = asyncio.Lock()
        # The digest of the bytes last loaded, and the refusal they got (None: they were served or unchanged).
        self._last: tuple[str, ConfigError | None] | None = None
        if loaded is not None:
            self._last = (hashlib.sha256(loaded).hexdigest(), None)

    def interceptors(self) -> Sequence[grpc.aio.ServerInterceptor[Any, Any]]:
        return ()

    def check(self, config: GlobalConfig) -> None:
        self._validate(config)
        self._warn_malformed(config, known={})

    def _validate(self, config: GlobalConfig) -> None:
        """What start-up and every reload check alike (token, TLS files); errors name the file."""
        try:
            ServerSecurity.from_config(config)
        except ConfigError as exc:
            where = str(self.path) if self.path is not None else ""
            named = f"{where}: {exc}" if where and not str(exc).startswith(where) else str(exc)
            raise ConfigError(named) from None

    @staticmethod
    def _warn_malformed(config: GlobalConfig, known: Mapping[str, str]) -> None:
        for name, problem in config.malformed_servers.items():
            if name not in known:
                logger.warning("config entry %r is not served: %s", name, problem)

    async def start(self, head: ConfigTarget) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def reload(self, head: ConfigTarget) -> bool:
        """Re-read the file; True when its content changed. A bad file keeps the old config."""
        path = self.path
        if path is None:
            return False
        async with self._lock:
            data = await asyncio.to_thread(read_config_file, path)
            digest = hashlib.sha256(data).hexdigest()
            if self._last is not None and self._last[0] == digest:  # the same bytes: the same answer, no parse
                if self._last[1] is not None:
                    raise ConfigError(str(self._last[1]))
                return False
            data = await _stable_bytes(path)
            digest = hashlib.sha256(data).hexdigest()
            try:
                loaded = await asyncio.to_thread(config_from_bytes, data, path)
                unchanged = head.served(loaded).version == head.config.version
                if not unchanged:
                    self._validate(loaded)
                    self._refuse_served_turned_malformed(loaded, head.config)
            except ConfigError as exc:
                self._last = (digest, exc)
                raise
            self._last = (digest, None)
            if unchanged:
                return False
            self._warn_malformed(loaded, known=head.config.malformed_servers)
            return await head.apply_config(loaded)

    def _refuse_served_turned_malformed(self, config: GlobalConfig, current: GlobalConfig) -> None:
        """A server being served may not turn malformed: it would vanish silently."""
        served_broken = {n: p for n, p in config.malformed_servers.items() if n in current.servers}
        if served_broken:
            name, problem = next(iter(served_broken.items()))
            raise ConfigError(
                f"{self.path}: server {name!r} is served but its new entry is malformed ({problem}); "
                f"fix the entry, or delete the key to stop serving it"
            )


def _file_state(path: Path) -> tuple[int, int, int, int]:
    """What changes when a file is written or replaced: size, mtime, inode, device."""
    try:
        status = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    return status.st_size, status.st_mtime_ns, status.st_ino, status.st_dev


async def _stable_bytes(path: Path) -> bytes:
    """The file's bytes once its size and mtime have held still for STABLE_SECONDS (on the monotonic clock) and
    still hold after the read; a ConfigError when it keeps changing for MAX_STABILITY_WAIT_SECONDS."""
    deadline = time.monotonic() + MAX_STABILITY_WAIT_SECONDS
    state, since = _file_state(path), time.monotonic()
    while True:
        await asyncio.sleep(STABILITY_POLL_SECONDS)
        now = _file_state(path)
        if now != state:
            state, since = now, time.monotonic()
        elif time.monotonic() - since >= STABLE_SECONDS:
            data = await asyncio.to_thread(read_config_file, path)
            if _file_state(path) == state:
                return data
            state, since = _file_state(path), time.monotonic()  # written during the read: wait again
        if time.monotonic() > deadline:
            raise ConfigError(
                f"{path}: still being written (its size or mtime changed within the last {STABLE_SECONDS:g} s for "
                f"{MAX_STABILITY_WAIT_SECONDS:g} s); write the new config to another file and rename it into place"
            )
