"""The package as a user installs it: the built wheel in a fresh venv outside the repository, the base install.

There `gym-rpc --version`, `gym-rpc status` against a head and a `ServerClient` rollout work; `gym-rpc head` says
which extra it needs (exit 2), and works once `[head]` is installed. The wheel and the sdist carry the licence
(PEP 639), the sdist the contract and the tests. tools/install_footprint.py does the building and measuring (pip
may use its local cache: a few minutes on a fresh machine, well under one after).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from tests.support import REPO_ROOT
from tests.support.cli import LISTENING_PATTERN, ThreadedHttpServer, running_head, threaded_http_server
from tests.support.documents import server_entry
from tests.support.loopback import LOOPBACK, closed_port

FOOTPRINT = REPO_ROOT / "tools" / "install_footprint.py"
INSTALL_TIMEOUT_SECONDS = 900
MAX_BASE_PACKAGES = 30
MAX_BASE_MEGABYTES = 60.0
PAGE_FILES = ("index.html", "page.js", "page.css")

_ROLLOUT = """
import asyncio
from gym_rpc.client.server_client import ServerClient, rollout_context

async def main():
    client = ServerClient.load_from_global_config()  # from GYM_RPC_HEAD
    with rollout_context("task-1"):
        response = await client.post("policy_model", "/v1/responses", json={"input": "hi"})
        print(response.status, (await response.json())["status"])
    await client.aclose()

asyncio.run(main())
"""


def _footprint() -> ModuleType:
    spec = importlib.util.spec_from_file_location("install_footprint", FOOTPRINT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built: Path = _footprint().build_wheel(tmp_path_factory.mktemp("dist"))
    return built


@pytest.fixture(scope="module")
def base_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv outside the repository with the wheel's base install alone."""
    tool = _footprint()
    python: Path = tool.fresh_venv(tmp_path_factory.mktemp("base") / "venv")
    tool.install(python, str(wheel))
    return python


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ThreadedHttpServer]]:
    folder = tmp_path_factory.mktemp("head")
    with threaded_http_server() as model:
        config = folder / "config.yaml"
        tools = server_entry(closed_port(), "resources_servers")
        servers = {"policy_model": server_entry(model.port), "tools": tools}
        config.write_text(yaml.safe_dump({"head_server": {"host": LOOPBACK, "port": 0}, **servers}))
        with running_head(config) as process:
            yield process.address, model


def _run(
    python: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    command = [str(python.parent / "gym-rpc"), *args] if args and args[0] != "-c" else [str(python), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=python.parent)


def test_the_wheel_carries_the_licence(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    assert "Classifier: License ::" not in metadata  # PEP 639: the expression, not a classifier
    assert "gym_rpc/v1/control_plane_pb2.py" in names and "gym_rpc/default_config.yaml" in names


def test_the_wheel_carries_the_status_page(wheel: Path) -> None:
    """The head's page at /ui/ is package data: a head installed from the wheel serves it (issue 42)."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        sizes = [archive.getinfo(f"gym_rpc/server/status_page/{name}").file_size for name in PAGE_FILES]
    assert {f"gym_rpc/server/status_page/{name}" for name in PAGE_FILES} <= names
    assert sum(sizes) < 150 * 1024


@pytest.mark.timeout(INSTALL_TIMEOUT_SECONDS)
def test_the_sdist_carries_the_contract_the_licence_and_the_tests(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path), str(REPO_ROOT)],
        check=True,
        capture_output=True,
        timeout=INSTALL_TIMEOUT_SECONDS,
    )
    with tarfile.open(next(tmp_path.glob("gym_rpc-*.tar.gz"))) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    wanted = {"LICENSE", "CHANGELOG.md", "proto/gym_rpc/v1/control_plane.proto", "tests/conftest.py", "Makefile"}
    assert wanted <= names
    assert "tools/generate_python_stubs.py" in names and "docs/cli.md" in names


@pytest.mark.timeout(INSTALL_TIMEOUT_SECONDS)
def test_the_base_install_is_light(base_python: Path) -> None:
    sizes = _footprint().installed_sizes(base_python)
    assert "gym-rpc" in sizes
    heavy = {
        "uvicorn",
        "connectrpc",
        "opentelemetry-sdk",
        "rich",
        "shtab",
        "prometheus-client",
        "grpcio-reflection",
    }
    assert heavy & set(sizes) == set()
    assert len(sizes) <= MAX_BASE_PACKAGES, sorted(sizes)
    assert sum(sizes.values()) / 1e6 <= MAX_BASE_MEGABYTES


@pytest.mark.timeout(INSTALL_TIMEOUT_SECONDS)
def test_the_base_install_runs_the_cli_and_a_rollout(
    base_python: Path, head: tuple[str, ThreadedHttpServer]
) -> None:
    address, _ = head
    version = _run(base_python, "--version")
    assert version.returncode == 0 and version.stdout.startswith("gym-rpc "), version.stderr
    status = _run(base_python, "status", "--head", address, "-o", "json")
    assert status.returncode == 1, status.stderr  # tools is down
    assert {row["name"]: row["status"] for row in json.loads(status.stdout)} == {
        "policy_model": "success",
        "tools": "connection_error",
    }
    rollout = _run(base_python, "-c", _ROLLOUT, env={"GYM_RPC_HEAD": address, "PATH": str(base_python.parent)})
    assert rollout.returncode == 0, rollout.stderr
    assert rollout.stdout.split() == ["200", "200"]


@pytest.mark.timeout(INSTALL_TIMEOUT_SECONDS)
def test_head_names_its_extra_then_runs_with_it(base_python: Path, wheel: Path) -> None:
    refused = _run(base_python, "head", "--port", "0")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()]  # one line
    assert "pip install 'gym-rpc[head]'" in refused.stderr
    _footprint().install(base_python, f"{wheel}[head]")
    process = subprocess.Popen(
        [str(base_python.parent / "gym-rpc"), "head", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert LISTENING_PATTERN.search(line), (line, process.stderr)
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.timeout(INSTALL_TIMEOUT_SECONDS)
def test_tracing_switched_on_without_its_extra_warns_and_the_rollout_runs(
    base_python: Path, head: tuple[str, ThreadedHttpServer]
) -> None:
    """A cluster's OTEL_EXPORTER_OTLP_ENDPOINT reaches a worker with the base install: no SDK, no instrumentation.
    Tracing and metrics stay unrecorded, each says which `pip install` records them, and the rollout runs."""
    address, _ = head
    env = {
        "GYM_RPC_HEAD": address,
        "PATH": str(base_python.parent),
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1]:9",
    }
    rollout = _run(base_python, "-c", "import logging; logging.basicConfig()\n" + _ROLLOUT, env=env)
    assert rollout.returncode == 0, rollout.stderr
    assert rollout.stdout.split() == ["200", "200"]
    assert "pip install 'gym-rpc[" in rollout.stderr and "Traceback" not in rollout.stderr
