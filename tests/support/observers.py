"""A data-plane call observer that records what it is told, for tests of what `send` tells its observers."""

from __future__ import annotations

from typing import Any

import aiohttp


class RecordingObserver:
    """A CallObserver noting what it is told, in order."""

    kind = "recording"

    def __init__(self) -> None:
        self.told: list[tuple[Any, ...]] = []

    def resent(self, attempt: int, kind: str) -> None:
        self.told.append(("resent", attempt, kind))

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None:
        self.told.append(("answered", response, attempts))

    def failed(self, error: BaseException, attempts: int) -> None:
        self.told.append(("failed", error, attempts))
