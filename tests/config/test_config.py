"""gym_rpc.config on its own: parsing, server detection, validation, versions, addresses, redaction. No network."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from gym_rpc.client.data._http_settings import HttpClientSettings
from gym_rpc.config import (
    DEFAULT_HEAD_HOST,
    DEFAULT_HEAD_PORT,
    REDACTED,
    GlobalConfig,
    base_url,
    connectable_host,
    default_config_text,
    get_first_server_config_dict,
    is_secret_key,
    load_config_file,
    parse_config_text,
    redact_secrets,
    url_host,
)
from gym_rpc.errors import ConfigError, UnknownServerError


def entry(port: int = 8000, host: str = "127.0.0.1", server_type: str = "responses_api_models", **extra: Any):
    return {server_type: {f"{server_type}_impl": {"host": host, "port": port, **extra}}}


# --- parsing ---


def test_yaml_error_names_source_line_and_column() -> None:
    text = "head_server:\n  host: 127.0.0.1\n  port: [0\nother: 1\n"
    with pytest.raises(ConfigError) as caught:
        parse_config_text(text, "conf/my.yaml")
    assert re.match(r"conf/my\.yaml:[34]:\d+: invalid YAML", str(caught.value)), str(caught.value)


def test_yaml_error_without_source_uses_a_placeholder() -> None:
    with pytest.raises(ConfigError, match=r"^<config>:2:\d+: invalid YAML"):
        parse_config_text("a: 1\n\tb: 2\n")


def test_top_level_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"^list\.yaml: .*mapping.*list"):
        parse_config_text("- a\n- b\n", "list.yaml")


def test_empty_text_is_an_empty_document_and_json_is_accepted() -> None:
    assert parse_config_text("") == {}
    assert parse_config_text("# only a comment\n") == {}
    assert parse_config_text('{"a": {"b": [1, 2.5, "x"]}}') == {"a": {"b": [1, 2.5, "x"]}}


def test_load_config_file_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match=re.escape(str(missing))):
        load_config_file(missing)


def test_load_config_file_validation_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad_port.yaml"
    path.write_text("model:\n  responses_api_models:\n    impl: {host: 127.0.0.1, port: 0}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config_file(path)
    assert str(caught.value).startswith(str(path))
    assert "port" in str(caught.value)


def test_load_config_file_yaml_error_names_the_file_once(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("a: [1\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config_file(path)
    assert str(caught.value).startswith(f"{path}:")
    assert str(caught.value).count(str(path)) == 1


def test_load_config_file_reads_a_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("model:\n  responses_api_models:\n    impl: {host: 127.0.0.1, port: 8123}\n", encoding="utf-8")
    config = load_config_file(str(path))
    assert config.servers["model"].url == "http://127.0.0.1:8123"


def test_embedded_default_is_a_valid_config() -> None:
    config = GlobalConfig.from_document(parse_config_text(default_config_text()))
    assert list(config.servers) == ["policy_model", "example_resources", "simple_agent"]
    assert config.head_server.port == DEFAULT_HEAD_PORT


# --- server detection and global keys ---


def test_servers_are_entries_of_the_nemo_gym_shape_and_global_keys_are_not() -> None:
    doc = {
        "head_server": {"host": "127.0.0.1", "port": 11000},
        "policy": entry(8000, api_key="k"),
        "tools": entry(8200, server_type="resources_servers"),
        "checkpoint": {"enabled": True},
        "observability_enabled": True,
        "policy_base_url": "http://example.invalid/v1",
        "two_types": {**entry(8300), **entry(8301, server_type="resources_servers")},
        "no_port": {"responses_api_models": {"impl": {"host": "127.0.0.1"}}},
        "list_value": [1, 2],
    }
    config = GlobalConfig.from_document(doc)
    assert list(config.servers) == ["policy", "tools"]
    policy = config.servers["policy"]
    assert (policy.name, policy.server_type, policy.impl_name) == (
        "policy",
        "responses_api_models",
        "responses_api_models_impl",
    )
    assert (policy.host, policy.port, policy.url) == ("127.0.0.1", 8000, "http://127.0.0.1:8000")
    assert policy.config == {"host": "127.0.0.1", "port": 8000, "api_key": "k"}
    assert config.servers["tools"].server_type == "resources_servers"


def test_head_server_defaults_when_absent() -> None:
    config = GlobalConfig.from_document({"m": entry()})
    assert (config.head_server.host, config.head_server.port) == (DEFAULT_HEAD_HOST, DEFAULT_HEAD_PORT)


@pytest.mark.parametrize("head", [["127.0.0.1", 1], {"host": "127.0.0.1"}, {"host": "h", "port": "many"}])
def test_bad_head_server_is_a_config_error(head: Any) -> None:
    with pytest.raises(ConfigError, match="head_server"):
        GlobalConfig.from_document({"head_server": head})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        *[(key, value) for key in ("http_port", "connect_port") for value in ("8080", True, -1, 65536, 1.5)],
        *[("health_port", value) for value in (-1, 65536, 1.5, "x")],  # as before: "8080" is 8080 here
    ],
)
def test_a_bad_extra_port_fails_at_load_naming_the_key(key: str, value: Any) -> None:
    """The head_server block has one model (HeadServerSettings), checked when the config loads."""
    with pytest.raises(ConfigError, match=rf"^head_server\.{key}: Input should be"):
        GlobalConfig.from_document({"head_server": {"host": "127.0.0.1", "port": 1, key: value}})


def test_the_head_server_block_is_parsed_once_into_its_settings() -> None:
    block = {"host": "127.0.0.1", "port": 1, "http_port": 0, "connect_port": 2, "auth_token": "t" * 32}
    settings = GlobalConfig.from_document({"head_server": block}).head_settings
    assert (settings.http_port, settings.connect_port, settings.health_port) == (0, 2, None)
    assert (settings.auth_token, settings.tls) == ("t" * 32, None)


@pytest.mark.parametrize(
    ("value", "enabled"),
    [
        ({"enabled": True}, True),
        ({"enabled": False}, False),
        ({}, False),
        (False, False),
        (True, True),
        (None, False),
    ],
)
def test_checkpoint_enabled(value: Any, enabled: bool) -> None:
    assert GlobalConfig.from_document({"checkpoint": value}).checkpoint_enabled is enabled


def test_checkpoint_and_observability_absent_are_off() -> None:
    config = GlobalConfig.from_document({"m": entry()})
    assert config.checkpoint_enabled is False
    assert config.observability_enabled is False
    assert GlobalConfig.from_document({"observability_enabled": True}).observability_enabled is True


@pytest.mark.parametrize("port", [0, 65536, 70000, -1, "8000", 8000.0, True, None])
def test_bad_port_is_a_config_error_naming_the_server(port: Any) -> None:
    with pytest.raises(ConfigError, match=r"'model'.*port"):
        GlobalConfig.from_document({"model": entry(port)})


def test_non_string_host_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"'model'.*host"):
        GlobalConfig.from_document({"model": entry(host=127)})  # type: ignore[arg-type]


def test_non_mapping_document_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="mapping"):
        GlobalConfig.from_document(["not", "a", "mapping"])  # type: ignore[arg-type]


# --- interpolations and the exact JSON ---


def test_omegaconf_interpolations_are_resolved() -> None:
    doc = {
        "shared": {"host": "127.0.0.1", "port": 8400},
        "model": entry(port="${shared.port}", host="${shared.host}"),  # type: ignore[arg-type]
        "label": "served at ${shared.host}",
    }
    config = GlobalConfig.from_document(doc)
    model = config.servers["model"]
    assert (model.host, model.port) == ("127.0.0.1", 8400)
    assert config.document["label"] == "served at 127.0.0.1"
    assert "${" not in config.config_json


def test_unresolvable_interpolation_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="interpolation"):
        GlobalConfig.from_document({"model": entry(host="${missing.key}")})


def test_config_json_is_exact() -> None:
    doc = {
        "model": entry(8000, limits={"max": 7, "ratio": 0.5, "on": True, "none": None}, tags=["ü", "✓", [1, [2]]]),
        "name": "Grüße 🎉",
    }
    config = GlobalConfig.from_document(doc)
    assert json.loads(config.config_json) == doc
    assert "Grüße 🎉" in config.config_json  # not \u-escaped
    assert isinstance(
        json.loads(config.config_json)["model"]["responses_api_models"]["responses_api_models_impl"]["limits"][
            "max"
        ],
        int,
    )


# --- version ---


def test_version_is_stable_for_equal_documents() -> None:
    first = GlobalConfig.from_document({"model": entry(8000), "checkpoint": {"enabled": True}})
    second = GlobalConfig.from_document({"model": entry(8000), "checkpoint": {"enabled": True}})
    assert first.version == second.version
    assert first.version == "f2e8c42534a4f933"  # the first 16 hex digits of the canonical JSON's SHA-256


@pytest.mark.parametrize(
    "changed",
    [
        {"model": entry(8001), "checkpoint": {"enabled": True}},
        {"model": entry(8000), "checkpoint": {"enabled": False}},
        {"model": entry(8000, note="x"), "checkpoint": {"enabled": True}},
        {"model": entry(8000), "checkpoint": {"enabled": True}, "extra": 1},
    ],
)
def test_version_differs_for_different_documents(changed: dict[str, Any]) -> None:
    base = GlobalConfig.from_document({"model": entry(8000), "checkpoint": {"enabled": True}})
    assert GlobalConfig.from_document(changed).version != base.version


# --- addresses ---


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("0.0.0.0", "127.0.0.1"),
        ("::", "::1"),
        ("[::]", "::1"),
        ("", "127.0.0.1"),
        ("127.0.0.1", "127.0.0.1"),
        ("::1", "::1"),
        ("localhost", "localhost"),
        ("10.1.2.3", "10.1.2.3"),
        ("model.example.internal", "model.example.internal"),
    ],
)
def test_connectable_host(host: str, expected: str) -> None:
    assert connectable_host(host) == expected


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("::1", "[::1]"),
        ("[::1]", "[::1]"),
        ("fe80::1", "[fe80::1]"),
        ("127.0.0.1", "127.0.0.1"),
        ("localhost", "localhost"),
    ],
)
def test_url_host_brackets_ipv6_only(host: str, expected: str) -> None:
    assert url_host(host) == expected


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        ("0.0.0.0", 8000, "http://127.0.0.1:8000"),
        ("::", 8001, "http://[::1]:8001"),
        ("::1", 8002, "http://[::1]:8002"),
        ("localhost", 8003, "http://localhost:8003"),
    ],
)
def test_base_url(host: str, port: int, expected: str) -> None:
    assert base_url(host, port) == expected


def test_server_url_uses_the_connectable_host() -> None:
    config = GlobalConfig.from_document({"any": entry(9000, host="0.0.0.0"), "v6": entry(9001, host="::")})
    assert config.servers["any"].url == "http://127.0.0.1:9000"
    assert config.servers["v6"].url == "http://[::1]:9001"
    assert config.servers["any"].host == "0.0.0.0"  # the bind address itself is kept


# --- redaction ---


def test_redact_secrets_on_nested_keys() -> None:
    doc: dict[str, Any] = {
        "model": {"t": {"i": {"host": "h", "port": 1, "api_key": "sk-1", "headers": {"Auth_Token": "t"}}}},
        "list": [{"password": "p", "user": "u"}, "plain", 3],
        "client_secret": {"nested": "whole value hidden"},
    }
    redacted = redact_secrets(doc)
    assert redacted == {
        "model": {"t": {"i": {"host": "h", "port": 1, "api_key": REDACTED, "headers": {"Auth_Token": REDACTED}}}},
        "list": [{"password": REDACTED, "user": "u"}, "plain", 3],
        "client_secret": REDACTED,
    }
    assert doc["model"]["t"]["i"]["api_key"] == "sk-1"  # the input is untouched


def test_redaction_keeps_flags_and_numbers_under_secret_looking_keys() -> None:
    doc = {
        "vllm": {"return_token_id_information": False, "token_budget": 512, "hf_token": "hf_x", "api_key": None}
    }
    assert redact_secrets(doc) == {
        "vllm": {"return_token_id_information": False, "token_budget": 512, "hf_token": REDACTED, "api_key": None}
    }


@pytest.mark.parametrize(
    "key",
    [
        "Authorization",
        "proxy_authorization",
        "credential",
        "gcp_credentials",
        "private_key",
        "privateKey",
        "ssh_private_key_pem",
        "hf_token",
        "DB_PASSWORD",
    ],
)
def test_secret_keys_match_markers_as_whole_words(key: str) -> None:
    assert is_secret_key(key)
    assert redact_secrets({key: "value"}) == {key: REDACTED}


@pytest.mark.parametrize(
    "key", ["max_tokens", "tokenizer", "private", "key", "private_keys_dir", "credentialing", "authorized"]
)
def test_ordinary_keys_are_not_secret(key: str) -> None:
    assert not is_secret_key(key)


def test_redacted_json_hides_secrets_and_config_json_keeps_them() -> None:
    config = GlobalConfig.from_document({"model": entry(api_key="sk-live")})
    assert "sk-live" in config.config_json
    assert "sk-live" not in config.redacted_json
    assert (
        json.loads(config.redacted_json)["model"]["responses_api_models"]["responses_api_models_impl"]["api_key"]
        == REDACTED
    )


# --- lookups ---


def test_get_first_server_config_dict() -> None:
    doc = {"model": entry(8000, extra_setting=[1]), "checkpoint": {"enabled": True}}
    assert get_first_server_config_dict(doc, "model") == {"host": "127.0.0.1", "port": 8000, "extra_setting": [1]}


def test_get_first_server_config_dict_unknown_name_lists_known_servers() -> None:
    doc = {"model": entry(8000), "tools": entry(8200, server_type="resources_servers"), "checkpoint": {}}
    with pytest.raises(UnknownServerError) as caught:
        get_first_server_config_dict(doc, "nope")
    message = str(caught.value)
    assert "'nope'" in message
    assert "model" in message and "tools" in message
    assert "checkpoint" not in message
    assert caught.value.server_name == "nope"
    assert sorted(caught.value.known) == ["model", "tools"]


def test_get_first_server_config_dict_malformed_entry() -> None:
    with pytest.raises(ConfigError, match="'flat'"):
        get_first_server_config_dict({"flat": {"host": "h"}}, "flat")


def test_server_lookup_unknown_name_lists_known_servers() -> None:
    config = GlobalConfig.from_document({"model": entry(8000)})
    assert config.server("model").port == 8000
    with pytest.raises(UnknownServerError, match=r"unknown server 'ghost'; known servers: head_server, model"):
        config.server("ghost")


def test_with_head_server() -> None:
    doc = {"head_server": {"host": "0.0.0.0", "port": 0, "note": "kept"}, "model": entry()}
    config = GlobalConfig.from_document(doc)
    moved = config.with_head_server("127.0.0.1", 45678)
    assert (moved.head_server.host, moved.head_server.port) == ("127.0.0.1", 45678)
    assert moved.document["head_server"] == {"host": "127.0.0.1", "port": 45678, "note": "kept"}
    assert moved.version != config.version
    assert moved.servers == config.servers
    assert config.head_server.port == 0  # the original is unchanged
    assert moved.with_head_server("127.0.0.1", 45678) is moved


def test_with_head_server_when_the_document_has_none() -> None:
    config = GlobalConfig.from_document({"model": entry()})
    moved = config.with_head_server("::1", 12345)
    assert moved.document["head_server"] == {"host": "::1", "port": 12345}


# --- http_client ---


@pytest.mark.parametrize("multiplier", [0, -1, 0.5])
def test_retry_multiplier_below_one_is_a_config_error(multiplier: float) -> None:
    with pytest.raises(ConfigError, match="multiplier"):
        HttpClientSettings.from_document({"http_client": {"retry": {"multiplier": multiplier}}})
    assert HttpClientSettings.from_document({"http_client": {"retry": {"multiplier": 1}}}).retry.multiplier == 1


# --- assistant message headers ---


@pytest.mark.parametrize(
    ("source", "error"),
    [("raise RuntimeError('boom at import')\n", "RuntimeError"), ("def broken(:\n", "SyntaxError")],
)
def test_a_harness_package_that_fails_to_import_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, error: str
) -> None:
    module_name = f"gym_rpc_test_broken_harness_{error.lower()}"
    (tmp_path / f"{module_name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module_name, raising=False)
    harness = {"harness_package": module_name, "model_server": {"type": "responses_api_models", "name": "model"}}
    config = GlobalConfig.from_document(
        {"model": entry(8000), "agent": entry(8100, "127.0.0.1", "agents", **harness)}
    )
    with pytest.raises(ConfigError, match=rf"'agent'.*{module_name}.*{error}"):
        config.assistant_message_header("model")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("unix:/run/gym-rpc/relay.sock", "unix:/run/gym-rpc/relay.sock"),
        ("127.0.0.1:11090", "127.0.0.1:11090"),
        ("[::1]:11090", "[::1]:11090"),
        ("", None),
        (None, None),
    ],
)
def test_head_server_watch_relay_is_a_unix_socket_or_host_and_port(value: Any, expected: str | None) -> None:
    block = {"host": "127.0.0.1", "port": 1, "watch_relay": value}
    assert GlobalConfig.from_document({"head_server": block}).head_settings.watch_relay == expected


@pytest.mark.parametrize("value", ["unix:", "127.0.0.1:0", "::1", 11090])
def test_a_bad_head_server_watch_relay_fails_at_load_naming_the_key(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^head_server\.watch_relay: "):
        GlobalConfig.from_document({"head_server": {"host": "127.0.0.1", "port": 1, "watch_relay": value}})
