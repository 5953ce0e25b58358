"""A client's way to its data-plane sessions, made without importing aiohttp (this module loads with the first
client, asyncio with it): the running loop's sessions are looked up (and aiohttp imported with
gym_rpc.client.data._http) on the first call of each loop, then remembered."""

from __future__ import annotations

from asyncio import get_running_loop
from typing import TYPE_CHECKING

from gym_rpc.client.data._http_settings import HttpClientSettings

if TYPE_CHECKING:
    from gym_rpc.client.data._http import LoopSessions


class HttpPools:
    """A client's way to its sessions: the running loop's, remembered so the hot path skips the registry."""

    __slots__ = ("_last", "settings")

    def __init__(self, settings: HttpClientSettings) -> None:
        self.settings = settings
        self._last: LoopSessions | None = None  # one attribute, so threads with their own loops cannot mix it up

    def sessions(self) -> LoopSessions:
        """The running loop's sessions (RuntimeError outside a loop), open: the ones of the last call, or new."""
        sessions = self._last
        if sessions is None or sessions.loop is not get_running_loop() or sessions.is_closed:
            from gym_rpc.client.data._http import loop_sessions  # the cold path: aiohttp on first use

            sessions = self._last = loop_sessions(self.settings)
        return sessions

    async def close(self) -> None:
        """Close the running loop's sessions for these settings (shared with other clients using them)."""
        self._last = None
        from gym_rpc.client.data._http import close_loop_sessions

        await close_loop_sessions(self.settings)
