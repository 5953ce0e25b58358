"""Server status: the four probe results NeMo Gym knows, and one HTTP probe that yields them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Literal, get_args

import aiohttp

ServerStatus = Literal["success", "connection_error", "timeout", "unknown_error"]
SERVER_STATUSES: tuple[ServerStatus, ...] = get_args(ServerStatus)


@dataclass(frozen=True)
class StatusReport:
    """One server's probe result. `status` is None until the server has been probed once."""

    server_name: str
    status: ServerStatus | None
    url: str
    latency_seconds: float = 0.0
    checked_at: float = 0.0  # epoch seconds; 0 when never checked
    detail: str = ""
    http_status: int = 0


def new_probe_session(max_connections: int = 100) -> aiohttp.ClientSession:
    """A session for probes: a fresh connection per probe (a pooled one would hide a restarted or dead
    server behind a stale socket), no proxies, no cookies."""
    connector = aiohttp.TCPConnector(limit=max_connections, force_close=True)
    return aiohttp.ClientSession(connector=connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar())


async def probe(session: aiohttp.ClientSession, server_name: str, url: str, timeout: float) -> StatusReport:
    """GET the server's base URL. Any HTTP answer, a 500 included, is success (as NeMo Gym does)."""
    started = time.monotonic()
    status: ServerStatus
    http_status = 0
    detail = ""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=max(timeout, 0.001))) as response:
            http_status = response.status
        status = "success"
    except aiohttp.ClientConnectorError as exc:
        status, detail = "connection_error", str(exc.os_error or exc)
    except (TimeoutError, aiohttp.ServerTimeoutError):
        status, detail = "timeout", f"no answer within {timeout:.3g}s"
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        status, detail = "unknown_error", f"{type(exc).__name__}: {exc}"
    return StatusReport(
        server_name=server_name,
        status=status,
        url=url,
        latency_seconds=time.monotonic() - started,
        checked_at=time.time(),
        detail=detail,
        http_status=http_status,
    )
