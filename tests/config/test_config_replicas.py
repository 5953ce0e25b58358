"""Static replicas in the config: the `replicas:` key under a server entry, beside its host and port.

Every instance of a server is in `ServerEntry.instances`, the entry's own address first; a bad replica is one
ConfigError line naming the server and the replica; an address listed twice is refused; a config without the key
is read exactly as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gym_rpc.config import GlobalConfig, InstanceAddress, load_config_file
from gym_rpc.errors import ConfigError


def config_with(replicas: Any, host: str = "10.0.0.1", port: int = 8000) -> GlobalConfig:
    entry: dict[str, Any] = {"host": host, "port": port, "entrypoint": "app.py"}
    if replicas is not ...:
        entry["replicas"] = replicas
    return GlobalConfig.from_document({"policy_model": {"responses_api_models": {"vllm_model": entry}}})


def test_the_instances_are_the_entrys_own_address_then_the_replicas_in_order() -> None:
    entry = config_with([{"host": "10.0.0.2", "port": 8000}, "10.0.0.3:8001", "[fd00::7]:8000"]).server(
        "policy_model"
    )
    assert entry.instances == (
        InstanceAddress("10.0.0.1", 8000, "http://10.0.0.1:8000"),
        InstanceAddress("10.0.0.2", 8000, "http://10.0.0.2:8000"),
        InstanceAddress("10.0.0.3", 8001, "http://10.0.0.3:8001"),
        InstanceAddress("fd00::7", 8000, "http://[fd00::7]:8000"),
    )
    assert [i.instance_id for i in entry.instances] == [
        "10.0.0.1:8000",
        "10.0.0.2:8000",
        "10.0.0.3:8001",
        "[fd00::7]:8000",
    ]
    # The entry itself is what it always was: its own host, port and URL; the key stays in its config block.
    assert (entry.host, entry.port, entry.url) == ("10.0.0.1", 8000, "http://10.0.0.1:8000")
    assert entry.config["replicas"][1] == "10.0.0.3:8001"


@pytest.mark.parametrize("replicas", [..., None, []])
def test_an_entry_without_replicas_has_one_instance(replicas: Any) -> None:
    entry = config_with(replicas).server("policy_model")
    assert entry.instances == (InstanceAddress("10.0.0.1", 8000, "http://10.0.0.1:8000"),)
    assert entry.replicas == ()


def test_a_wildcard_replica_is_dialled_on_loopback_as_a_wildcard_entry_is() -> None:
    entry = config_with(["0.0.0.0:8001"], host="0.0.0.0").server("policy_model")
    assert [i.url for i in entry.instances] == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        ("10.0.0.2:8000", r"replicas must be a list .* not str"),
        ({"host": "10.0.0.2", "port": 8000}, r"replicas must be a list .* not dict"),
        ([8000], r"replicas\[0\] must be a \{host, port\} mapping or a \"host:port\" string, not int"),
        (["10.0.0.2"], r"replicas\[0\] '10.0.0.2': expected HOST:PORT"),
        (["10.0.0.2:99999"], r"replicas\[0\] '10.0.0.2:99999': expected HOST:PORT"),
        ([{"host": "10.0.0.2"}], r"replicas\[0\] has no port"),
        ([{"port": 1}], r"replicas\[0\] has no host"),
        ([{"host": "10.0.0.2", "port": 1, "weight": 2}], r"replicas\[0\]: unknown key 'weight'"),
        ([{"host": 7, "port": 1}], r"replicas\[0\]: host must be a string, not int"),
        ([{"host": "a", "port": True}], r"replicas\[0\]: port must be an integer in 1..65535, not True"),
        (["ok:1", {"host": "b", "port": 0}], r"replicas\[1\]: port must be an integer in 1..65535, not 0"),
        ([{"host": "evil.example/x#", "port": 1}], r"replicas\[0\]: host 'evil.example/x#' is neither"),
        ([{"host": "user@node", "port": 1}], r"replicas\[0\]: host 'user@node' is neither"),
        ([{"host": "node:9", "port": 1}], r"replicas\[0\]: host 'node:9' is neither"),
        ([{"host": " ", "port": 1}], r"replicas\[0\]: host ' ' is neither"),
    ],
)
def test_a_bad_replica_is_one_line_naming_the_server_and_the_replica(replicas: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^server 'policy_model': {message}") as refused:
        config_with(replicas)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        (["10.0.0.1:8000"], r"replicas\[0\] 10.0.0.1:8000 is listed twice: it is also the entry's own address"),
        (["10.0.0.2:8000", {"host": "10.0.0.2", "port": 8000}], r"replicas\[1\] .* also replicas\[0\]"),
        (["[fd00::7]:1", {"host": "fd00::7", "port": 1}], r"replicas\[1\] \[fd00::7\]:1 is listed twice"),
    ],
)
def test_an_address_listed_twice_is_refused(replicas: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_with(replicas)


def test_a_wildcard_replica_and_the_wildcard_entry_at_one_port_are_one_address() -> None:
    with pytest.raises(ConfigError, match=r"replicas\[0\] 127.0.0.1:8000 is listed twice"):
        config_with(["0.0.0.0:8000"], host="0.0.0.0")


def test_a_bad_replica_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "gym.yaml"
    path.write_text(
        "policy_model:\n  responses_api_models:\n    vllm_model:\n      host: 10.0.0.1\n      port: 8000\n"
        "      replicas: [10.0.0.2]\n"
    )
    with pytest.raises(ConfigError, match=rf"^{path}: server 'policy_model': replicas\[0\]"):
        load_config_file(path)


def test_replicas_from_interpolations_are_resolved_and_unresolvable_ones_only_fail_that_server() -> None:
    document = {
        "replica_port": 8001,
        "policy_model": {
            "responses_api_models": {
                "vllm_model": {"host": "10.0.0.1", "port": 8000, "replicas": ["10.0.0.2:${replica_port}"]}
            }
        },
        "judge": {
            "resources_servers": {
                "judge": {
                    "host": "10.0.0.9",
                    "port": 9000,
                    "replicas": [{"host": "${oc.env:NO_SUCH_VAR_X}", "port": 1}],
                }
            }
        },
    }
    with pytest.raises(ConfigError):
        GlobalConfig.from_document(document)  # the head refuses what it cannot resolve
    lenient = GlobalConfig.from_document(document, lenient=True)  # a client handed the config calls what it can
    assert [i.url for i in lenient.server("policy_model").instances][1] == "http://10.0.0.2:8001"
    with pytest.raises(ConfigError, match=r"server 'judge' cannot be called: cannot resolve judge\..*replicas"):
        lenient.server("judge")
