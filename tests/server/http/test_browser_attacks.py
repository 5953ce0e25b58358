"""A web browser on the head's machine (issue 26, where the list is silent), against a real `gym-rpc head` with its
HTTP head, metrics and Connect ports: DNS rebinding (a page whose name now resolves to 127.0.0.1, so its requests
carry `Host: <its name>`) is refused 403 on every HTTP-side port of a loopback head and does nothing; cross-origin
requests get no CORS permission (a JSON call's preflight fails), and the requests a page may send without one (a
`text/plain` POST, a GET) change nothing; oversized headers are refused on every port without harm.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import yaml

from gym_rpc.client.control._clients import SyncControlClient
from tests.support.cli import HeadProcess, running_head
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port

RPC = "/gym_rpc.v1.ControlPlaneService/"
REBOUND = "evil.example"  # the page's own name, resolving to 127.0.0.1 once rebound


@contextmanager
def head_with_every_port(tmp_path: Path) -> Iterator[tuple[HeadProcess, dict[str, int]]]:
    config = tmp_path / "gym.yaml"
    config.write_text(yaml.safe_dump(document({"policy": server_entry(closed_port(), host="0.0.0.0")})))
    with running_head(config, "--http-port", "0", "--metrics-port", "0", "--connect-port", "0") as head:
        ports = {
            side: int(match.group(1))
            for side, pattern in {
                "http": r"NeMo Gym HTTP head on http://127\.0\.0\.1:(\d+)",
                "metrics": r"metrics on http://127\.0\.0\.1:(\d+)/metrics",
                "connect": r"Connect on http://127\.0\.0\.1:(\d+)",
            }.items()
            if (match := re.search(pattern, head.banner))
        }
        assert len(ports) == 3, head.banner
        yield head, ports


def http(port: int, request: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP/1.1 exchange (exactly the headers a browser would send); status, headers, body."""
    with socket.create_connection((LOOPBACK, port), timeout=20) as sock:
        sock.sendall(request.encode("latin-1") + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split(" ", 2)[1]), headers, payload


def post(port: int, path: str, host: str, content_type: str, body: bytes, origin: str | None = None) -> str:
    extra = f"Origin: {origin}\r\n" if origin else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )


def test_dns_rebinding_is_refused_on_every_http_side_port(tmp_path: Path) -> None:
    with head_with_every_port(tmp_path) as (head, ports):
        gets = {"http": "/server_instances", "metrics": "/metrics", "connect": "/"}
        for side, port in ports.items():
            rebound = f"GET {gets[side]} HTTP/1.1\r\nHost: {REBOUND}:{port}\r\nConnection: close\r\n\r\n"
            status, _, body = http(port, rebound)
            assert status == 403 and b"not a loopback name" in body, (side, status, body[:200])
        # What the page was after: register itself as `policy` (no token on this head), then read the config.
        register = b'{"serverName": "policy", "listenPort": 8001, "advertiseHost": "10.6.6.6", "pid": 6}'
        for host in (f"{REBOUND}:{ports['connect']}", REBOUND):
            request = post(ports["connect"], RPC + "RegisterServerInstance", host, "application/json", register)
            assert http(ports["connect"], request, register)[0] == 403
        (row,) = [r for r in SyncControlClient(head.address).list_server_instances() if r.name == "policy"]
        assert row.advertised_url == ""  # nothing registered
        # The same calls by loopback names are served (curl, scripts, an SSH tunnel to localhost).
        for host in (
            f"localhost:{ports['connect']}",
            f"127.0.0.1:{ports['connect']}",
            f"[::1]:{ports['connect']}",
        ):
            request = post(ports["connect"], RPC + "ListServerStatuses", host, "application/json", b"{}")
            assert http(ports["connect"], request, b"{}")[0] == 200, host
        status, _, _ = http(ports["http"], "GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        assert status == 200


def test_a_cross_origin_page_gets_no_permission_and_changes_nothing(tmp_path: Path) -> None:
    with head_with_every_port(tmp_path) as (head, ports):
        port, page = ports["connect"], "http://evil.example"
        preflight = (
            f"OPTIONS {RPC}ReloadGlobalConfig HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nOrigin: {page}\r\n"
            f"Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type\r\n"
            f"Connection: close\r\n\r\n"
        )
        status, headers, _ = http(port, preflight)
        assert status >= 400 and "access-control-allow-origin" not in headers  # the JSON call is never sent
        # What a page may send without asking: a form-like POST, a GET. Neither reaches a handler.
        simple = post(port, RPC + "ReloadGlobalConfig", f"127.0.0.1:{port}", "text/plain", b"{}", origin=page)
        status, headers, _ = http(port, simple, b"{}")
        assert status == 415 and "access-control-allow-origin" not in headers
        get = f"GET {RPC}ListServerStatuses?encoding=json&message=%7B%7D HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        status, headers, _ = http(port, get + f"Origin: {page}\r\nConnection: close\r\n\r\n")
        assert status == 405 and "access-control-allow-origin" not in headers
    assert "config reload" not in head.stderr_text  # no reload ran


@pytest.mark.parametrize("side", ["http", "metrics", "connect"])
def test_oversized_headers_are_refused_on_the_http_side(tmp_path: Path, side: str) -> None:
    with head_with_every_port(tmp_path) as (head, ports):
        huge = "X-Big: " + "a" * (1024 * 1024) + "\r\n"
        with socket.create_connection((LOOPBACK, ports[side]), timeout=20) as sock:
            sock.sendall(f"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n{huge}\r\n".encode())
            answer = sock.recv(100)
        assert re.match(rb"HTTP/1\.[01] (400|413|431) ", answer), answer
        assert SyncControlClient(head.address).head_status() == "success"


def test_oversized_metadata_is_refused_on_the_grpc_port(tmp_path: Path) -> None:
    with head_with_every_port(tmp_path) as (head, _):
        with grpc.insecure_channel(head.address) as channel:
            call = channel.unary_unary(RPC + "ListServerStatuses", None, None)
            with pytest.raises(grpc.RpcError) as caught:
                call(b"", timeout=10, metadata=(("x-big", "a" * (1024 * 1024)),))
        assert caught.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL)
        assert SyncControlClient(head.address).head_status() == "success"
    assert "Traceback" not in head.stderr_text
