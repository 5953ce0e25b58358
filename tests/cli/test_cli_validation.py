"""`gym-rpc` refuses what would spin, wrap or mislead with one line, before doing anything (issue 14, items 8,
10 and 13): real subprocesses, no head needed."""

from __future__ import annotations

import socket
import subprocess

import pytest

from gym_rpc.config import checked_port, checked_seconds
from gym_rpc.errors import ConfigError
from gym_rpc.server._head import HeadOptions
from tests.support.cli import run_cli
from tests.support.loopback import LOOPBACK


def assert_one_line(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["head", "--probe-interval", "0"],
            "argument --probe-interval: must be a positive number of seconds, not 0",
        ),
        (["head", "--probe-interval", "-1"], "argument --probe-interval: must be a positive number of seconds"),
        (["head", "--probe-interval", "0.001"], "--probe-interval: must be at least 0.05 seconds, not 0.001"),
        (["head", "--probe-interval", "nan"], "argument --probe-interval: must be a positive number of seconds"),
        (["head", "--probe-interval", "inf"], "argument --probe-interval: must be a positive number of seconds"),
        (["head", "--probe-timeout", "-1"], "argument --probe-timeout: must be a positive number of seconds"),
        (["head", "--port", "70000"], "argument --port: must be in 0..65535 (0 picks a free port), not 70000"),
        (["head", "--port", "-1"], "argument --port: must be in 0..65535"),
        (["head", "--http-port", "65536"], "argument --http-port: must be in 0..65535"),
        (["bridge", "--upstream", "http://127.0.0.1:1", "--refresh-interval", "0"], "--refresh-interval"),
        (["status", "--timeout", "nan"], "argument --timeout: must be a positive number of seconds"),
    ],
)
def test_bad_numbers_are_refused_with_one_line(args: list[str], needle: str) -> None:
    assert_one_line(run_cli(args), 2, needle, "(see gym-rpc")


@pytest.mark.parametrize(
    "address", ["http://127.0.0.1:11000", "https://head.example:443", "127.0.0.1", "127.0.0.1:99999"]
)
def test_a_head_address_that_is_not_host_port_says_so(address: str) -> None:
    line = assert_one_line(run_cli(["status", "--head", address]), 2, "expected HOST:PORT")
    assert "Misformatted" not in line and "unreachable" not in line


def test_a_busy_port_is_one_line_without_c_core_noise() -> None:
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(["head", "--port", str(port)])
    line = assert_one_line(result, 1, f"cannot listen on 127.0.0.1:{port}", "in use by another process")
    assert "add_port.cc" not in result.stderr and "GRPC_VERBOSITY" not in line


@pytest.mark.parametrize(
    "options",
    [
        {"probe_interval_seconds": 0.0},
        {"probe_interval_seconds": 0.049},
        {"probe_interval_seconds": float("nan")},
        {"probe_timeout_seconds": -1.0},
        {"probe_interval_seconds": float("inf")},
        {"handshake_timeout_seconds": 0.0},
        {"port": 70000},
        {"http_port": -1},
    ],
)
def test_head_options_refuse_what_the_cli_refuses(options: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="must be"):
        HeadOptions(**options)  # type: ignore[arg-type]


def test_the_checks_accept_sound_values() -> None:
    assert checked_seconds(0.05, "x") == 0.05
    assert HeadOptions(probe_interval_seconds=0.05).probe_interval_seconds == 0.05  # the floor itself
    assert checked_port(0, "x") == 0 and checked_port(65535, "x") == 65535 and checked_port(None, "x") is None
