"""Real `gym-rpc` subprocesses for CLI tests: run one to completion, or keep one running and read its lines.

Every wait is bounded, and every process started here is killed on exit, so a hung CLI fails a test instead of
hanging the suite. A threaded aiohttp server gives synchronous tests a real data-plane server they can stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

from aiohttp import web

from gym_rpc.client.control._clients import SyncControlClient
from gym_rpc.wire import HEAD_ADDRESS_ENV_VAR
from tests.support.loopback import LOOPBACK
from tests.support.waiting import eventually_blocking

STARTUP_SECONDS = 60.0  # a hang guard: a cold interpreter imports ~1 CPU s, and at a load average of 17 on two
# cores the make test of 40ae97b saw heads not listening within 15 s
LISTENING_PATTERN = re.compile(r"listening on (\S+)")


def let_children_take_sigint() -> None:
    """Give this process Python's own SIGINT handler when SIGINT was inherited ignored.

    A suite started with SIGINT ignored (a bare `cmd &` in a shell without job control: SigIgn 0x6) would pass the
    ignore on to every subprocess it starts, and a `gym-rpc status --watch` that ignores Ctrl-C never ends when a
    test sends it SIGINT. A handler (unlike an ignore) is reset to the default by exec, so every child starts as
    from a terminal, whatever way the suite was launched.
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def cli_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without a stray head address, unbuffered, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != HEAD_ADDRESS_ENV_VAR}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT (see CliProcess.wait) prints every thread's stack to stderr
    env.update(extra or {})
    return env


def cli_command(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "gym_rpc", *args]


def run_cli(
    args: Sequence[str], *, timeout: float = STARTUP_SECONDS, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `gym-rpc ARGS` to completion (killed after `timeout` seconds: a hang guard, as a cold start alone took
    15-24 s at a load average of 20)."""
    return subprocess.run(
        cli_command(args), capture_output=True, text=True, timeout=timeout, env=cli_env(env), check=False
    )


def cli_start_seconds() -> float:
    """How long `gym-rpc --version` takes here and now: a command's own start (a cold interpreter importing grpc),
    which a loaded machine stretches to seconds. A test bounding a command's run by its deadline bounds what
    comes on top of this, measured beside it, not a fixed guess at it."""
    started = time.monotonic()
    result = run_cli(["--version"], timeout=60)
    assert result.returncode == 0, result.stderr
    return time.monotonic() - started


class CliProcess:
    """A running `gym-rpc` subprocess whose stdout lines can be awaited with a deadline."""

    def __init__(
        self, args: Sequence[str], env: Mapping[str, str] | None = None, stdout: int | None = None
    ) -> None:
        """`stdout`: a file descriptor to write to (a pseudo-terminal, say) instead of lines read here."""
        self.args = list(args)
        self.process = subprocess.Popen(
            cli_command(args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout is None else stdout,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(env),
        )
        self._stdout: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str | None] = []
        assert self.process.stderr is not None
        self._readers = [
            threading.Thread(target=self._drain, args=(self.process.stderr, self._stderr.append), daemon=True)
        ]
        if self.process.stdout is not None:
            self._readers.append(
                threading.Thread(target=self._drain, args=(self.process.stdout, self._stdout.put), daemon=True)
            )
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _drain(stream: IO[str], sink: Callable[[str | None], object]) -> None:
        """Read until EOF so the child never blocks on a full pipe; None marks the end of the stream."""
        for line in stream:
            sink(line.rstrip("\n"))
        sink(None)

    @property
    def stderr_text(self) -> str:
        return "\n".join(line for line in list(self._stderr) if line is not None)

    def read_line(self, timeout: float) -> str:
        """The next stdout line; fails the test when none comes within `timeout` or stdout ends."""
        try:
            line = self._stdout.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"`gym-rpc {' '.join(self.args)}` printed no line within {timeout}s; stderr: {self.stderr_text}"
            ) from None
        if line is None:
            self.process.wait(timeout=5)
            raise AssertionError(
                f"`gym-rpc {' '.join(self.args)}` ended (exit {self.process.returncode}) before printing a line; "
                f"stderr: {self.stderr_text}"
            )
        return line

    def wait_for_line(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        """Skip stdout lines until one matches `pattern`, within `timeout` seconds in all."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.read_line(max(0.01, deadline - time.monotonic()))
            if match := pattern.search(line):
                return match

    def wait_for_stderr(self, text: str, timeout: float) -> None:
        """Poll stderr until it contains `text`; fails the test after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while text not in self.stderr_text:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"stderr of `gym-rpc {' '.join(self.args)}` lacks {text!r}: {self.stderr_text}"
                )
            time.sleep(0.02)

    def wait(self, timeout: float) -> int:
        """The exit code; fails the test when the process runs on past `timeout`, with every thread's stack.

        A process still running then gets SIGABRT, on which faulthandler (PYTHONFAULTHANDLER, see cli_env) prints
        where each of its threads was: a hang is shown where it is, not only that it happened.
        """
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
            self._readers[0].join(timeout=5)
            raise AssertionError(
                f"`gym-rpc {' '.join(self.args)}` still runs after {timeout}s; its stacks and stderr:\n"
                f"{self.stderr_text}"
            ) from None

    def interrupt(self, timeout: float = 20.0) -> int:
        """Ctrl-C: SIGINT, then the exit code (`timeout` is a hang guard for a loaded machine, see `wait`)."""
        self.process.send_signal(signal.SIGINT)
        return self.wait(timeout)

    def close(self) -> None:
        """Kill the process if it still runs and collect its output threads."""
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        for reader in self._readers:
            reader.join(timeout=5)


class HeadProcess(CliProcess):
    """`gym-rpc head` on a free port; `address` is the HOST:PORT it printed, `banner` that whole line."""

    address: str
    banner: str


@contextlib.contextmanager
def running_cli(
    args: Sequence[str], env: Mapping[str, str] | None = None, stdout: int | None = None
) -> Iterator[CliProcess]:
    process = CliProcess(args, env, stdout)
    try:
        yield process
    finally:
        process.close()


@contextlib.contextmanager
def running_head(
    config: Path | None = None,
    *extra_args: str,
    env: Mapping[str, str] | None = None,
    startup_seconds: float = STARTUP_SECONDS,
) -> Iterator[HeadProcess]:
    """Start `gym-rpc head --port 0 [--config F]`, wait for its "listening on" line (at most `startup_seconds`),
    always kill it at exit."""
    args = ["head", "--port", "0", "--probe-interval", "0.1", "--probe-timeout", "0.5", *extra_args]
    if config is not None:
        args += ["--config", str(config)]
    head = HeadProcess(args, env)
    try:
        match = head.wait_for_line(LISTENING_PATTERN, startup_seconds)
        head.address, head.banner = match.group(1), match.string
        yield head
    finally:
        head.close()


class ThreadedHttpServer:
    """A real aiohttp server on its own event loop in a thread, for tests that are not async."""

    def __init__(self, status: int = 200, port: int = 0) -> None:
        self.status = status
        self.port = port  # 0: a free one; a held port (conftest.closed_port) to "bring a server up" there
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    async def _answer(self, request: web.Request) -> web.Response:
        return web.json_response({"status": self.status}, status=self.status)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, LOOPBACK, self.port, reuse_address=True).start()
        self.port = int(self._runner.addresses[0][1])

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> ThreadedHttpServer:
        self._thread.start()
        if not self._ready.wait(timeout=10):
            raise AssertionError("the aiohttp server thread did not start within 10s")
        return self

    def stop(self) -> None:
        """Close the listening socket and end the thread (idempotent)."""
        if not self._thread.is_alive():
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
            self._runner = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@contextlib.contextmanager
def threaded_http_server(status: int = 200, port: int = 0) -> Iterator[ThreadedHttpServer]:
    server = ThreadedHttpServer(status, port).start()
    try:
        yield server
    finally:
        server.stop()


TABLE_HEADER = ["NAME", "TYPE", "URL", "STATUS", "HTTP", "LATENCY", "LAST CHECKED", "PID", "UPTIME"]


def wait_for_instances(address: str, probed: int) -> None:
    """Until `probed` instances of `policy_model` have a probe result (bounded)."""
    client = SyncControlClient(address, timeout_seconds=2.0)
    deadline = time.monotonic() + 10
    while True:
        (report,) = [r for r in client.list_server_statuses().reports if r.server_name == "policy_model"]
        if sum(1 for i in report.instances if i.status is not None) >= probed:
            return
        assert time.monotonic() < deadline, report
        time.sleep(0.05)


def wait_until_probed_by(address: str, within: float) -> None:
    """Block until the head at `address` has probed every server once, so status output is settled."""
    client = SyncControlClient(address, timeout_seconds=2.0)
    eventually_blocking(
        lambda: client.list_server_statuses().reports,
        lambda reports: all(report.status is not None for report in reports),
        within=within,
        what=f"head at {address} probing every server",
    )
