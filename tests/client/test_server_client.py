"""ServerClient's control-plane side: config loading (injected or from a real head), URL resolution, statuses,
checkpointing and assistant message headers."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf
from pydantic import ValidationError

from gym_rpc.client import server_client
from gym_rpc.client.control._clients import ControlClient
from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.server_client import ServerClient, get_server_url
from gym_rpc.config import BaseServerConfig
from gym_rpc.errors import ConfigError, HeadUnreachableError, UnknownServerError
from gym_rpc.wire import HEAD_ADDRESS_ENV_VAR
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port

CONFIG_ENV = "NEMO_GYM_CONFIG_DICT"
SLACK_SECONDS = 3.0  # on top of a deadline, for a loaded 2-core machine


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No inherited config, head address or model-server override; a fresh module-level client cache."""
    for name in (CONFIG_ENV, HEAD_ADDRESS_ENV_VAR, "NEMO_GYM_MODEL_SERVER_BASE_URL", "NEMO_GYM_MODEL_SERVER_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(server_client, "_clients", {})


@pytest.fixture(autouse=True)
async def _close_sessions() -> AsyncIterator[None]:
    yield
    await close_http_sessions()


def make_client(doc: dict[str, Any], head_port: int | None = None) -> ServerClient:
    head = BaseServerConfig(host=LOOPBACK, port=head_port or closed_port())
    return ServerClient(head_server_config=head, global_config_dict=OmegaConf.create(doc))


def head_config(port: int) -> BaseServerConfig:
    return BaseServerConfig(host=LOOPBACK, port=port)


# --- config injected by a parent: no network ---------------------------------------------------------------------


@pytest.mark.parametrize("dump", [yaml.safe_dump, json.dumps], ids=["yaml", "json"])
async def test_injected_config_never_asks_the_head(monkeypatch: pytest.MonkeyPatch, dump: Any) -> None:
    """SECURITY.md: processes launched with NEMO_GYM_CONFIG_DICT never ask the head, not even about a
    wildcard-bound server (dialled on loopback). The head's port is a listening socket nobody accepts on: any
    attempt to ask the head would leave a connection in its backlog."""
    with socket.create_server((LOOPBACK, 0)) as head_listener:
        head_listener.setblocking(False)
        head_port = int(head_listener.getsockname()[1])
        doc = {
            "head_server": {"host": LOOPBACK, "port": head_port},
            "policy": server_entry(8000, host="0.0.0.0"),
            "checkpoint": {"enabled": True},
        }
        monkeypatch.setenv(CONFIG_ENV, dump(doc))
        client = ServerClient.load_from_global_config()
        assert client.head_server_config.port == head_port
        assert OmegaConf.to_container(client.global_config_dict) == doc
        assert client._resolve_base_url("policy") == "http://127.0.0.1:8000"
        assert await client._aresolve_base_url("policy") == "http://127.0.0.1:8000"
        assert get_server_url("policy") == "http://127.0.0.1:8000"
        assert client.checkpoint_enabled() is True
        with pytest.raises(BlockingIOError):
            head_listener.accept()  # nothing ever connected to the head


async def test_an_injected_client_asks_the_head_only_when_told(monkeypatch: pytest.MonkeyPatch, head_factory):
    """lookup_registered_servers() is the explicit lookup: then, and only then, the registered address is used."""
    head = await head_factory(document({"policy": server_entry(closed_port(), host="0.0.0.0")}))
    config_port = head.config.servers["policy"].port
    registered_port = closed_port()
    await ControlClient(head.address).register_server_instance("policy", listen_port=registered_port)
    monkeypatch.setenv(
        CONFIG_ENV, json.dumps({**head.config.document, "head_server": {"host": LOOPBACK, "port": head.port}})
    )
    client = ServerClient.load_from_global_config()
    assert await client._aresolve_base_url("policy") == f"http://127.0.0.1:{config_port}"  # not asked

    found = await asyncio.to_thread(client.lookup_registered_servers)

    assert found == {"policy": f"http://127.0.0.1:{registered_port}"}
    assert client._resolve_base_url("policy") == f"http://127.0.0.1:{registered_port}"


def test_head_server_config_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ServerClient.load_head_server_config() == BaseServerConfig(host="127.0.0.1", port=11000)
    monkeypatch.setenv(HEAD_ADDRESS_ENV_VAR, "[::1]:12345")
    assert ServerClient.load_head_server_config() == BaseServerConfig(host="::1", port=12345)
    monkeypatch.setenv(CONFIG_ENV, yaml.safe_dump({"head_server": {"host": "10.0.0.7", "port": 4000}}))
    assert ServerClient.load_head_server_config() == BaseServerConfig(host="10.0.0.7", port=4000)
    monkeypatch.delenv(CONFIG_ENV)
    monkeypatch.setenv(HEAD_ADDRESS_ENV_VAR, "no-port-here")
    with pytest.raises(ConfigError, match=HEAD_ADDRESS_ENV_VAR):
        ServerClient.load_head_server_config()


def test_get_server_url_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = document({"policy": server_entry(8000), "tools": server_entry(8200, "resources_servers")})
    doc["head_server"]["port"] = closed_port()
    monkeypatch.setenv(CONFIG_ENV, yaml.safe_dump(doc))
    monkeypatch.setenv("NEMO_GYM_MODEL_SERVER_BASE_URL", "http://gateway:9/ng-rollout/r1")
    monkeypatch.setenv("NEMO_GYM_MODEL_SERVER_NAME", "policy")
    assert get_server_url("policy") == "http://gateway:9/ng-rollout/r1"
    assert get_server_url("tools") == "http://127.0.0.1:8200"  # another name: from the (injected) config
    monkeypatch.setenv("NEMO_GYM_MODEL_SERVER_NAME", "other")
    assert get_server_url("policy") == "http://127.0.0.1:8000"
    assert server_client.setup_server_client() is server_client.setup_server_client()


def test_global_config_dict_is_a_dictconfig_given_and_read_back() -> None:
    """OmegaConf loads only with a DictConfig (tests/project/test_layers.py), yet the field is checked as it always
    was: a DictConfig is kept as given and a plain mapping is refused, naming the field."""
    head = head_config(closed_port())
    doc = {"head_server": {"host": LOOPBACK, "port": head.port}, "policy": server_entry(8000)}
    given = OmegaConf.create(doc)
    client = ServerClient(head_server_config=head, global_config_dict=given)
    assert client.global_config_dict is given
    assert client._resolve_base_url("policy") == "http://127.0.0.1:8000"
    assert isinstance(client.model_dump()["global_config_dict"], DictConfig)
    with pytest.raises(ValidationError, match="global_config_dict must be an OmegaConf DictConfig, not dict"):
        ServerClient(head_server_config=head, global_config_dict=doc)  # type: ignore[arg-type]  # as mypy says


# --- config from a real head -------------------------------------------------------------------------------------


async def test_load_from_real_head(head_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = document(
        {"policy": server_entry(8000), "tools": server_entry(8200, "resources_servers")},
        observability_enabled=True,
    )
    head = await head_factory(doc)
    client = await asyncio.to_thread(ServerClient.load_from_global_config, head_config(head.port))
    assert OmegaConf.to_container(client.global_config_dict) == head.config.document
    assert client.head_server_config.port == head.port
    assert client._resolve_base_url("tools") == "http://127.0.0.1:8200"

    monkeypatch.setenv(HEAD_ADDRESS_ENV_VAR, f"{LOOPBACK}:{head.port}")  # no argument: the env names the head
    from_env = await asyncio.to_thread(ServerClient.load_from_global_config)
    assert from_env.global_config_dict == client.global_config_dict


async def test_a_served_config_is_not_resolved_again(head_factory) -> None:
    """The head resolved its document at load: an escaped interpolation is literal `${...}` text in what it serves,
    and the client keeps it as text (resolving it again failed every client's load), with the head's version."""
    doc = document({"policy": server_entry(8000, prompt_template=r"answer in \${format}")})
    head = await head_factory(doc)
    assert head.config.servers["policy"].config["prompt_template"] == "answer in ${format}"
    client = await asyncio.to_thread(ServerClient.load_from_global_config, head_config(head.port))
    assert client._global_config.servers["policy"].config["prompt_template"] == "answer in ${format}"
    assert client._global_config.document == head.config.document
    assert client._global_config.version == head.config.version
    assert client._resolve_base_url("policy") == "http://127.0.0.1:8000"


def test_unreachable_head_fails_fast_with_its_address(monkeypatch: pytest.MonkeyPatch) -> None:
    port = closed_port()
    monkeypatch.setenv(HEAD_ADDRESS_ENV_VAR, f"{LOOPBACK}:{port}")
    started = time.monotonic()
    with pytest.raises(HeadUnreachableError, match=f"{LOOPBACK}:{port}"):
        ServerClient.load_from_global_config()
    assert time.monotonic() - started < 6.0  # within the control call's deadline


# --- URLs --------------------------------------------------------------------------------------------------------


def test_wildcard_hosts_become_connectable() -> None:
    assert ServerClient._client_host("0.0.0.0") == "127.0.0.1"
    assert ServerClient._client_host("::") == "[::1]"  # ready for f"http://{host}:{port}", as upstream
    assert server_client._connectable_client_host("") == "127.0.0.1"
    assert ServerClient._client_host("model.internal") == "model.internal"
    client = make_client(
        document(
            {
                "any4": server_entry(8000, host="0.0.0.0"),
                "any6": server_entry(8001, host="::"),
                "six": server_entry(8002, host="::1"),
            }
        )
    )
    assert client._resolve_base_url("any4") == "http://127.0.0.1:8000"
    assert client._resolve_base_url("any6") == "http://[::1]:8001"
    assert client._resolve_base_url("six") == "http://[::1]:8002"
    # A wildcard's loopback stand-in is not cached: the head is asked again later, in case the server registers.
    assert client._server_base_urls == {"six": "http://[::1]:8002"}
    assert client._build_server_base_url({"host": "::", "port": 1}) == "http://[::1]:1"


async def test_unknown_server_lists_known_names() -> None:
    client = make_client(
        document({"policy": server_entry(8000), "tools": server_entry(8200, "resources_servers")})
    )
    with pytest.raises(UnknownServerError, match=r"'nope'.*known servers: policy, tools"):
        client._resolve_base_url("nope")
    with pytest.raises(UnknownServerError, match="policy, tools"):
        await client.post("nope", "/v1/responses", json={})
    with pytest.raises(UnknownServerError, match="policy, tools"):
        client.assistant_message_header("nope")


# --- status over gRPC --------------------------------------------------------------------------------------------


async def test_poll_for_status_all_four(head_factory, http_server, silent_server, malformed_server) -> None:
    doc = document(
        {
            "live": server_entry(await http_server()),
            "closed": server_entry(closed_port(), "resources_servers"),
            "silent": server_entry(silent_server, "responses_api_agents"),
            "malformed": server_entry(malformed_server),
        }
    )
    head = await head_factory(doc)
    client = make_client(doc, head.port)

    def poll(name: str, timeout_seconds: float = 5) -> tuple[str, float]:
        started = time.monotonic()
        status = client.poll_for_status(name, timeout_seconds)
        return status, time.monotonic() - started

    assert (await asyncio.to_thread(poll, "live"))[0] == "success"
    assert (await asyncio.to_thread(poll, "closed"))[0] == "connection_error"
    assert (await asyncio.to_thread(poll, "malformed"))[0] == "unknown_error"
    assert (await asyncio.to_thread(poll, "head_server"))[0] == "success"
    status, elapsed = await asyncio.to_thread(poll, "silent", 1.0)
    assert status == "timeout"
    # Within the caller's 1 s budget; a background TIMEOUT inside the head's freshness window answers sooner.
    assert elapsed < 1.0 + SLACK_SECONDS
    with pytest.raises(UnknownServerError, match="live"):
        await asyncio.to_thread(client.poll_for_status, "nope")


def test_poll_for_status_head_unreachable() -> None:
    client = make_client(document({"live": server_entry(8000)}))  # the head's port is closed
    started = time.monotonic()
    assert client.poll_for_status("live", timeout_seconds=3) == "connection_error"
    assert client.poll_for_status("head_server", timeout_seconds=3) == "connection_error"
    assert time.monotonic() - started < 4.0


async def test_poll_for_status_with_and_without_a_loop_in_the_thread(head_factory, http_server) -> None:
    doc = document({"live": server_entry(await http_server())})
    head = await head_factory(doc)
    client = make_client(doc, head.port)
    results: list[str] = []

    def plain_thread() -> None:  # no event loop at all in this thread
        results.append(client.poll_for_status("live", 2))

    async def inside_running_loop() -> str:  # a loop runs in this thread while the blocking call is made
        return client.poll_for_status("live", 2)

    thread = threading.Thread(target=plain_thread)
    thread.start()
    await asyncio.to_thread(thread.join, 10)
    assert results == ["success"]
    assert await asyncio.to_thread(asyncio.run, inside_running_loop()) == "success"


# --- checkpointing and assistant message headers -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("block", "expected"),
    [({"checkpoint": {"enabled": True}}, True), ({"checkpoint": {"enabled": False}}, False), ({}, False)],
    ids=["enabled", "disabled", "absent"],
)
def test_checkpoint_enabled(block: dict[str, Any], expected: bool) -> None:
    client = make_client(document({"policy": server_entry(8000)}, **block))
    assert client.checkpoint_enabled() is expected
    assert client._checkpoint_enabled is expected  # cached


def agent(model_server: str, port: int, **extra: Any) -> dict[str, Any]:
    return server_entry(
        port,
        "responses_api_agents",
        model_server={"type": "responses_api_models", "name": model_server},
        **extra,
    )


def harness_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, header: str) -> str:
    """A light harness package declaring ASSISTANT_MESSAGE_HEADER, importable from tmp_path."""
    name = f"harness_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(f"ASSISTANT_MESSAGE_HEADER = {header!r}\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_assistant_message_header_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = harness_module(tmp_path, monkeypatch, "<|assistant|>")
    doc = document(
        {
            "policy": server_entry(8000),
            "judge": server_entry(8001),
            "bare": server_entry(8002),
            "from_entry": agent("policy", 8100, assistant_message_header="<|assistant|>"),
            "from_package": agent("policy", 8101, harness_package=package),
            "judge_agent": agent("judge", 8102, harness_package=package),
            "silent_agent": agent("bare", 8103),
        }
    )
    client = make_client(doc)
    assert client.assistant_message_header("policy") == b"<|assistant|>"  # entry and package agree
    assert client.assistant_message_header("judge") == b"<|assistant|>"  # from the harness package alone
    assert client.assistant_message_header("bare") is None  # nobody declares one


def test_assistant_message_header_disagreement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = harness_module(tmp_path, monkeypatch, "<assistant>")
    doc = document(
        {
            "policy": server_entry(8000),
            "first": agent("policy", 8100, assistant_message_header="<|assistant|>"),
            "second": agent("policy", 8101, harness_package=package),
        }
    )
    with pytest.raises(ConfigError, match="different assistant message headers: first, second"):
        make_client(doc).assistant_message_header("policy")
