"""The head's NeMo Gym HTTP endpoints, read the way NeMo Gym's own client reads them (`requests`, no timeout option
of ours, `OmegaConf.create(json.loads(body))`)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from typing import Any

import pytest
import requests
import yaml
from aiohttp import web
from omegaconf import OmegaConf

from gym_rpc.client.control._clients import SyncControlClient
from gym_rpc.config import REDACTED
from gym_rpc.errors import GymRpcError
from gym_rpc.server._head import HeadServer
from tests.support.cli import STARTUP_SECONDS, running_cli
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port

HTTP_TIMEOUT = 5.0
BANNER = re.compile(r"listening on (\S+) .*NeMo Gym HTTP head on (http://\S+)")


def nemo_gym_load_config(base: str) -> dict[str, Any]:
    """What NeMo Gym's ServerClient.load_from_global_config does with the head's answer, as a plain dict."""
    response = requests.get(f"{base}/global_config_dict_yaml", timeout=HTTP_TIMEOUT)
    response.raise_for_status()
    config = OmegaConf.create(json.loads(response.text))
    container = OmegaConf.to_container(config, resolve=True)
    assert isinstance(container, dict)
    return {str(k): v for k, v in container.items()}


def http_base(head: HeadServer) -> str:
    assert head.http_port is not None, "the head serves no HTTP endpoints"
    return f"http://{LOOPBACK}:{head.http_port}"


def served_document(doc: dict[str, Any], head_server: dict[str, Any]) -> dict[str, Any]:
    """What the head serves for a `secret_document`, written out: its head_server, policy_model's api_key (the
    one secret) redacted, max_tokens kept."""
    policy = doc["policy_model"]["responses_api_models"]["responses_api_models_impl"]
    assert (policy["api_key"], policy["max_tokens"]) == ("sk-live-123", 64)
    return {
        **doc,
        "head_server": head_server,
        "policy_model": {
            "responses_api_models": {"responses_api_models_impl": {**policy, "api_key": "<redacted>"}}
        },
    }


def secret_document(model_port: int, agent_port: int) -> dict[str, Any]:
    return document(
        {
            "policy_model": server_entry(model_port, entrypoint="app.py", api_key="sk-live-123", max_tokens=64),
            "simple_agent": server_entry(
                agent_port,
                "responses_api_agents",
                entrypoint="app.py",
                model_server={"type": "responses_api_models", "name": "policy_model"},
            ),
        },
        checkpoint={"enabled": True},
        observability_enabled=True,
    )


async def wait_for_statuses(base: str, wanted: dict[str, str], timeout: float = 5.0) -> list[dict[str, Any]]:
    """Poll /server_instances until every named server shows the wanted status."""
    deadline = time.monotonic() + timeout
    while True:
        response = await asyncio.to_thread(requests.get, f"{base}/server_instances", timeout=HTTP_TIMEOUT)
        instances: list[dict[str, Any]] = response.json()
        statuses = {i["process_name"]: i["status"] for i in instances}
        if all(statuses.get(name) == status for name, status in wanted.items()):
            return instances
        assert time.monotonic() < deadline, f"statuses stayed {statuses}, wanted {wanted}"
        await asyncio.sleep(0.05)


async def test_nemo_gym_client_gets_the_same_document_as_grpc_with_secrets_redacted(head_factory, http_server):
    head = await head_factory(secret_document(await http_server(), closed_port()), http_port=0)
    base = http_base(head)

    loaded = await asyncio.to_thread(nemo_gym_load_config, base)
    over_grpc = await asyncio.to_thread(lambda: SyncControlClient(head.address).get_global_config().document)

    assert loaded == over_grpc == served_document(head.config.document, {"host": LOOPBACK, "port": head.port})
    entry = loaded["policy_model"]["responses_api_models"]["responses_api_models_impl"]
    assert entry["api_key"] == REDACTED
    assert entry["max_tokens"] == 64  # an ordinary setting is not mistaken for a secret
    assert loaded["head_server"]["port"] == head.port  # where the gRPC head really listens


async def test_config_body_is_a_json_string_literal_of_yaml_like_fastapi_answers(head_factory):
    head = await head_factory(secret_document(closed_port(), closed_port()), http_port=0)

    response = await asyncio.to_thread(
        requests.get, f"{http_base(head)}/global_config_dict_yaml", timeout=HTTP_TIMEOUT
    )

    assert response.status_code == 200
    assert response.headers["Content-Type"] == "application/json"
    assert response.text.startswith('"') and response.text.endswith('"')
    text = json.loads(response.text)
    assert isinstance(text, str)
    assert yaml.safe_load(text) == served_document(head.config.document, {"host": LOOPBACK, "port": head.port})
    assert "sk-live-123" not in response.text


async def test_server_instances_list_nemo_gym_fields_and_probed_status(head_factory, http_server):
    live_port, dead_port = await http_server(), closed_port()
    head = await head_factory(secret_document(live_port, dead_port), http_port=0)

    instances = await wait_for_statuses(
        http_base(head), {"policy_model": "success", "simple_agent": "connection_error"}
    )

    by_name = {i["process_name"]: i for i in instances}
    assert set(by_name) == {"policy_model", "simple_agent"}
    model = by_name["policy_model"]
    assert model["server_type"] == "responses_api_models"
    assert model["name"] == "responses_api_models_impl"  # NeMo Gym's `name` is the implementation
    assert model["config_path"] == "policy_model"
    assert (model["host"], model["port"]) == (LOOPBACK, live_port)
    assert model["url"] == f"http://{LOOPBACK}:{live_port}"
    assert model["entrypoint"] == "app.py"
    assert model["pid"] is None  # the head launched nothing
    assert model["start_time"] == pytest.approx(head.start_time)
    assert by_name["simple_agent"]["port"] == dead_port


async def test_liveness_answers_ok(head_factory):
    head = await head_factory(secret_document(closed_port(), closed_port()), http_port=0)

    response = await asyncio.to_thread(requests.get, f"{http_base(head)}/", timeout=HTTP_TIMEOUT)

    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


async def test_readiness_answers_starting_until_the_first_probe_round_is_done(head_factory, http_server):
    """NeMo Gym 0.7.0's head endpoints: /livez and / are alive at once; /readyz, /healthz and /health answer 503
    {"status": "starting"} while the first probe round is still out (its server holds the probe), then 200."""
    release = asyncio.Event()

    async def held_until_released(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/", held_until_released)
    held = await http_server(app)
    head = await head_factory(
        secret_document(held, closed_port()), http_port=0, probe_timeout_seconds=60, probe_interval_seconds=60
    )
    base = http_base(head)

    async def get(path: str) -> requests.Response:
        return await asyncio.to_thread(requests.get, f"{base}{path}", timeout=HTTP_TIMEOUT)

    try:
        for path in ("/", "/livez"):
            alive = await get(path)
            assert (alive.status_code, alive.json()) == (200, {"status": "ok"}), path
        for path in ("/readyz", "/healthz", "/health"):
            starting = await get(path)
            assert (starting.status_code, starting.json()) == (503, {"status": "starting"}), path
    finally:
        release.set()  # a failed assertion must not leave the probe held past the test
    deadline = time.monotonic() + 30
    while (await get("/readyz")).status_code != 200:
        assert time.monotonic() < deadline, "the head never became ready after its first probe round"
        await asyncio.sleep(0.05)
    assert head.prober.rounds >= 1
    for path in ("/readyz", "/healthz", "/health", "/livez", "/"):
        ready = await get(path)
        assert (ready.status_code, ready.json()) == (200, {"status": "ok"}), path


async def test_http_port_from_the_config_key_and_reload_serves_the_new_version(head_factory, tmp_path):
    doc = secret_document(closed_port(), closed_port())
    doc["head_server"]["http_port"] = 0
    head = await head_factory(doc)
    base = http_base(head)
    assert (await asyncio.to_thread(nemo_gym_load_config, base))["checkpoint"] == {"enabled": True}

    doc["checkpoint"] = {"enabled": False}
    (tmp_path / "config0.yaml").write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    assert await head.reload()

    assert (await asyncio.to_thread(nemo_gym_load_config, base))["checkpoint"] == {"enabled": False}


async def test_no_http_endpoints_unless_asked(head_factory):
    head = await head_factory(secret_document(closed_port(), closed_port()))

    assert head.http_port is None


async def test_a_taken_http_port_is_a_clear_error(head_factory, http_server):
    taken = await http_server()

    with pytest.raises(GymRpcError, match=rf"cannot serve NeMo Gym's HTTP head on {LOOPBACK}:{taken}"):
        await head_factory(secret_document(closed_port(), closed_port()), http_port=taken)


def test_cli_head_http_port_prints_the_address_and_serves_nemo_gym_clients(tmp_path):
    path = tmp_path / "config.yaml"
    doc = secret_document(closed_port(), closed_port())
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    args = ["head", "--port", "0", "--http-port", "0", "--probe-interval", "0.1", "--config", str(path)]

    with running_cli(args) as head:
        match = head.wait_for_line(BANNER, STARTUP_SECONDS)
        grpc_address, base = match.group(1), match.group(2)
        loaded = nemo_gym_load_config(base)
        head.process.send_signal(signal.SIGTERM)
        assert head.wait(timeout=10) == 0

    assert loaded["head_server"]["port"] == int(grpc_address.rsplit(":", 1)[1])
    assert loaded == served_document(doc, {"host": LOOPBACK, "port": int(grpc_address.rsplit(":", 1)[1])})
