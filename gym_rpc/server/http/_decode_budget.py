"""A CPU budget for decoding Connect requests, so callers of the Connect port cannot take the event loop that also
serves gRPC and runs the prober.

connectrpc decompresses and parses a request body on the event loop, and JSON costs about a hundred times more per
byte than gRPC's protobuf (a 64 KiB object of small keys takes ~17 ms). The Connect port bounds each request
(`MAX_CONNECT_REQUEST_BYTES`, decompressed) and charges the time each decompression and parse takes to its
client (every loopback address one client) and to the port as a whole: token buckets refilled at `per_client` and
`total` seconds per second. A request from a client, or to a port, whose bucket is empty is refused
RESOURCE_EXHAUSTED before its body is read. So decoding takes at most that share of the loop, whatever the callers
send.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from gym_rpc.errors import MAX_QUOTED_CHARACTERS

DEFAULT_CLIENT_SECONDS_PER_SECOND = 0.05  # 5 % of the loop for one client's request decoding
DEFAULT_TOTAL_SECONDS_PER_SECOND = 0.2  # 20 % for all of them together
BURST_SECONDS = 0.5  # a bucket holds this much: a quiet client may decode a burst
MAX_TRACKED_CLIENTS = 4096  # buckets kept; full ones (idle clients) are forgotten past this

_charged: contextvars.ContextVar[tuple[_Bucket, ...]] = contextvars.ContextVar("gym_rpc_decode_budget", default=())


class _Bucket:
    """Seconds of decoding a client may still spend, refilled at `rate` per second up to BURST_SECONDS."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._level = BURST_SECONDS
        self._stamp = time.monotonic()

    def level(self) -> float:
        now = time.monotonic()
        self._level = min(BURST_SECONDS, self._level + (now - self._stamp) * self.rate)
        self._stamp = now
        return self._level

    def charge(self, seconds: float) -> None:
        self.level()
        self._level -= seconds


class DecodeBudget:
    """The buckets of one Connect port; `codec` and `compression` wrap connectrpc's to charge them."""

    def __init__(
        self,
        per_client: float = DEFAULT_CLIENT_SECONDS_PER_SECOND,
        total: float = DEFAULT_TOTAL_SECONDS_PER_SECOND,
    ) -> None:
        self._per_client = per_client
        self._total = _Bucket(total)
        self._clients: dict[str, _Bucket] = {}

    def refusal(self, client: str) -> str | None:
        """Why a request from `client` may not be decoded now; None when it may."""
        if self._total.level() <= 0:
            return "the head's Connect port is busy decoding requests; retry in a second"
        bucket = self._clients.get(client)
        if bucket is not None and bucket.level() <= 0:
            return f"{client} sent more to decode than the head takes from one client; retry in a second"
        return None

    def charge_to(self, client: str) -> None:
        """Charge the decoding done from now on in this context (the request's task) to `client` and the total."""
        bucket = self._clients.get(client)
        if bucket is None:
            if len(self._clients) >= MAX_TRACKED_CLIENTS:
                self._clients = {k: b for k, b in self._clients.items() if b.level() < BURST_SECONDS}
            bucket = self._clients[client] = _Bucket(self._per_client)
        _charged.set((bucket, self._total))

    def codec(self, codec: Any) -> Any:
        return _ChargedCodec(codec)

    def compression(self, compression: Any) -> Any:
        return _ChargedCompression(compression)


@contextlib.contextmanager
def _charge() -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        spent = time.perf_counter() - started
        for bucket in _charged.get():
            bucket.charge(spent)


class _ChargedCodec:
    """A connectrpc codec whose decoding is charged to the current request's buckets, and whose errors quote the
    caller's body in part only (a parser names the unknown field it met, which may be 64 KiB long)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def name(self) -> str:
        return str(self._inner.name())

    def encode(self, message: Any) -> bytes:
        return bytes(self._inner.encode(message))

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        with _charge():
            try:
                return self._inner.decode(data, message_class)
            except ConnectError:
                raise
            except Exception as exc:
                problem = str(exc)
                if len(problem) > MAX_QUOTED_CHARACTERS:
                    problem = f"{problem[:MAX_QUOTED_CHARACTERS]}... ({len(problem)} characters)"
                raise ConnectError(Code.INVALID_ARGUMENT, f"unmarshal message: {problem}") from None


class _ChargedCompression:
    """A connectrpc compression whose decompression is charged to the current request's buckets."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def name(self) -> str:
        return str(self._inner.name())

    def compress(self, data: bytes | bytearray | memoryview) -> bytes:
        return bytes(self._inner.compress(data))

    def decompress(self, data: bytes | bytearray | memoryview, read_max_bytes: int | None = None) -> bytes:
        with _charge():
            return bytes(self._inner.decompress(data, read_max_bytes))
