"""Hostile rollout ids against a real receiving server (issue 26, point 7): an aiohttp server in a subprocess,
with TraceContextPathMiddleware first and a handler that names a file after the rollout id (as NeMo Gym keeps
per-rollout files), is sent ids with `/`, `..`, control characters, NUL and bidi controls over a raw socket (no
client to tidy them up): each is answered 400 and no file is written. With a path guard listed before it the
middleware warns once that it is not first, and the guard can be walked past, which is why it must be first.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.support import REPO_ROOT
from tests.support.cli import STARTUP_SECONDS, cli_env
from tests.support.loopback import LOOPBACK

SERVER_SCRIPT = """
import asyncio, logging, pathlib, sys
from aiohttp import web
from gym_rpc.integrations import TraceContextPathMiddleware

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
files = pathlib.Path(sys.argv[1])

async def record(request):
    rollout_id = request.get("rollout_id")
    (files / f"{rollout_id}.log").write_text(request.path)  # a handler keyed by the rollout id
    return web.Response(text=f"{rollout_id} {request.path}")

@web.middleware
async def guard(request, handler):  # a path guard: nobody reaches /admin
    if request.path.startswith("/admin"):
        return web.Response(status=403, text="forbidden")
    return await handler(request)

middleware = TraceContextPathMiddleware.aiohttp()
order = [guard, middleware] if sys.argv[2] == "guard-first" else [middleware, guard]

async def main():
    app = TraceContextPathMiddleware.install(web.Application(middlewares=order))
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""

HOSTILE_SEGMENTS = [
    "r%2F1",
    "..",
    "%2E%2E",
    "..%2F..%2Fetc%2Fpasswd",
    "r%00",
    "r%0D%0AX-Injected:%201",
    "r%1B%5B31m",  # an ANSI escape
    "r%7F",
    "%E2%80%AEgpj.exe",  # RIGHT-TO-LEFT OVERRIDE
    "r%E2%81%A7x",  # FIRST STRONG ISOLATE
    "r%C2%85",  # NEXT LINE (a C1 control)
    ".hidden",
    "r%201",
]


@contextlib.contextmanager
def receiving_server(files: Path, order: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, str(files), order],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**cli_env(), "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        line = process.stdout.readline()  # the port, once it serves (bounded by the test's own timeout)
        assert line.strip().isdigit(), (line, process.stderr.read() if process.poll() is not None else "")
        yield process, int(line)
    finally:
        process.kill()
        process.wait(timeout=10)


def raw_get(port: int, path: str) -> tuple[int, bytes]:
    """GET `path` exactly as written (no client normalisation); the status and the body."""
    with socket.create_connection((LOOPBACK, port), timeout=STARTUP_SECONDS) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: server\r\nConnection: close\r\n\r\n".encode("latin-1"))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_hostile_rollout_ids_are_answered_400_and_never_reach_the_handler(tmp_path: Path) -> None:
    files = tmp_path / "rollouts"
    files.mkdir()
    with receiving_server(files, "middleware-first") as (server, port):
        for segment in HOSTILE_SEGMENTS:
            status, body = raw_get(port, f"/ng-rollout/{segment}/verify")
            assert status == 400, (segment, body)
            assert b"\x00" not in body and b"\r\nX-Injected" not in body and "\u202e".encode() not in body
        assert raw_get(port, "/ng-rollout/task-3.r_1/verify") == (200, b"task-3.r_1 /verify")
        assert raw_get(port, "/ng-rollout/r1/admin")[0] == 403  # the guard judges the path the handler serves
        server.kill()
        _, stderr = server.communicate(timeout=10)
    assert sorted(os.listdir(files)) == ["task-3.r_1.log"]  # nothing else written, here or above
    assert sorted(os.listdir(tmp_path)) == ["rollouts"]
    assert "TraceContextPathMiddleware is middleware" not in stderr and "Traceback" not in stderr, stderr


def test_a_middleware_listed_before_it_is_warned_about_once(tmp_path: Path) -> None:
    with receiving_server(tmp_path, "guard-first") as (server, port):
        for _ in range(3):
            assert raw_get(port, "/ng-rollout/r1/verify")[0] == 200
        # What the warning is for: the guard saw /ng-rollout/r1/admin, the handler serves /admin.
        assert raw_get(port, "/ng-rollout/r1/admin") == (200, b"r1 /admin")
        server.kill()
        _, stderr = server.communicate(timeout=10)
    warnings = [line for line in stderr.splitlines() if "TraceContextPathMiddleware is middleware 2" in line]
    assert len(warnings) == 1 and "put it first" in warnings[0], stderr
