"""The layers hold: a rollout worker importing ServerClient loads no server code.

`make lint` checks the layer, public-seam and no-cycle contracts statically (import-linter, pyproject's
[tool.importlinter]); these tests check what the contracts cannot express: what a real interpreter loads, and that
the curated exports and the architecture picture (docs/architecture.md) match the modules.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT
from tests.support.loopback import closed_port

# What `import gym_rpc.client.server_client` leaves for later (README's import time): gRPC, protobuf and the
# control client load on the first call to the head; aiohttp, asyncio and the data plane's settings with the first
# client or data-plane call (test below); OmegaConf with a DictConfig; PyYAML with the first YAML text; http.client
# with the first direct probe; OpenTelemetry's API with the first data-plane call (its tracing hook), a JSON log
# line or metrics switched on. pydantic-settings is no longer used at all.
LAZY_IMPORTS = (
    "grpc",
    "opentelemetry",
    "google.protobuf",
    "aiohttp",
    "asyncio",
    "omegaconf",
    "yaml",
    "pydantic_settings",
    "http.client",
    "gym_rpc.client.control._clients",
    "gym_rpc.client.data._http",
    "gym_rpc.client.data._http_settings",
)


def _lazy(loaded: list[str]) -> list[str]:
    return [m for m in loaded if any(m == lazy or m.startswith(lazy + ".") for lazy in LAZY_IMPORTS)]


def test_importing_server_client_loads_no_server_module() -> None:
    code = (
        "import gym_rpc.client.server_client as client, sys, json\n"
        "assert client.apply_rollout_prefix('http://h:1', 'r-1') == 'http://h:1/ng-rollout/r-1'  # no span: none\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    loaded = json.loads(result.stdout)
    assert "gym_rpc.client.server_client" in loaded
    assert _lazy(loaded) == []
    above_the_client = {"server", "integrations", "cli"}
    assert [m for m in loaded if m.split(".")[1:2] and m.split(".")[1] in above_the_client] == []


# A client that never asks the head makes one data-plane call (to a closed port: refused, so no server is needed).
_FIRST_CALL = """
import asyncio, sys
from omegaconf import OmegaConf
from gym_rpc.client.server_client import ServerClient
from gym_rpc.errors import ServerUnreachableError
document = {{"head_server": {{"host": "127.0.0.1", "port": 1}},
            "model": {{"responses_api_models": {{"m": {{"host": "127.0.0.1", "port": {port}}}}}}},
            "http_client": {{"retry": {{"attempts": 1}}}}}}
client = ServerClient(head_server_config=document["head_server"], global_config_dict=OmegaConf.create(document))
print("aiohttp" in sys.modules)
async def first_call():
    try:
        await client.post("model", "/v1/responses", json={{}})
    except ServerUnreachableError:
        print("aiohttp" in sys.modules)
    await client.aclose()
asyncio.run(first_call())
"""


def test_the_data_plane_imports_aiohttp_on_the_first_call() -> None:
    """aiohttp is most of what importing ServerClient would cost in memory: it comes with the first call."""
    result = subprocess.run(
        [sys.executable, "-c", _FIRST_CALL.format(port=closed_port())],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.split() == ["False", "True"], result.stderr


# A worker launched with its config injected (JSON, as launchers inject it): no OmegaConf or YAML until it reads
# global_config_dict, which is then the DictConfig NeMo Gym's code expects, pickles included.
_INJECTED_WORKER = """
import json, os, pickle, sys
os.environ["NEMO_GYM_CONFIG_DICT"] = json.dumps(
    {
        "head_server": {"host": "127.0.0.1", "port": 1},
        "policy": {"responses_api_models": {"m": {"host": "127.0.0.1", "port": 8000}}},
    }
)
from gym_rpc.client.server_client import ServerClient
client = ServerClient.load_from_global_config()
print(client._resolve_base_url("policy"), sorted(m for m in ("omegaconf", "yaml") if m in sys.modules))
config = client.global_config_dict
restored = pickle.loads(pickle.dumps(client)).global_config_dict
print(type(config).__name__, config.policy.responses_api_models.m.port, type(restored).__name__)
"""


def test_an_injected_worker_loads_omegaconf_only_when_it_reads_global_config_dict() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _INJECTED_WORKER], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["http://127.0.0.1:8000 []", "DictConfig 8000 DictConfig"]


ROUTED_WORKER = """
import asyncio, json, os, sys
from aiohttp import web

async def main():
    async def answer(request):
        return web.json_response({})

    ports, runners = [], []
    for _ in range(2):
        app = web.Application()
        app.router.add_post("/run", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        ports.append(runner.addresses[0][1])
    entry = {"host": "127.0.0.1", "port": ports[0], "replicas": [f"127.0.0.1:{ports[1]}"]}
    doc = {"head_server": {"host": "127.0.0.1", "port": 1}, "env": {"resources_servers": {"e": entry}}}
    os.environ["NEMO_GYM_CONFIG_DICT"] = json.dumps(doc)
    from gym_rpc.client.server_client import ServerClient

    client = ServerClient.load_from_global_config()
    for _ in range(4):
        async with await client.post("env", "/run", json={}) as response:
            assert response.status == 200
    assert client._routing is not None and "env" in client._routing.routes
    for runner in runners:
        await runner.cleanup()

asyncio.run(main())
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("gym_rpc", "grpc", "google.protobuf")))))
"""


def test_a_worker_calling_a_replicated_server_loads_no_server_module_and_no_grpc() -> None:
    """Routing over static replicas (an injected config: no head followed) stays on the data plane's imports."""
    result = subprocess.run(
        [sys.executable, "-c", ROUTED_WORKER],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert "gym_rpc.client.replicas._routing" in loaded
    assert [
        m for m in loaded if m.startswith(("grpc", "google.protobuf", "gym_rpc.client.control._clients"))
    ] == []
    above_the_client = {"server", "integrations", "cli"}
    assert [m for m in loaded if m.split(".")[1:2] and m.split(".")[1] in above_the_client] == []


@pytest.mark.parametrize(
    "package", ["gym_rpc", "gym_rpc.wire", "gym_rpc.client", "gym_rpc.server", "gym_rpc.integrations"]
)
def test_every_curated_export_resolves(package: str) -> None:
    """A lazy export names its module in a string: a rename that forgets it fails here, not at a user's call."""
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert missing == []
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = module.no_such_name


def _architecture_boxes() -> dict[str, list[str]]:
    """The architecture picture (docs/architecture.md): box title -> the module names on its lines."""
    text = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    picture = text.split("## Architecture", 1)[1].split("```\n", 2)[1]
    boxes: dict[str, list[str]] = {}
    title = ""
    for line in picture.splitlines():
        if line.startswith("┌"):
            title = line.strip("┌─┐▼ ").split()[0]
            boxes[title] = []
        elif line.startswith("│"):
            name = line.strip("│ ").split()[0]
            if title == "foundations" or not name.endswith("/"):  # a subpackage's heading line names no module
                boxes[title].append(name)
    return boxes


def test_the_readme_picture_has_one_line_per_module_in_its_layer() -> None:
    """A package's box names each module by its path in the package (`data/_http.py` in client/)."""
    package = REPO_ROOT / "gym_rpc"
    expected: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        if parts[0] == "v1" or path.name in {"__init__.py", "__main__.py"}:
            continue
        box = f"{parts[0]}/" if len(parts) > 1 else "top-level"
        expected.setdefault(box, []).append("/".join(parts[1:]) if len(parts) > 1 else path.name)
    boxes = _architecture_boxes()
    top_level = [name for name in boxes["foundations"] if name != "v1/"]
    assert sorted(top_level) == expected.pop("top-level")
    assert {box: sorted(boxes[box]) for box in expected} == {box: sorted(names) for box, names in expected.items()}
    assert "v1/" in boxes["foundations"]
