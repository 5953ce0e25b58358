"""A `gym-rpc` that scripts can trust: closed pipes, exit codes, credential flags, status NAME..., reload,
config --check, durations. Every command runs as a real subprocess against a real `gym-rpc head`."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gym_rpc.client import ClientSecurity, SyncControlClient
from gym_rpc.errors import HeadTimeoutError
from tests.support.cli import HeadProcess, cli_command, cli_env, run_cli, running_head, threaded_http_server
from tests.support.documents import server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.security import Pki, make_pki

TOKEN = "scripting-test-token-0123456789"


def _config(tmp_path: Path, servers: dict, **head: object) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"head_server": {"host": LOOPBACK, "port": 0, **head}, **servers}))
    return path


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HeadProcess]:
    folder = tmp_path_factory.mktemp("head")
    with threaded_http_server() as model:
        servers = {"model": server_entry(model.port), "tools": server_entry(closed_port(), "resources_servers")}
        with running_head(_config(folder, servers)) as process:
            yield process


def test_a_closed_pipe_ends_quietly_with_141(head: HeadProcess) -> None:
    """`gym-rpc status -o yaml | head -1`: the reader has gone before we write; no traceback, 141 (as SIGPIPE)."""
    for args in (["status", "-o", "yaml"], ["config"], ["status", "--watch", "-o", "jsonl"]):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone from the start: every write fails
        try:
            process = subprocess.run(
                cli_command([*args, "--head", head.address]),
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                timeout=60,
                env=cli_env(),
            )
        finally:
            os.close(write_end)
        assert process.returncode == 141, (args, process.stderr)
        assert process.stderr == "", args


def test_bad_head_addresses_are_usage_errors() -> None:
    flag = run_cli(["status", "--head", "http://127.0.0.1:11000"])
    assert flag.returncode == 2 and "expected HOST:PORT" in flag.stderr and flag.stderr.count("\n") == 1
    variable = run_cli(["config"], env={"GYM_RPC_HEAD": "127.0.0.1:99999"})
    assert variable.returncode == 2 and "GYM_RPC_HEAD" in variable.stderr


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_refused_credentials_exit_4_and_the_flags_present_them(tmp_path: Path, pki: Pki) -> None:
    tls = {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)}
    config = _config(tmp_path, {"tools": server_entry(closed_port())}, auth_token=TOKEN, tls=tls)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    wrong_file = tmp_path / "wrong"
    wrong_file.write_text("not-the-token")
    with running_head(config) as secured:
        head = ["--head", secured.address]
        good = run_cli(["status", *head, "--cacert", str(pki.ca), "--token-file", str(token_file), "-o", "json"])
        assert good.returncode == 1, good.stderr  # tools is down: we got in
        assert [row["name"] for row in json.loads(good.stdout)] == ["tools"]
        no_token = run_cli(["status", *head, "--cacert", str(pki.ca)])
        assert no_token.returncode == 4, no_token.stderr
        wrong_token = run_cli(["config", *head, "--cacert", str(pki.ca), "--token-file", str(wrong_file)])
        assert wrong_token.returncode == 4, wrong_token.stderr
        wrong_ca = run_cli(["status", *head, "--cacert", str(pki.other_ca), "--token-file", str(token_file)])
        assert wrong_ca.returncode == 4, wrong_ca.stderr
        secrets = run_cli(["config", *head, "--cacert", str(pki.ca), "--include-secrets"])
        assert secrets.returncode == 2 and "--include-secrets needs the head's token" in secrets.stderr
        missing = run_cli(["status", *head, "--token-file", str(tmp_path / "absent")])
        assert missing.returncode == 2 and "absent" in missing.stderr
    down = run_cli(["status", "--head", f"{LOOPBACK}:{closed_port()}", "--timeout", "2s"])
    assert down.returncode == 3, down.stderr  # unreachable stays 3, not 4


def test_status_names_only_those_servers(head: HeadProcess) -> None:
    only = run_cli(["status", "model", "--head", head.address, "-o", "json"])
    assert only.returncode == 0, only.stderr  # model is up; tools (down) is not asked about
    assert [row["name"] for row in json.loads(only.stdout)] == ["model"]
    unknown = run_cli(["status", "nope", "--head", head.address])
    assert unknown.returncode == 2 and "nope" in unknown.stderr


def test_reload_calls_the_rpc(tmp_path: Path) -> None:
    config = _config(tmp_path, {"a": server_entry(closed_port())})
    with running_head(config) as process:
        same = run_cli(["reload", "--head", process.address])
        assert same.returncode == 0 and "(unchanged)" in same.stdout, same.stderr
        config.write_text(yaml.safe_dump({"head_server": {"host": LOOPBACK, "port": 0}, "b": server_entry(1)}))
        changed = run_cli(["reload", "--head", process.address])
        assert changed.returncode == 0 and "(changed)" in changed.stdout, changed.stderr
        names = SyncControlClient(process.address, security=ClientSecurity()).get_global_config().servers
        assert list(names) == ["b"]


def test_config_check_validates_without_a_head(tmp_path: Path) -> None:
    good = _config(tmp_path, {"model": server_entry(8000)})
    checked = run_cli(["config", "--check", str(good), "--head", f"{LOOPBACK}:{closed_port()}"])
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith(f"{good}: valid, version ") and "1 servers (model)" in checked.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("head_server: {host: 127.0.0.1, port: 70000}\n")
    refused = run_cli(["config", "--check", str(bad)])
    assert refused.returncode == 1 and "head_server.port" in refused.stderr and refused.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("text", "ok"), [("30", True), ("30s", True), ("2m", True), ("500ms", True), ("1x", False)]
)
def test_durations_take_units(text: str, ok: bool) -> None:
    result = run_cli(["status", "--head", f"{LOOPBACK}:{closed_port()}", "--timeout", text, "--help"])
    assert (result.returncode == 0) is ok, result.stderr
    if not ok:
        assert "expected a duration" in result.stderr


def test_a_streams_deadline_says_it_was_the_streams(head: HeadProcess) -> None:
    client = SyncControlClient(head.address, security=ClientSecurity())
    started = time.monotonic()
    with pytest.raises(HeadTimeoutError, match=r"stream's deadline of 0\.5 s"):
        for _ in client.watch_server_statuses(heartbeat_seconds=60, timeout=0.5):
            pass
    assert time.monotonic() - started < 5
