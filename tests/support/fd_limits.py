"""A `gym-rpc head` under a descriptor limit (`ulimit -n 1024`) with every HTTP-side port open, and the
`many_fds` fixture for a test process that opens more than a thousand connections itself."""

from __future__ import annotations

import contextlib
import re
import resource
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import STARTUP_SECONDS, cli_command, cli_env

FD_LIMIT = 1024


def limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


@contextlib.contextmanager
def head_with_fd_limit(log: Path, *extra_args: str) -> Iterator[tuple[subprocess.Popen[str], str, dict[str, int]]]:
    """`gym-rpc head` with every HTTP-side port open, under `ulimit -n 1024` (soft and hard), stderr into `log`:
    (the process, its gRPC address, {side: port}). `extra_args` come last (a flag given again wins)."""
    flags = [arg for flag, _ in HTTP_SIDE_PORTS.values() for arg in (flag, "0")]
    banner = re.compile(r"listening on (\S+) ")
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            cli_command(["head", "--port", "0", *flags, "--probe-interval", "0.5", *extra_args]),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=cli_env(),
            preexec_fn=limit_fds,
        )
        try:
            assert process.stdout is not None
            deadline = time.monotonic() + STARTUP_SECONDS
            line = process.stdout.readline()
            while not banner.search(line):
                assert time.monotonic() < deadline and line, f"no banner: {line!r} {log.read_text()[:2000]}"
                line = process.stdout.readline()
            match = banner.search(line)
            assert match is not None
            ports = {}
            for side, (_, pattern) in HTTP_SIDE_PORTS.items():
                found = re.search(pattern, line)
                assert found, (side, line)
                ports[side] = int(found.group(1))
            yield process, match.group(1), ports
        finally:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture
def many_fds() -> Iterator[None]:
    """This test process needs more than 1,100 descriptors itself."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = ATTACK_SOCKETS + 512
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"needs a hard fd limit of {wanted}, have {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


ATTACK_SOCKETS = 1100


# The flag that opens each HTTP-side port, and how the banner names the port.
HTTP_SIDE_PORTS = {
    "http": ("--http-port", r"NeMo Gym HTTP head on http://127\.0\.0\.1:(\d+)"),
    "metrics": ("--metrics-port", r"metrics on http://127\.0\.0\.1:(\d+)/metrics"),
    "connect": ("--connect-port", r"Connect on http://127\.0\.0\.1:(\d+)"),
}
