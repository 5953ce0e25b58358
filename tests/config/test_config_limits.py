"""Hostile and careless config files: bounded to parse, refused with one line naming the file, secrets hidden.

The attacks run for real: a "billion laughs" YAML is handed to a real `gym-rpc head` subprocess whose time and
peak memory are measured; the other inputs go through the same loader the head uses at start and on reload.
"""

from __future__ import annotations

import os
import resource
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from gym_rpc.config import (
    REDACTED,
    GlobalConfig,
    is_secret_key,
    load_config_file,
    parse_config_text,
    redact_secrets,
)
from gym_rpc.errors import ConfigError
from tests.support.cli import cli_command, cli_env
from tests.support.documents import BILLION_LAUGHS

PEAK_MEMORY_LIMIT_KIB = 400 * 1024  # a head that expands the document passes this within a second


def run_head_measured(config: Path, timeout: float = 30.0) -> tuple[int, str, float, int]:
    """Run `gym-rpc head --config F` to its end: (exit code, stderr, seconds, peak resident KiB of the child)."""
    started = time.monotonic()
    process = subprocess.Popen(
        cli_command(["head", "--config", str(config), "--port", "0"]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=cli_env(),
        # a head that expands the aliases would eat the machine; the limit makes it fail instead
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 * 1024**3, 4 * 1024**3)),
    )
    deadline = started + timeout
    while True:
        pid, wait_status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            process.kill()
            os.wait4(process.pid, 0)
            raise AssertionError(f"gym-rpc head still runs after {timeout}s on {config.name}")
        time.sleep(0.05)
    process.returncode = os.waitstatus_to_exitcode(wait_status)
    assert process.stderr is not None
    stderr = process.stderr.read().decode()
    process.stderr.close()
    return process.returncode, stderr, time.monotonic() - started, usage.ru_maxrss


def assert_one_line(stderr: str, *needles: str) -> str:
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[:2000]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --- item 6: alias bombs ---


def test_billion_laughs_is_refused_by_the_head_in_bounded_time_and_memory(tmp_path: Path) -> None:
    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS, encoding="utf-8")
    assert len(BILLION_LAUGHS) < 600
    code, stderr, _seconds, peak_kib = run_head_measured(path)
    assert code == 1
    line = assert_one_line(stderr, str(path), "aliases expanded")
    assert "1,000,000 values" in line
    assert peak_kib < PEAK_MEMORY_LIMIT_KIB, f"peak {peak_kib} KiB"


def test_an_alias_to_itself_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^loop\.yaml:1:\d+: the alias \*me refers to itself$"):
        parse_config_text("a: &me [1, *me]\n", "loop.yaml")


def test_aliases_and_merge_keys_of_a_normal_size_still_work() -> None:
    text = "base: &base {host: 127.0.0.1, port: 8000}\nm:\n  t:\n    i: {<<: *base, port: 8001}\n"
    document = parse_config_text(text)
    assert document["m"] == {"t": {"i": {"host": "127.0.0.1", "port": 8001}}}


def test_a_larger_than_limit_text_is_refused_before_parsing() -> None:
    text = "a: " + "x" * (16 * 1024 * 1024) + "\n"
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"^big\.yaml: refusing a config larger than 16 MiB$"):
        parse_config_text(text, "big.yaml")
    assert time.monotonic() - started < 5.0


# --- item 9: non-UTF-8 and deep nesting ---


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nested more than 100 levels deep"),
        ('{"a": ' * 3000 + "1" + "}" * 3000, "nested more than 100 levels deep"),
    ],
    ids=["yaml-flow", "json"],
)
def test_deep_nesting_stops_the_head_with_one_line(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(text, encoding="utf-8")
    code, stderr, _, _ = run_head_measured(path)
    assert code == 1
    assert_one_line(stderr, str(path), needle)


def test_non_utf8_config_stops_the_head_with_one_line_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model_name: café\n".encode("latin-1"))
    code, stderr, _, _ = run_head_measured(path)
    assert code == 1
    line = assert_one_line(stderr, str(path), "not UTF-8")
    assert "latin1.yaml:1:" in line and "0xe9" in line


def test_a_document_built_in_code_nested_too_deep_is_a_config_error() -> None:
    node: dict[str, Any] = {}
    document = {"deep": node}
    for _ in range(5000):
        node["x"] = node = {}
    with pytest.raises(ConfigError, match="nested more than 100 levels deep"):
        GlobalConfig.from_document(document)


# --- item 11: duplicate keys and badly shaped server entries ---


def test_duplicate_top_level_keys_are_refused_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    text = (
        "policy_model:\n  responses_api_models:\n    a: {host: 127.0.0.1, port: 8000}\n"
        "policy_model:\n  responses_api_models:\n    b: {host: 127.0.0.1, port: 8001}\n"
    )
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config_file(path)
    assert str(caught.value) == f"{path}:4:1: duplicate key 'policy_model'"


def test_badly_shaped_server_entries_are_reported_not_dropped_silently() -> None:
    entry = {"host": "127.0.0.1", "port": 8000}
    config = GlobalConfig.from_document(
        {
            "no_host": {"responses_api_models": {"impl": {"port": 8000}}},
            "two_impls": {"responses_api_models": {"a": entry, "b": entry}},
            "two_types": {"responses_api_models": {"a": entry}, "resources_servers": {"b": entry}},
            "fine": {"responses_api_models": {"a": entry}},
            "checkpoint": {"enabled": True},
            "http_client": {"retry": {"attempts": 3}},
        }
    )
    assert list(config.servers) == ["fine"]
    assert config.malformed_servers == {
        "no_host": "responses_api_models.impl has no host",
        "two_impls": "responses_api_models has 2 implementations (a, b); one server name holds one",
        "two_types": (
            "it has 2 server types (responses_api_models, resources_servers); one server name holds one type"
        ),
    }


# --- items 10 and 13: ranges and one-line validation errors ---


@pytest.mark.parametrize(
    ("head_server", "expected"),
    [
        ({"host": "127.0.0.1", "port": 70000}, "head_server.port: Input should be less than or equal to 65535"),
        ({"host": "127.0.0.1", "port": -1}, "head_server.port: Input should be greater than or equal to 0"),
        ({"port": 1}, "head_server.host: Field required"),
        ({"host": "h", "port": 1, "tls": {"cert": "x"}}, "head_server.tls.cert: Extra inputs are not permitted"),
    ],
)
def test_validation_errors_are_one_line_without_a_docs_url(
    tmp_path: Path, head_server: Any, expected: str
) -> None:
    import yaml

    path = tmp_path / "head.yaml"
    path.write_text(yaml.safe_dump({"head_server": head_server}), encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config_file(path)
    assert str(caught.value) == f"{path}: {expected}"


def test_http_client_errors_are_one_line() -> None:
    from gym_rpc.client import HttpClientSettings

    with pytest.raises(ConfigError) as caught:
        HttpClientSettings.from_document({"http_client": {"retry": {"multiplier": 0.5}, "bogus": 1}})
    assert str(caught.value) == (
        "http_client.retry.multiplier: Input should be greater than or equal to 1 (and 1 more problem)"
    )


# --- item 3: redaction ---


@pytest.mark.parametrize("key", ["passwd", "db_passphrase", "auth", "jwt", "aws_access_key", "JWT_SECRET_KEY"])
def test_more_secret_key_names_are_redacted(key: str) -> None:
    assert is_secret_key(key)
    assert redact_secrets({key: "hunter2"}) == {key: REDACTED}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("postgres://gym:hunter2@db:5432/rollouts", f"postgres://{REDACTED}@db:5432/rollouts"),
        ("https://user:p@ss@example.com/v1", f"https://{REDACTED}@example.com/v1"),
        ("https://ghp_token@github.com/org/repo.git", f"https://{REDACTED}@github.com/org/repo.git"),
        ("OPENAI_API_KEY=sk-live-123", f"OPENAI_API_KEY={REDACTED}"),
        ("python app.py --api-key=sk-9 --port=8000", f"python app.py --api-key={REDACTED} --port=8000"),
        ("http://h:1/v1?api_key=zz&model=m", f"http://h:1/v1?api_key={REDACTED}&model=m"),
        ("ops@example.com", "ops@example.com"),
        ("max_tokens=512", "max_tokens=512"),
    ],
)
def test_secrets_inside_strings_are_redacted(value: str, expected: str) -> None:
    assert redact_secrets({"env": [value], "dsn": value}) == {"env": [expected], "dsn": expected}


def test_reprs_of_server_entries_hide_api_keys() -> None:
    config = GlobalConfig.from_document(
        {"policy": {"responses_api_models": {"openai": {"host": "127.0.0.1", "port": 8000, "api_key": "sk-LEAK"}}}}
    )
    for shown in (repr(config.servers), str(config.servers), repr(config.servers["policy"]), str(config)):
        assert "sk-LEAK" not in shown
    assert f"'api_key': '{REDACTED}'" in repr(config.servers)
    assert config.servers["policy"].config["api_key"] == "sk-LEAK"  # the value itself is kept
    assert isinstance(config.servers["policy"], BaseModel)
