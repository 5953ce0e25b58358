"""A direct status probe of a server's base URL, as NeMo Gym's `poll_for_status` makes it: any HTTP answer is up.

Standard library only (http.client), so the client can probe without loading gRPC: `ServerClient.poll_for_status`
against NeMo Gym's HTTP head, or while a gym_rpc head is unreachable. The probe ends at its timeout whatever the
server does (a dripping answer included), and reads at most MAX_PROBE_BODY_BYTES of the body: an answer is an
answer, however long (gym_rpc.client.nemo_gym._bounded_get).
"""

from __future__ import annotations

import dataclasses
import http.client
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from gym_rpc.client.nemo_gym._bounded_get import bounded_get
from gym_rpc.wire import ServerStatus

MAX_PROBE_BODY_BYTES = 64 * 1024


@dataclass(frozen=True)
class ProbeResult:
    """One direct status probe of a server's base URL."""

    status: ServerStatus
    http_status: int = 0  # the code it answered; 0 when none came
    latency_seconds: float = 0.0
    checked_at: float = 0.0  # epoch seconds
    detail: str = ""


def probe(url: str, timeout: float) -> ProbeResult:
    """GET `url`: any HTTP answer is "success" (a 503 too), refused "connection_error", none (or not all of its
    first MAX_PROBE_BODY_BYTES) within `timeout` "timeout", anything else "unknown_error" (NeMo Gym's rule)."""
    parts = urlsplit(url)
    started, checked_at = time.perf_counter(), time.time()
    try:
        answer = bounded_get(
            parts.hostname or "", parts.port, parts.path or "/", timeout=timeout, max_body=MAX_PROBE_BODY_BYTES
        )
        result = ProbeResult("success", answer.status)
    except TimeoutError:
        result = ProbeResult("timeout", detail=f"no answer within {timeout:g} s")
    except ConnectionError as exc:
        result = ProbeResult("connection_error", detail=str(exc))
    except (OSError, http.client.HTTPException) as exc:
        result = ProbeResult("unknown_error", detail=str(exc) or type(exc).__name__)
    return dataclasses.replace(result, latency_seconds=time.perf_counter() - started, checked_at=checked_at)
