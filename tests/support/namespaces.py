"""Tests that bind beyond loopback run inside a network namespace of their own (`unshare -rn`), where 0.0.0.0
reaches nothing outside; `needs_namespace` skips them where unprivileged namespaces are not allowed."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT


def _namespaces_allowed() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_namespace = pytest.mark.skipif(not _namespaces_allowed(), reason="no unprivileged network namespaces here")


def interface_up(name: bytes) -> None:
    with socket.socket() as s:  # SIOCGIFFLAGS, SIOCSIFFLAGS
        flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, struct.pack("16sh", name, 0)))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sh", name, flags | 1))


def add_address(name: bytes, ip: str) -> None:
    with socket.socket() as s:  # SIOCSIFADDR
        address = struct.pack("HH4s8x", socket.AF_INET, 0, socket.inet_aton(ip))
        fcntl.ioctl(s, 0x8916, struct.pack("16s16s", name, address))


def pytest_in_namespace(test_id: str, marker: str) -> None:
    """Run one test (`file::name`) with pytest in a network namespace of its own, `marker`=1 in its environment
    (the test reads it to know it is inside); fails with its output unless it passed."""
    done = subprocess.run(
        [
            "unshare",
            "-rn",
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            test_id,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, marker: "1"},
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]
