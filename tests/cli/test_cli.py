"""The `gym-rpc` command as a user runs it: real subprocesses against a real head, real exit codes and output."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_rpc.client.control._clients import SyncControlClient
from gym_rpc.config import (
    DEFAULT_HEAD_HOST,
    DEFAULT_HEAD_PORT,
    GlobalConfig,
    default_config_text,
)
from gym_rpc.wire import HEAD_ADDRESS_ENV_VAR
from tests.support import REPO_ROOT
from tests.support.cli import (
    STARTUP_SECONDS,
    TABLE_HEADER,
    CliProcess,
    HeadProcess,
    ThreadedHttpServer,
    cli_start_seconds,
    run_cli,
    running_cli,
    running_head,
    threaded_http_server,
    wait_until_probed_by,
)
from tests.support.documents import server_entry, write_config
from tests.support.loopback import LOOPBACK, closed_port

SECRET = "sk-do-not-print-me"
WAIT_SECONDS = 10.0
# On top of a deadline and the command's start measured beside it (cli_start_seconds): that start varying
# between two runs on a loaded 2-core machine, and the command's own work after its call.
CLI_SLACK_SECONDS = 4.0
# A command bounded by its deadline may take twice a bare start on top of it: what it does after starting
# (connect, render, exit) stretches with the load as the start does (load 20: a 14.9 s start, a 24.1 s run).


def head_port(head: HeadProcess) -> int:
    return int(head.address.rsplit(":", 1)[1])


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str, code: int = 1) -> str:
    """A failed command: exit `code`, one stderr line naming every needle, no traceback, nothing on stdout."""
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0]
    assert result.stdout == ""
    return lines[0]


# --- one head with a live server, a server answering 500 and a closed port, shared by the read-only tests ---


@pytest.fixture(scope="module")
def data_servers() -> Iterator[tuple[ThreadedHttpServer, ThreadedHttpServer]]:
    with threaded_http_server(200) as live, threaded_http_server(500) as failing:
        yield live, failing


@pytest.fixture(scope="module")
def mixed_doc(data_servers: tuple[ThreadedHttpServer, ThreadedHttpServer]) -> dict[str, Any]:
    live, failing = data_servers
    return {
        "head_server": {"host": LOOPBACK, "port": 0},
        "live": server_entry(live.port, api_key=SECRET, note="héllo ✓", sizes=[1, 2, {"deep": [3]}]),
        "failing": server_entry(failing.port, "resources_servers"),
        "gone": server_entry(closed_port(), "responses_api_agents"),
        "checkpoint": {"enabled": True},
        "observability_enabled": False,
    }


@pytest.fixture(scope="module")
def mixed_head(tmp_path_factory: pytest.TempPathFactory, mixed_doc: dict[str, Any]) -> Iterator[HeadProcess]:
    path = write_config(tmp_path_factory.mktemp("mixed") / "config.yaml", mixed_doc)
    with running_head(path) as head:
        wait_until_probed_by(head.address, within=WAIT_SECONDS)
        yield head


def expected_served_document(doc: dict[str, Any], head: HeadProcess) -> dict[str, Any]:
    """What `gym-rpc config` shows, written out: the bound head port, and `live`'s api_key (the one secret)
    redacted."""
    live_port = doc["live"]["responses_api_models"]["responses_api_models_impl"]["port"]
    return {
        **doc,
        "head_server": {"host": LOOPBACK, "port": head_port(head)},
        "live": server_entry(live_port, api_key="<redacted>", note="héllo ✓", sizes=[1, 2, {"deep": [3]}]),
    }


def test_status_table_lists_every_server(mixed_head: HeadProcess) -> None:
    result = run_cli(["status", "--head", mixed_head.address])
    assert result.returncode == 1, result.stderr  # "gone" is down
    lines = result.stdout.rstrip("\n").splitlines()
    assert re.split(r"\s{2,}", lines[0]) == TABLE_HEADER
    assert lines[-1] == "2/3 up; down: gone (connection_error)"
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line) for line in lines[1:-1])}
    assert set(rows) == {"live", "failing", "gone"}
    assert rows["live"][1] == "responses_api_models"
    assert rows["live"][3] == "success"
    assert rows["live"][2].startswith(f"http://{LOOPBACK}:")
    assert rows["failing"][1] == "resources_servers"
    assert rows["failing"][3] == "success"  # any HTTP answer, a 500 included
    assert rows["gone"][1] == "responses_api_agents"
    assert rows["gone"][3] == "connection_error"
    # the HTTP status the probe got: a 500 is "success" (as in NeMo Gym), and the table says which answer it was
    assert (rows["live"][4], rows["failing"][4], rows["gone"][4]) == ("200", "500", "-")
    for cells in rows.values():
        assert len(cells) == len(TABLE_HEADER), cells
        assert re.fullmatch(r"\d+\.\d ms", cells[5]), cells
        assert re.fullmatch(r"\d+\.\ds ago", cells[6]), cells
        assert cells[7:] == ["-", "-"], cells  # no pid nor uptime: nothing registered


def test_status_json_has_a_row_per_server(mixed_head: HeadProcess, mixed_doc: dict[str, Any]) -> None:
    result = run_cli(["status", "--head", mixed_head.address, "--json"])
    assert result.returncode == 1, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert {name: row["status"] for name, row in rows.items()} == {
        "live": "success",
        "failing": "success",
        "gone": "connection_error",
    }
    assert rows["gone"]["type"] == "responses_api_agents"
    assert {name: row["http_status"] for name, row in rows.items()} == {"live": 200, "failing": 500, "gone": None}
    gone_port = mixed_doc["gone"]["responses_api_agents"]["responses_api_agents_impl"]["port"]
    assert rows["gone"]["detail"] == f"[Errno 111] Connect call failed ('127.0.0.1', {gone_port})"
    for row in rows.values():
        assert row["url"].startswith(f"http://{LOOPBACK}:")
        assert isinstance(row["latency_ms"], float)
        assert row["checked_at"] > 0
        assert (row["pid"], row["start_time"], row["uptime_seconds"]) == (None, None, None)


def test_config_json_prints_the_document_with_secrets_redacted(
    mixed_head: HeadProcess, mixed_doc: dict[str, Any]
) -> None:
    result = run_cli(["config", "--head", mixed_head.address, "--json"])
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed == expected_served_document(mixed_doc, mixed_head)
    assert printed["live"]["responses_api_models"]["responses_api_models_impl"]["api_key"] == "<redacted>"
    assert SECRET not in result.stdout
    assert "héllo ✓" in result.stdout  # unicode printed as is


def test_config_yaml_prints_the_same_document(mixed_head: HeadProcess, mixed_doc: dict[str, Any]) -> None:
    result = run_cli(["config", "--head", mixed_head.address, "--yaml"])
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout) == expected_served_document(mixed_doc, mixed_head)
    assert SECRET not in result.stdout
    default_form = run_cli(["config", "--head", mixed_head.address])
    assert default_form.stdout == result.stdout


def test_head_address_comes_from_the_environment(mixed_head: HeadProcess) -> None:
    result = run_cli(["status", "--json", "--allow-down", "gone"], env={HEAD_ADDRESS_ENV_VAR: mixed_head.address})
    assert result.returncode == 0, result.stderr
    assert {row["name"] for row in json.loads(result.stdout)} == {"live", "failing", "gone"}


def test_head_flag_wins_over_the_environment(mixed_head: HeadProcess) -> None:
    elsewhere = f"{LOOPBACK}:{closed_port()}"
    result = run_cli(["config", "--json", "--head", mixed_head.address], env={HEAD_ADDRESS_ENV_VAR: elsewhere})
    assert result.returncode == 0, result.stderr
    assert "live" in json.loads(result.stdout)


def test_default_head_address_when_neither_flag_nor_environment() -> None:
    with socket.socket() as probe:
        if probe.connect_ex((DEFAULT_HEAD_HOST, DEFAULT_HEAD_PORT)) == 0:
            pytest.skip(f"something listens on the default head address {DEFAULT_HEAD_HOST}:{DEFAULT_HEAD_PORT}")
    result = run_cli(["config", "--timeout", "2"])
    assert_one_line_error(result, f"{DEFAULT_HEAD_HOST}:{DEFAULT_HEAD_PORT}", code=3)


# --- the embedded default ---


def test_head_without_config_serves_the_embedded_default() -> None:
    with running_head() as head:
        result = run_cli(["config", "--head", head.address, "--json"])
        status = run_cli(["status", "--head", head.address, "--json"])
    assert result.returncode == 0, result.stderr
    embedded = yaml.safe_load(default_config_text())
    expected = {
        "head_server": {"host": "127.0.0.1", "port": head_port(head)},
        "policy_model": {
            "responses_api_models": {
                "openai_model": {
                    "host": "127.0.0.1",
                    "port": 8000,
                    "entrypoint": "app.py",
                    "api_key": "<redacted>",
                }
            }
        },
        "example_resources": {
            "resources_servers": {"example_tools": {"host": "127.0.0.1", "port": 8200, "entrypoint": "app.py"}}
        },
        "simple_agent": {
            "responses_api_agents": {
                "simple_agent": {
                    "host": "127.0.0.1",
                    "port": 8100,
                    "entrypoint": "app.py",
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                    "resources_server": {"type": "resources_servers", "name": "example_resources"},
                }
            }
        },
        "checkpoint": {"enabled": False},
        "observability_enabled": True,
    }
    assert json.loads(result.stdout) == expected
    rows = json.loads(status.stdout)
    assert {row["name"] for row in rows} == set(GlobalConfig.from_document(embedded).servers)
    all_up = all(row["status"] == "success" for row in rows)
    assert status.returncode == (0 if all_up else 1), status.stderr


# --- failures: one line, no traceback, within the deadline ---


@pytest.mark.parametrize(
    "command", [["status"], ["status", "--json"], ["status", "--watch"], ["config", "--json"]]
)
def test_unreachable_head_fails_fast_with_one_line(command: list[str]) -> None:
    address = f"{LOOPBACK}:{closed_port()}"
    start = cli_start_seconds()
    started = time.monotonic()
    result = run_cli([*command, "--head", address, "--timeout", "2"], timeout=60)
    elapsed = time.monotonic() - started
    assert_one_line_error(result, address, "unreachable", code=3)
    start = max(start, cli_start_seconds())  # the machine's load, before and after
    assert elapsed < 2 * start + 2.0 + CLI_SLACK_SECONDS, f"took {elapsed:.1f}s, a bare start {start:.1f}s"


def test_head_that_never_answers_fails_within_the_deadline() -> None:
    with socket.create_server((LOOPBACK, 0)) as mute:  # accepts (backlog) and never speaks HTTP/2
        address = f"{LOOPBACK}:{mute.getsockname()[1]}"
        start = cli_start_seconds()
        started = time.monotonic()
        result = run_cli(["status", "--head", address, "--timeout", "1"], timeout=60)
        elapsed = time.monotonic() - started
        start = max(start, cli_start_seconds())
    assert_one_line_error(result, address, code=3)
    assert elapsed < 2 * start + 1.0 + CLI_SLACK_SECONDS, f"took {elapsed:.1f}s, a bare start {start:.1f}s"


def test_malformed_yaml_stops_the_head_naming_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("head_server:\n  host: 127.0.0.1\n  port: [0\nother: 1\n", encoding="utf-8")
    result = run_cli(["head", "--config", str(bad), "--port", "0"])
    line = assert_one_line_error(result, str(bad))
    assert re.search(re.escape(str(bad)) + r":[34]:\d+", line), line
    assert "YAML" in line


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("broken:\n  responses_api_models:\n    impl: {host: 127.0.0.1, port: 70000}\n", "port"),
        ("- a\n- b\n", "mapping"),
    ],
)
def test_invalid_config_stops_the_head_naming_the_file(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "invalid.yaml"
    path.write_text(text, encoding="utf-8")
    result = run_cli(["head", "--config", str(path), "--port", "0"])
    assert_one_line_error(result, str(path), needle)


def test_missing_config_file_stops_the_head(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.yaml"
    result = run_cli(["head", "--config", str(missing), "--port", "0"])
    assert_one_line_error(result, str(missing))


# --- signals ---


def wait_for_version_change(client: SyncControlClient, old: str) -> str:
    deadline = time.monotonic() + WAIT_SECONDS
    while (version := client.get_global_config().version) == old:
        assert time.monotonic() < deadline, f"version stayed {old} for {WAIT_SECONDS}s after SIGHUP"
        time.sleep(0.05)
    return version


def test_sighup_reloads_the_config_file(tmp_path: Path) -> None:
    doc = {"head_server": {"host": LOOPBACK, "port": 0}, "first": server_entry(closed_port())}
    path = write_config(tmp_path / "config.yaml", doc)
    with running_head(path) as head:
        client = SyncControlClient(head.address, timeout_seconds=2.0)
        before = client.get_global_config().version

        head.process.send_signal(signal.SIGHUP)  # same content: no new version
        head.wait_for_stderr(
            f"INFO gym_rpc.head: config reload from {path}: unchanged (version {before})", WAIT_SECONDS
        )
        assert client.get_global_config().version == before

        write_config(path, {**doc, "second": server_entry(closed_port(), "resources_servers")})
        head.process.send_signal(signal.SIGHUP)
        after = wait_for_version_change(client, before)
        head.wait_for_stderr(
            f"INFO gym_rpc.head: config reloaded from {path}: version {before} -> {after} (added second)",
            WAIT_SECONDS,
        )
        printed = json.loads(run_cli(["config", "--json", "--head", head.address]).stdout)
        assert set(printed) == {"head_server", "first", "second"}

        path.write_text("first: [unclosed\n", encoding="utf-8")  # a bad file keeps the old config
        head.process.send_signal(signal.SIGHUP)
        head.wait_for_stderr(
            f"WARNING gym_rpc.head: config reload from {path} refused, old config kept", WAIT_SECONDS
        )
        assert client.get_global_config().version == after
        assert head.process.poll() is None
    reload_lines = [line for line in head.stderr_text.splitlines() if "reload" in line]
    assert len(reload_lines) == 3, reload_lines  # one line per reload


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_head_stops_on_signal_promptly(signum: signal.Signals) -> None:
    with running_head() as head:
        started = time.monotonic()
        head.process.send_signal(signum)
        code = head.wait(timeout=20)  # a hang guard; the bound the promise sets is asserted below
        elapsed = time.monotonic() - started
        assert code == 0, head.stderr_text
        assert elapsed < 0.5 + 3.0, f"took {elapsed:.2f}s"  # the 0.5 s grace, plus slack for a loaded machine
        assert "Traceback" not in head.stderr_text


# --- watch ---


def read_watch_lines(
    watcher: CliProcess, until: Callable[[dict[str, Any]], bool], timeout: float = WAIT_SECONDS
) -> list[dict[str, Any]]:
    """Watch lines (parsed) up to and including the first for which `until(line)` holds."""
    deadline = time.monotonic() + timeout
    lines: list[dict[str, Any]] = []
    while not lines or not until(lines[-1]):
        lines.append(json.loads(watcher.read_line(max(0.01, deadline - time.monotonic()))))
    return lines


def server_status(line: dict[str, Any], name: str) -> str | None:
    status: str | None = next(row["status"] for row in line["servers"] if row["name"] == name)
    return status


def test_status_watch_prints_snapshot_then_change(tmp_path: Path) -> None:
    with threaded_http_server() as watched:
        doc = {
            "head_server": {"host": LOOPBACK, "port": 0},
            "watched": server_entry(watched.port),
            "gone": server_entry(closed_port(), "resources_servers"),
        }
        with (
            running_head(write_config(tmp_path / "config.yaml", doc)) as head,
            running_cli(["status", "--head", head.address, "--watch", "--json"]) as watcher,
        ):
            settled = read_watch_lines(watcher, lambda line: server_status(line, "watched") == "success")
            assert settled[0]["kind"] == "snapshot"
            assert {row["name"] for row in settled[0]["servers"]} == {"watched", "gone"}

            watched.stop()
            changes = read_watch_lines(watcher, lambda line: server_status(line, "watched") == "connection_error")
            assert changes[-1]["kind"] == "change"
            assert changes[-1]["revision"] > settled[-1]["revision"]
            assert server_status(changes[-1], "gone") == "connection_error"

            assert watcher.interrupt() == 130
            assert "Traceback" not in watcher.stderr_text


@pytest.fixture(scope="module")
def quiet_head() -> Iterator[HeadProcess]:
    with running_head() as head:
        yield head


@pytest.mark.parametrize(
    ("module", "signals"),
    [("argparse", 1), ("grpc", 1), ("grpc", 2), ("gym_rpc.cli", 1)],
    ids=["cli-imports-begin", "amid-imports", "twice-amid-imports", "cli-imported"],
)
def test_ctrl_c_exits_130_even_while_the_cli_starts(quiet_head: HeadProcess, module: str, signals: int) -> None:
    """README: Ctrl-C exits 130, also while `gym-rpc` is still starting: importing the CLI takes a good part of a
    second (seconds under load), and an interrupt escaping it killed the process by SIGINT instead (returncode -2).
    The interpreter reports each import as it ends (PYTHONPROFILEIMPORTTIME, on stderr); SIGINT goes as soon as
    `module` is imported: when the CLI's imports begin, amid them (also twice in a row), once they are done
    (argument parsing and the first call follow). Only Python's own start-up, before gym_rpc runs, is left
    (README: the first ~20 ms)."""
    args = ["status", "--watch", "--json", "--head", quiet_head.address]
    with running_cli(args, env={"PYTHONPROFILEIMPORTTIME": "1"}) as watcher:
        deadline = time.monotonic() + STARTUP_SECONDS
        while not re.search(rf"\| +{re.escape(module)}$", watcher.stderr_text, re.M):
            assert time.monotonic() < deadline and watcher.process.poll() is None, watcher.stderr_text[-2000:]
            time.sleep(0.005)
        for _ in range(signals):
            watcher.process.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=20) == 130, watcher.stderr_text[-2000:]  # a hang guard for a loaded machine
        assert "Traceback" not in watcher.stderr_text


def exit_and_stderr_of_module(folder: Path, name: str, source: str) -> tuple[int, str]:
    """Run `source` as `python -m name` from `folder` (gym_rpc itself is installed): its exit code and stderr."""
    (folder / f"{name}.py").write_text(source, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(folder)}
    command = [sys.executable, "-m", name]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)
    return result.returncode, result.stderr


def test_a_caught_ctrl_c_inside_code_run_from_a_string_still_exits_130(tmp_path: Path) -> None:
    """CPython marks a KeyboardInterrupt raised in code run from a string (a namedtuple or dataclass made while a
    module imports: where a Ctrl-C during the CLI's start-up often lands) as unhandled even once caught, and
    `python -m` then kills itself with SIGINT (-2) whatever it exits with. gym_rpc.__main__ clears the mark."""
    source = (
        "import sys\n"
        "from gym_rpc.__main__ import _ending\n"
        "try:\n"
        "    exec('raise KeyboardInterrupt')\n"
        "except KeyboardInterrupt:\n"
        "    _ending()\n"
        "    sys.exit(130)\n"
    )
    assert exit_and_stderr_of_module(tmp_path, "interrupted_in_a_string", source) == (130, "")


@pytest.mark.process
@pytest.mark.parametrize("hook_held", [False, True], ids=["hook-quick", "hook-held-after-its-thread-starts"])
def test_a_ctrl_c_dropped_inside_a_weakref_callback_is_delivered_again(tmp_path: Path, hook_held: bool) -> None:
    """A SIGINT that lands while Python runs a weakref callback is printed as "Exception ignored" and lost: soak
    run 7 (2026-12-06) saw `gym-rpc status --watch` interrupted as its imports began run on past 20 s, the
    KeyboardInterrupt dropped inside importlib's module-lock callback. gym_rpc.__main__ delivers it again, and
    only once its hook has returned: soak run B3 (2026-12-06, load 13-21) saw the redelivery land while the starved
    hook still waited for its thread to start, lost there too. `hook_held` holds the hook 0.3 s after it starts
    its thread, as a loaded machine may."""
    held = (
        "import threading\n"
        "_start = threading.Thread.start\n"
        "def _start_then_hold(thread: threading.Thread) -> None:\n"
        "    _start(thread)\n"
        "    time.sleep(0.3)\n"
        "threading.Thread.start = _start_then_hold\n"
    )
    source = (
        "import time, weakref\n"
        "from gym_rpc.__main__ import run_until_interrupted\n"
        f"{held if hook_held else ''}"
        "class Held:\n"
        "    pass\n"
        "def dropped(_: object) -> None:\n"
        "    raise KeyboardInterrupt  # where a Ctrl-C amid imports may land\n"
        "def command() -> None:\n"
        "    held = Held()\n"
        "    ref = weakref.ref(held, dropped)\n"
        "    del held\n"
        "    time.sleep(60)  # runs on unless the interrupt comes again\n"
        "run_until_interrupted(command)\n"
    )
    assert exit_and_stderr_of_module(tmp_path, "dropped_in_a_callback", source) == (130, "")


def test_the_gym_rpc_command_starts_where_ctrl_c_is_caught() -> None:
    """The installed `gym-rpc` script runs gym_rpc.__main__ (which catches Ctrl-C from the CLI's first import on),
    as `python -m gym_rpc` does, not gym_rpc.cli directly."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["scripts"] == {"gym-rpc": "gym_rpc.__main__:main"}


def test_status_watch_retries_a_gone_head_until_max_wait(tmp_path: Path) -> None:
    doc = {"head_server": {"host": LOOPBACK, "port": 0}}
    with running_head(write_config(tmp_path / "config.yaml", doc)) as head:
        args = ["status", "--head", head.address, "--watch", "--json", "--max-wait", "1.5"]
        with running_cli(args) as watcher:
            assert json.loads(watcher.read_line(WAIT_SECONDS))["kind"] == "snapshot"
            head.process.kill()
            watcher.wait_for_stderr("retrying in", WAIT_SECONDS)
            assert watcher.wait(timeout=WAIT_SECONDS + 1.5) == 3  # EXIT_HEAD_UNREACHABLE
            last = watcher.stderr_text.splitlines()[-1]
            assert f"head server at {head.address} is unreachable" in last
            assert "Traceback" not in watcher.stderr_text


# --- entry points ---


def test_python_dash_m_help() -> None:
    result = run_cli(["--help"])
    assert result.returncode == 0, result.stderr
    for command in ("head", "status", "config"):
        assert command in result.stdout


def test_console_script_help() -> None:
    script = Path(sys.executable).with_name("gym-rpc")
    if not script.exists():
        pytest.skip(f"no console script beside {sys.executable}")
    result = subprocess.run([str(script), "status", "--help"], capture_output=True, text=True, timeout=20)
    assert result.returncode == 0, result.stderr
    assert "--watch" in result.stdout and "--head" in result.stdout
