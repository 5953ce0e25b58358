"""The log of failing data-plane calls: at most one line per server (and instance URL) per interval, whatever the
rate. Ten thousand rollouts hitting one dead server write one line at the first failure, then at most one line per
interval with the counts since the last: attempts resent by the kind of their failure, calls given up by the kind
and what ended their resends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gym_rpc.errors import ResendsExhaustedError

logger = logging.getLogger("gym_rpc.client._resend_log")  # its name from before the move (docs/failures.md)
LOG_INTERVAL_SECONDS = 30.0


@dataclass
class _Tally:
    logged_at: float | None = None  # None: no line yet
    resent: Counter[str] = field(default_factory=Counter)
    given_up: Counter[str] = field(default_factory=Counter)


class ResendLog:
    """Counts failures per (server, instance) and writes a line when its interval has passed since the last one."""

    def __init__(self, interval_seconds: float = LOG_INTERVAL_SECONDS, log: logging.Logger = logger) -> None:
        self.interval_seconds = interval_seconds
        self._log = log
        self._tallies: dict[tuple[str, str], _Tally] = {}
        self._lock = threading.Lock()

    def resent(self, server_name: str, url: str, kind: str) -> None:
        """An attempt of a call to `url` failed with `kind`, and the call is resent."""
        self._count(server_name, url, kind, None)

    def gave_up(self, error: ResendsExhaustedError) -> None:
        self._count(error.server_name, error.url, None, f"{error.kind} ({error.limit})")

    def _count(self, server_name: str, url: str, kind: str | None, given_up: str | None) -> None:
        parts = urlsplit(url)
        key = (server_name, f"{parts.scheme}://{parts.netloc}")
        now = time.monotonic()
        with self._lock:
            tally = self._tallies.get(key)
            if tally is None:
                if len(self._tallies) >= 4096:  # a bound on instances remembered (then they start afresh)
                    self._tallies.clear()
                tally = self._tallies[key] = _Tally()
            if kind is not None:
                tally.resent[kind] += 1
            if given_up is not None:
                tally.given_up[given_up] += 1
            last = tally.logged_at
            if last is not None and now - last < self.interval_seconds:
                return
            resent, gone = tally.resent, tally.given_up
            tally.logged_at, tally.resent, tally.given_up = now, Counter(), Counter()
        named = f"server {key[0]!r} at {key[1]}" if key[0] else key[1]
        self._log.warning(
            "%s: %s failed attempt(s) resent%s and %s call(s) given up%s%s (http_client.retry; one line per "
            "server per %g s)",
            named,
            resent.total(),
            f" ({_counts(resent)})" if resent else "",
            gone.total(),
            f" ({_counts(gone)})" if gone else "",
            "" if last is None else f" in the last {now - last:.0f} s",
            self.interval_seconds,
        )


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{name} {count}" for name, count in counter.most_common())


RESEND_LOG = ResendLog()
