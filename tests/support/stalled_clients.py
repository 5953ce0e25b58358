"""Clients that stop reading, for attacks on the head: a raw HTTP/2 connection (the `h2` package) that opens gRPC
server streams with a receive window of 0, so the head can send them nothing and every write to them waits for
good. Blocking sockets with timeouts: nothing here waits without a bound, and `close()` ends it all.
"""

from __future__ import annotations

import socket
import struct
import time

import h2.config
import h2.connection
import h2.events
import h2.settings


def grpc_frame(message: bytes) -> bytes:
    """One gRPC length-prefixed message (uncompressed)."""
    return struct.pack(">BI", 0, len(message)) + message


class StalledHttp2Client:
    """One HTTP/2 connection whose streams never get a byte of window: the peer may send headers, never data.

    `open_stream` starts a gRPC call (a whole request, then nothing more); the connection is read only when the
    test asks (`read_events`), never to give window back."""

    def __init__(self, host: str, port: int, *, source: str | None = None, timeout: float = 10.0) -> None:
        """Connect to host:port, from the loopback address `source` when given (127.0.0.2, ...)."""
        address = (source, 0) if source is not None else None
        self.sock = socket.create_connection((host, port), timeout=timeout, source_address=address)
        self.authority = f"{host}:{port}"
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self.connection = h2.connection.H2Connection(config=config)
        self.connection.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
        )
        self.connection.initiate_connection()
        self._flush()

    def _flush(self) -> None:
        data = self.connection.data_to_send()
        if data:
            self.sock.sendall(data)

    def open_stream(self, method: str, request: bytes, metadata: tuple[tuple[str, str], ...] = ()) -> int:
        """Start the gRPC call `method` ("/pkg.Service/Method") with the serialised `request`; its stream id."""
        stream_id = self.connection.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", method),
            (":authority", self.authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *metadata,
        ]
        self.connection.send_headers(stream_id, headers)
        self.connection.send_data(stream_id, grpc_frame(request), end_stream=True)
        self._flush()
        return stream_id

    def read_events(self, seconds: float) -> list[h2.events.Event]:
        """What arrives within `seconds` (acknowledging settings and pings, as any client does), granting no
        window: DATA frames stay unacknowledged."""
        self.sock.settimeout(seconds)
        events: list[h2.events.Event] = []
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            return events
        if chunk:
            events = self.connection.receive_data(chunk)
            self._flush()
        return events

    def grant_window(self, stream_id: int, size: int = 1 << 20) -> None:
        """Come back to life: let the head send `size` bytes on the stream (and on the connection)."""
        self.connection.increment_flow_control_window(size)
        self.connection.increment_flow_control_window(size, stream_id)
        self._flush()

    def trailers_of(self, stream_id: int, timeout: float) -> dict[str, str]:
        """Read (granting back what arrives) until the stream's trailers come; fails after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no trailers on stream {stream_id} within {timeout}s"
            for event in self.read_events(min(remaining, 0.5)):
                if isinstance(event, h2.events.DataReceived) and event.stream_id == stream_id:
                    self.connection.acknowledge_received_data(event.flow_controlled_length, stream_id)
                    self._flush()
                elif isinstance(event, h2.events.TrailersReceived) and event.stream_id == stream_id:
                    return {str(k): str(v) for k, v in event.headers}
                elif isinstance(event, h2.events.StreamReset) and event.stream_id == stream_id:
                    raise AssertionError(f"stream {stream_id} was reset ({event.error_code!r}), not ended")

    def close(self) -> None:
        self.sock.close()
