"""A client's way to its data-plane sessions, made without importing aiohttp or asyncio: the running loop's
sessions are looked up (and both imported with gym_rpc.client._http) on the first call of each loop, then
remembered."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gym_rpc.client._http_settings import HttpClientSettings

if TYPE_CHECKING:
    from gym_rpc.client._http import LoopSessions


class HttpPools:
    """A client's way to its sessions: the running loop's, remembered so the hot path skips the registry."""

    __slots__ = ("_last", "settings")

    def __init__(self, settings: HttpClientSettings) -> None:
        self.settings = settings
        self._last: LoopSessions | None = None  # one attribute, so threads with their own loops cannot mix it up

    def sessions(self) -> LoopSessions:
        sessions = self._last
        if sessions is None or not sessions.serves_running_loop():
            from gym_rpc.client._http import loop_sessions  # the cold path: aiohttp on first use

            sessions = self._last = loop_sessions(self.settings)
        return sessions

    async def close(self) -> None:
        """Close the running loop's sessions for these settings (shared with other clients using them)."""
        self._last = None
        from gym_rpc.client._http import close_loop_sessions

        await close_loop_sessions(self.settings)
