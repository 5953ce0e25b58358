"""The default is no open head (issue 43, point 10): a `gym-rpc head` bound beyond loopback without a token starts
with registrations off, says so in its banner and its log, and refuses RegisterServerInstance and
DeregisterServerInstance naming the flag that turns them on; `--open-registrations` or a token turns them on, and a
loopback head stays zero-config.

A head bound to 0.0.0.0 is reachable beyond this machine, which tests must never be: those heads run inside a
network namespace of their own (`unshare -rn`), whose only interface is its own loopback. Where the system allows
no such namespace, those tests are skipped (the loopback one still runs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.errors import UnknownServerError
from tests.support.cli import running_head
from tests.support.documents import document, server_entry
from tests.support.loopback import closed_port
from tests.support.namespaces import needs_namespace

# Run inside the namespace: bring its loopback up (no iproute2 needed), start `gym-rpc head` on 0.0.0.0, read its
# banner, try a registration and a deregistration, print what happened as one JSON line, stop the head.
_IN_NAMESPACE = r"""
import fcntl, json, os, signal, socket, struct, subprocess, sys
from gym_rpc.client import SyncControlClient
from gym_rpc.errors import ControlPlaneError

with socket.socket() as s:  # SIOCGIFFLAGS, SIOCSIFFLAGS: lo up
    flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, struct.pack("16sh", b"lo", 0)))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 1))
config, port, token, *flags = sys.argv[1:]
os.environ["GYM_RPC_TOKEN"] = token  # the head's and the client's (empty: none)
env = dict(os.environ)
head = subprocess.Popen(
    [sys.executable, "-m", "gym_rpc", "head", "--config", config, "--host", "0.0.0.0", "--port", port, *flags],
    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
)
try:
    banner = head.stdout.readline()
    client = SyncControlClient(f"127.0.0.1:{port}")
    outcome = {"banner": banner}
    for call, arguments in (
        ("register", lambda: client.register_server_instance("policy", listen_port=9, pid=77)),
        ("deregister", lambda: client.deregister_server_instance("policy", pid=77)),
    ):
        try:
            outcome[call] = ["OK", str(arguments())]
        except ControlPlaneError as exc:
            outcome[call] = [exc.code.name, str(exc)]
    print(json.dumps(outcome), flush=True)
finally:
    head.send_signal(signal.SIGTERM)
    _, log = head.communicate(timeout=30)
    print(json.dumps({"log": log}), flush=True)
"""


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "gym.yaml"
    path.write_text(yaml.safe_dump(document({"policy": server_entry(closed_port())})), encoding="utf-8")
    return path


def _wildcard_head(tmp_path: Path, *flags: str, token: str = "") -> tuple[dict, str]:
    """What a head on 0.0.0.0 (inside a namespace of its own) answered, and its log."""
    done = subprocess.run(
        ["unshare", "-rn", sys.executable, "-c", _IN_NAMESPACE, str(_config(tmp_path)), "11000", token, *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    outcome, log = (json.loads(line) for line in done.stdout.splitlines())
    return outcome, log["log"]


@needs_namespace
def test_a_head_bound_beyond_loopback_without_a_token_takes_no_registrations(tmp_path: Path) -> None:
    outcome, log = _wildcard_head(tmp_path)
    assert "registrations off" in outcome["banner"] and "--open-registrations" in outcome["banner"]
    for call in ("register", "deregister"):
        code, message = outcome[call]
        assert code == "PERMISSION_DENIED", outcome
        assert "registrations are off" in message and "--open-registrations" in message
        assert "GYM_RPC_TOKEN" in message and "0.0.0.0" in message
    assert log.count("registrations are off") == 1  # said once at start, not per refused call
    assert "Traceback" not in log


@needs_namespace
def test_open_registrations_or_a_token_turn_them_on(tmp_path: Path) -> None:
    for flags, token in ((("--open-registrations",), ""), ((), "s3cret-token-for-the-test")):
        outcome, log = _wildcard_head(tmp_path, *flags, token=token)
        assert "registrations off" not in outcome["banner"], outcome
        assert outcome["register"][0] == "OK" and outcome["register"][1].endswith(":9"), outcome
        assert outcome["deregister"] == ["OK", "True"], outcome
        assert "registrations are off" not in log


async def test_a_loopback_head_takes_registrations_without_a_token(tmp_path: Path) -> None:
    with running_head(_config(tmp_path)) as head:
        assert "registrations off" not in head.banner
        client = ControlClient(head.address)
        url = await client.register_server_instance("policy", listen_port=9, listen_host="127.0.0.1", pid=77)
        assert url.endswith(":9")
        assert await client.deregister_server_instance("policy", pid=77) is True
        with pytest.raises(UnknownServerError):  # refused for what it is, not for being open
            await client.register_server_instance("nope", listen_port=9, pid=77)
