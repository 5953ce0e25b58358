"""Where a call goes once one of its attempts was dropped: on a connection of its own, never a pooled one.

A pooled keep-alive connection can be closing as it is reused: its server closed it idle (a keep-alive timeout)
or died, and the close has not reached this process yet. The request written on it is dropped, and the client
cannot tell that drop from a server that read the request and crashed on it, so it counts against the
`dropped_after_write` budget (3 attempts). The other pooled connections to that server are as old and may be
closing too: a resend taking the next one could be dropped the same way, and three such cost the call its budget
in milliseconds. So every attempt after a drop goes out on a new connection, closed after its answer (HTTP
clients such as Go's net/http also resend a request that failed on a reused connection on a new one). The data
layer registers, for each pooled session, its twin that never reuses a connection; a session with none (one a
caller made) is used as it is.

Only a call that was dropped comes here; its first attempt always takes the pool.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import aiohttp

# pooled session -> its twin's getter (which makes the twin on first use): weak, so a closed session is forgotten
_TWINS: weakref.WeakKeyDictionary[aiohttp.ClientSession, Callable[[], aiohttp.ClientSession]] = (
    weakref.WeakKeyDictionary()
)


def register_fresh_twin(session: aiohttp.ClientSession, twin: Callable[[], aiohttp.ClientSession]) -> None:
    """`twin()` gives the session whose connections are never reused, for `session`'s resends after a drop. It
    must not refer to `session` (the weak key would never let it go)."""
    _TWINS[session] = twin


def session_after_drop(session: aiohttp.ClientSession) -> aiohttp.ClientSession:
    """The session for an attempt after a drop: `session`'s twin, or `session` itself when it has none."""
    twin = _TWINS.get(session)
    return session if twin is None else twin()
