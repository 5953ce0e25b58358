"""The config's exact answers: bounded YAML loading, one-line validation errors naming what was wrong, durations
and ports at their bounds, hosts and addresses, lenient documents, reprs that redact.

Found by mutation testing (`make mutate`, bench/MUTATION.md; these tests were tests/test_exact_behaviour.py):
exact answers no other test pinned down. Each test names the mutant class it kills: a change to the code
that left the rest of the suite green.
"""

from __future__ import annotations

import datetime
import inspect
import sys
import tracemalloc
import types
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from gym_rpc import config as config_module
from gym_rpc.client.data._http_settings import HttpClientSettings
from gym_rpc.config import (
    BaseServerConfig,
    GlobalConfig,
    ServerEntry,
    get_first_server_config_dict,
    load_config_file,
    parse_config_text,
    validation_error_line,
)
from gym_rpc.config import _parsing as config_parsing
from gym_rpc.errors import (
    ConfigError,
)
from gym_rpc.server.fleet._prober import StatusProber
from gym_rpc.server.security._auth import (
    server_options,
)


def test_server_config_repr_redacts_only_secret_keys() -> None:
    """`__repr_args__` redacts a value when its key is secret *and* the value may be a secret: not every text."""
    config = BaseServerConfig.model_validate(
        {"host": "127.0.0.1", "port": 8000, "api_key": "sk-1", "note": "hello", "n": 5}
    )
    assert repr(config) == "BaseServerConfig(host='127.0.0.1', port=8000, api_key='<redacted>', note='hello', n=5)"


@pytest.mark.parametrize("entry", [{"x": 1}, {"x": {"impl": 1}}], ids=["type-not-a-mapping", "impl-not-a-mapping"])
def test_a_misshapen_entry_is_named_in_one_exact_line(entry: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as caught:
        get_first_server_config_dict({"bad": entry}, "bad")
    assert str(caught.value) == "config entry 'bad' is not of the form {server_type: {impl: {...}}}"


@pytest.fixture
def small_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's bounds lowered (read from the module at each check), so their exact edges are cheap to hit."""
    monkeypatch.setattr(config_parsing, "MAX_CONFIG_VALUES", 9)
    monkeypatch.setattr(config_parsing, "MAX_CONFIG_DEPTH", 3)
    monkeypatch.setattr(config_parsing, "MAX_CONFIG_BYTES", 64)


VALUES_OVER = "refusing a config of more than 9 values (with its YAML aliases expanded)"


@pytest.mark.usefixtures("small_bounds")
def test_the_value_bound_counts_every_node_with_aliases_expanded() -> None:
    """Every node counts one, an alias the size of what it names: `a: &l [1, 2]` + `b: *l` is 1 (the mapping) +
    1 + 3 + 1 + 3 = 9 values, the bound: accepted. One value more is refused, naming where the count ran over."""
    assert parse_config_text("a: &l [1, 2]\nb: *l\n") == {"a": [1, 2], "b": [1, 2]}
    assert parse_config_text("a: [1, 2]\nb: [3, 4]\n") == {"a": [1, 2], "b": [3, 4]}
    for text, where in (("a: &l [1, 2, 3]\nb: *l\n", "v.yaml:2:4"), ("a: &l [1, 2]\nb: *l\nc: 1\n", "v.yaml:3:4")):
        with pytest.raises(ConfigError) as caught:
            parse_config_text(text, "v.yaml")
        assert str(caught.value) == f"{where}: {VALUES_OVER}"


@pytest.mark.usefixtures("small_bounds")
def test_the_depth_bound_is_exact_and_names_the_line() -> None:
    assert parse_config_text("a: {b: 1}\n") == {"a": {"b": 1}}  # three levels: the document, a, b
    with pytest.raises(ConfigError) as caught:
        parse_config_text("a:\n  b: {c: 1}\n", "d.yaml")
    assert str(caught.value) == "d.yaml:2:7: refusing a config nested more than 3 levels deep"


@pytest.mark.usefixtures("small_bounds")
def test_the_size_bound_is_exact_for_text_and_files(tmp_path: Path) -> None:
    exactly = "a: " + "x" * 60 + "\n"
    assert len(exactly) == 64 and parse_config_text(exactly) == {"a": "x" * 60}
    with pytest.raises(ConfigError) as caught:
        parse_config_text(exactly + " ", "t.yaml")
    assert str(caught.value) == "t.yaml: refusing a config larger than 0 MiB"
    path = tmp_path / "f.yaml"
    path.write_text(exactly, encoding="utf-8")
    assert load_config_file(path).document == {"a": "x" * 60}
    path.write_text(exactly + "#", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config_file(path)
    assert str(caught.value) == f"{path}: refusing a config larger than 0 MiB"


def test_a_file_over_16_mib_is_refused_after_reading_only_its_first_16_mib(tmp_path: Path) -> None:
    """load_config_file reads at most 16 MiB + 1 byte: a 256 MiB (sparse) file is refused without reading it."""
    path = tmp_path / "huge.yaml"
    with path.open("wb") as file:
        file.truncate(256 * 1024 * 1024)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as caught:
            load_config_file(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(caught.value) == f"{path}: refusing a config larger than 16 MiB"
    assert peak < 64 * 1024 * 1024, peak


def test_a_file_that_is_not_utf8_is_named_with_its_line_and_byte(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"\n# caf\xe9\nkey: 1\n")
    with pytest.raises(ConfigError) as caught:
        load_config_file(path)
    assert str(caught.value) == f"{path}:2: not UTF-8 text (byte 0xe9 at offset 6); save the file as UTF-8"


def test_a_missing_file_is_named_with_the_systems_reason(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config_file(path)
    assert str(caught.value) == f"cannot read config file {path}: No such file or directory"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: [1\n", "y.yaml:2:1: invalid YAML: expected ',' or ']', but got '<stream end>'"),
        ("a: *nowhere\n", "y.yaml:1:4: invalid YAML: found undefined alias 'nowhere'"),
        ("a: 1\n---\nb: 2\n", "y.yaml:2:1: invalid YAML: but found another document"),
        (
            "\nb: \x07\n",
            "y.yaml:2: invalid YAML: unacceptable character #x0007: special characters are not allowed",
        ),
        (
            "a: \x07\n\n\nb: 1\n",
            "y.yaml:1: invalid YAML: unacceptable character #x0007: special characters are not allowed",
        ),
        (
            "a: !!python/object:os.system x\n",
            "y.yaml:1:4: invalid YAML: could not determine a constructor for the tag "
            "'tag:yaml.org,2002:python/object:os.system'",
        ),
    ],
)
def test_invalid_yaml_is_one_line_naming_line_column_and_problem(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config_text(text, "y.yaml")
    assert str(caught.value) == message


def test_a_document_too_deep_for_pythons_stack_is_one_line() -> None:
    """parse_config_text: an embedding program's small recursion limit gives one line, not a RecursionError."""
    depth = len(inspect.stack(0))
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 60)
    try:
        with pytest.raises(ConfigError) as caught:
            parse_config_text("a: " + "[" * 90 + "]" * 90 + "\n", "r.yaml")
    finally:
        sys.setrecursionlimit(limit)
    assert str(caught.value) == "r.yaml: config nested too deeply to parse"


def test_duplicate_keys_are_refused_after_merge_keys_too() -> None:
    """Merge keys (`<<`) are not duplicates of each other, and a duplicate after one is still found."""
    base = "base: &b {x: 1}\nmore: &m {y: 2}\n"
    assert parse_config_text(base + "c:\n  <<: *b\n  <<: *m\n")["c"] == {"x": 1, "y": 2}
    with pytest.raises(ConfigError) as caught:
        parse_config_text(base + "c:\n  <<: *b\n  z: 1\n  z: 2\n", "m.yaml")
    assert str(caught.value) == "m.yaml:6:3: duplicate key 'z'"


class _Three(BaseModel):
    a: int
    b: int
    c: int


@pytest.mark.parametrize(
    ("given", "line"),
    [
        ({}, "blk.a: Field required (and 2 more problems)"),
        ({"c": 1}, "blk.a: Field required (and 1 more problem)"),
        ({"b": 1, "c": 1}, "blk.a: Field required"),
        (
            {"a": "x", "b": 1, "c": 1},
            "blk.a: Input should be a valid integer, unable to parse string as an integer",
        ),
    ],
)
def test_validation_errors_are_one_line_counting_the_others(given: dict[str, object], line: str) -> None:
    with pytest.raises(ValidationError) as caught:
        _Three.model_validate(given)
    assert validation_error_line(caught.value, "blk") == line


def test_a_server_entrys_repr_redacts_its_config_only() -> None:
    """ServerEntry.__repr_args__: the config block is redacted; name, host and URL are shown as they are, even
    when they look like a secret-named pair."""
    entry = ServerEntry(
        name="token=abc",
        server_type="t",
        impl_name="i",
        host="h",
        port=1,
        url="http://h:1",
        config={"api_key": "sk-1"},
    )
    assert repr(entry) == (
        "ServerEntry(name='token=abc', server_type='t', impl_name='i', host='h', port=1, url='http://h:1', "
        "config={'api_key': '<redacted>'})"
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "the x must be a positive number of seconds, not True"),
        ("1", "the x must be a positive number of seconds, not '1'"),
        (float("nan"), "the x must be a positive number of seconds, not nan"),
        (float("inf"), "the x must be a positive number of seconds, not inf"),
        (0, "the x must be a positive number of seconds, not 0"),
        (-1.5, "the x must be a positive number of seconds, not -1.5"),
        (0.04, "the x must be at least 0.05 seconds, not 0.04"),
    ],
)
def test_a_refused_duration_gets_one_exact_line(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config_module.checked_seconds(value, "the x", 0.05)  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_a_duration_equal_to_its_minimum_is_accepted_and_the_probe_interval_has_one() -> None:
    assert config_module.checked_seconds(0.05, "the x", 0.05) == 0.05
    assert config_module.checked_seconds(3, "the x") == 3.0
    with pytest.raises(ConfigError) as refused:
        config_module.checked_probe_interval(0.01)
    assert str(refused.value) == "the probe interval (--probe-interval) must be at least 0.05 seconds, not 0.01"


@pytest.mark.parametrize("value", [True, "80", 65536, -1])
def test_a_refused_port_gets_one_exact_line(value: object) -> None:
    with pytest.raises(ConfigError) as refused:
        config_module.checked_port(value, "the port")  # type: ignore[arg-type]
    assert str(refused.value) == f"the port must be in 0..65535 (0 picks a free port), not {value!r}"


def test_every_port_from_0_to_65535_is_accepted() -> None:
    assert [config_module.checked_port(port, "the port") for port in (0, 1, 65535, None)] == [0, 1, 65535, None]


def test_only_the_zone_separator_of_an_ipv6_literal_is_escaped_in_a_base_url() -> None:
    assert config_module.base_url("fe80::1%eth0", 80) == "http://[fe80::1%25eth0]:80"
    assert config_module.base_url("fe80::1%25eth0", 80) == "http://[fe80::1%25eth0]:80"  # already escaped
    assert config_module.base_url("fe80::1%a%b", 80) == "http://[fe80::1%25a%b]:80"
    assert config_module.base_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"


def test_wildcard_hosts_are_exactly_the_bind_everything_addresses() -> None:
    wildcards = ["", " 0.0.0.0 ", "::", "[::]", "*"]
    assert [config_module.is_wildcard_host(host) for host in wildcards] == [True] * 5
    assert [config_module.is_wildcard_host(host) for host in ("127.0.0.1", "::1", "localhost")] == [False] * 3


def test_a_document_that_is_no_mapping_or_no_json_or_unresolvable_gets_one_exact_line() -> None:
    circular: dict[str, object] = {}
    circular["self"] = circular
    refusals = {
        "a global config must be a mapping, not list": [1],
        "config is not representable as JSON: Circular reference detected": circular,
        "cannot resolve config interpolations: Interpolation key 'nope' not found": {"a": "${nope}"},
        # JSON with `default=str` takes a date; OmegaConf, which resolves the interpolation, does not
        "cannot resolve config interpolations: Value 'date' is not a supported primitive type": {
            "d": datetime.date(2024, 1, 2),
            "x": "${y}",
        },
    }
    for message, refused_document in refusals.items():
        with pytest.raises(ConfigError) as refused:
            GlobalConfig.from_document(refused_document)  # type: ignore[arg-type]
        assert str(refused.value).splitlines()[0] == message


def test_a_key_with_two_server_types_is_malformed_with_one_exact_reason() -> None:
    two_types = {"t1": {"i": {"host": "h", "port": 1}}, "t2": {"i": {"host": "h", "port": 2}}}
    loaded = GlobalConfig.from_document({"a": two_types})
    assert loaded.servers == {}
    assert loaded.malformed_servers == {"a": "it has 2 server types (t1, t2); one server name holds one type"}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (42, "the head must be a mapping or an object with host and port (such as a BaseServerConfig), not int"),
        ({"port": 1}, "the head has no host: a server config needs host and port"),
        ({}, "the head has no host and no port: a server config needs host and port"),
        ({"host": "h", "port": "x"}, "the head: 1 validation error for BaseServerConfig"),
    ],
)
def test_a_server_config_of_no_usable_shape_is_named(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config_module.as_server_config(value, "the head")  # type: ignore[arg-type]
    assert str(refused.value).splitlines()[0] == message


def test_an_unreadable_file_is_named_with_the_systems_reason_only(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        config_module.read_file_bytes(str(tmp_path / "ca.pem"), "the CA file")
    assert str(refused.value) == f"cannot read the CA file {tmp_path / 'ca.pem'}: No such file or directory"


def test_a_lenient_document_keeps_what_it_cannot_resolve_as_written_and_says_why() -> None:
    server = {"t": {"i": {"host": "${nope}", "port": 1}}}
    loaded = GlobalConfig.from_document({"a": [1, "${nope}"], "n": "${a.0}", "s": server}, lenient=True)
    assert loaded.document == {"a": [1, "${nope}"], "n": 1, "s": server}
    assert loaded.unresolved_servers == {"s": "s.t.i.host = '${nope}' (Interpolation key 'nope' not found)"}


def test_a_lenient_document_that_is_no_mapping_or_no_json_gets_one_exact_line() -> None:
    circular: dict[str, object] = {}
    circular["self"] = circular
    refusals = {
        "a global config must be a mapping, not list": [1],
        "config is not representable as JSON: Circular reference detected": circular,
        # JSON with `default=str` takes a date; OmegaConf, which resolves the interpolation, does not
        "cannot read config interpolations: Value 'date' is not a supported primitive type": {
            "d": datetime.date(2024, 1, 2),
            "x": "${y}",
        },
    }
    for message, refused_document in refusals.items():
        with pytest.raises(ConfigError) as refused:
            GlobalConfig.from_document(refused_document, lenient=True)  # type: ignore[arg-type]
        assert str(refused.value).splitlines()[0] == message


def test_chosen_deadlines_and_bound_replace_the_default_options() -> None:
    options = server_options(max_connections=7, handshake_timeout_seconds=1.5, connection_idle_seconds=2.0)
    names = [name for name, _ in options]
    for name in ("grpc.server_handshake_timeout_ms", "grpc.max_connection_idle_ms"):
        assert names.count(name) == 1
    assert dict(options)["grpc.server_handshake_timeout_ms"] == 1500
    assert dict(options)["grpc.max_connection_idle_ms"] == 2000
    assert dict(options)["grpc.max_allowed_incoming_connections"] == 7


def test_http_client_must_be_a_mapping_and_each_upstream_pool_key_is_read() -> None:
    with pytest.raises(ConfigError) as refused:
        HttpClientSettings.from_document({"http_client": [1]})
    assert str(refused.value) == "http_client must be a mapping, not list"
    only_per_host = HttpClientSettings.from_document({"global_aiohttp_connector_limit_per_host": 7})
    assert only_per_host.max_connections_per_host == 7


async def test_the_first_config_version_is_no_change_and_a_later_one_is() -> None:
    prober = StatusProber({})
    revision = prober.revision
    prober.set_config_version("a")
    assert prober.revision == revision
    prober.set_config_version("b")
    assert prober.revision == revision + 1


def test_server_config_block_resolves_a_dictconfig_into_plain_dicts() -> None:
    """Kills server_config_block mutants 3-6, 10, 11: a DictConfig is turned into plain, resolved dicts."""
    from omegaconf import OmegaConf

    block = config_module.server_config_block(
        OmegaConf.create({"host": "127.0.0.1", "port": "${p}", "p": 5, "tls": {"cert": "c"}})
    )
    assert block == {"host": "127.0.0.1", "port": 5, "p": 5, "tls": {"cert": "c"}}
    assert type(block["tls"]) is dict


def test_server_config_block_takes_an_object_with_only_host_or_only_port() -> None:
    """Kills server_config_block mutants 13, 14, 18-20, 24, 25: either attribute alone makes it a server config."""
    assert config_module.server_config_block(types.SimpleNamespace(host="h")) == {"host": "h"}
    assert config_module.server_config_block(types.SimpleNamespace(port=5)) == {"port": 5}


def test_from_document_names_the_first_unresolvable_global_key_read_at_once() -> None:
    """Kills from_document mutants 7, 8, 12, 13, 15, 17-19: the exact line for a global key needed at once."""
    reason = "'${oops}' (Interpolation key 'oops' not found)"
    documents: dict[str, dict[str, Any]] = {
        f"cannot resolve head_server.port: {reason}": {"head_server": {"host": "127.0.0.1", "port": "${oops}"}},
        f"cannot resolve head_server.tls.cert: {reason}": {
            "head_server": {"host": "127.0.0.1", "port": 1, "tls": {"cert": "${oops}"}}
        },
        f"cannot resolve observability_enabled: {reason}": {"observability_enabled": "${oops}"},
    }
    for message, unresolvable in documents.items():
        with pytest.raises(ConfigError) as caught:
            GlobalConfig.from_document(unresolvable, lenient=True)
        assert str(caught.value) == message


def test_from_document_refuses_a_non_mapping_head_or_a_non_json_value_with_one_exact_line() -> None:
    """Kills from_document mutants 29 and 62."""
    with pytest.raises(ConfigError) as caught:
        GlobalConfig.from_document({"head_server": 5})
    assert str(caught.value) == "head_server must be a mapping with host and port"
    with pytest.raises(ConfigError) as caught:
        GlobalConfig.from_document({"x": b"ab"}, lenient=True)
    not_json = "config is not representable as JSON: Object of type bytes is not JSON serializable"
    assert str(caught.value) == not_json


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("fe80::1%ethX", "[fe80::1%ethX]"),  # the zone is kept as written, whatever its letters
        ("fe80::1%a%b%c", "[fe80::1%a%b%c]"),  # only what comes before the first '%' must be an address
        ("[::1", "[::1]"),  # a stray bracket on either side is mended, not doubled
        ("::1]", "[::1]"),
    ],
)
def test_url_host_brackets_what_is_an_ipv6_address_before_its_zone(host: str, expected: str) -> None:
    """Kills url_host mutants 2, 3 and 9: the brackets stripped (and only they), the address split at the first
    '%'."""
    assert config_module.url_host(host) == expected


def test_a_server_entry_with_neither_host_nor_port_names_both() -> None:
    """Kills _malformed_server mutants 43 and 44: the missing keys are joined by ' and no '."""
    config = GlobalConfig.from_document(
        {"no_address": {"responses_api_models": {"impl": {"entrypoint": "app.py"}}}}
    )
    assert config.malformed_servers == {"no_address": "responses_api_models.impl has no host and no port"}
