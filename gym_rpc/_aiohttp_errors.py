"""The data-plane errors that are aiohttp's types as well, so code that catches aiohttp's keeps catching them.

Apart from gym_rpc.errors (which exports them on first use) because they need aiohttp, which `import gym_rpc`
must not load.
"""

from __future__ import annotations

from typing import Unpack

import aiohttp

from gym_rpc.errors import GivenUpFacts, ResendsExhaustedError


class ServerDroppedError(
    ResendsExhaustedError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, ConnectionResetError
):
    """A connection to a Gym server dropped, and the call was given up on (kind `dropped_before_write` or
    `dropped_after_write`). An aiohttp ServerDisconnectedError and ClientOSError too (what aiohttp raises for a
    drop, and what callers caught before), and a ConnectionError. Its other keywords: GivenUpFacts."""

    def __init__(
        self,
        url: str,
        attempts: int,
        reason: str,
        *,
        kind: str,
        errno: int | None = None,
        **facts: Unpack[GivenUpFacts],
    ) -> None:
        self._record(url, kind, attempts, **facts)
        message = f"{self._story()}: {reason}"
        super().__init__(message)  # ServerDisconnectedError's: args and message
        self.errno = errno  # the OS error's number, as aiohttp's ClientOSError carries it
