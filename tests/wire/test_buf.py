"""The contract through standard tooling: pinned buf lints proto/ and calls a running head by reflection."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import SERVICE_NAME
from tests.support import REPO_ROOT
from tests.support.cli import HeadProcess, running_head
from tests.support.documents import server_entry
from tests.support.loopback import LOOPBACK, closed_port

BUF = REPO_ROOT / "node_modules" / ".bin" / "buf"
BUF_SECONDS = 30.0

pytestmark = pytest.mark.skipif(
    not BUF.exists(), reason=f"pinned buf CLI not installed at {BUF} (run `make install`, which runs `npm ci`)"
)


def buf(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BUF), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=BUF_SECONDS, check=False
    )


def buf_curl(address: str, *args: str, path: str = "") -> subprocess.CompletedProcess[str]:
    """`buf curl` over gRPC on plain-text HTTP/2, schema from the head's reflection service (no .proto given)."""
    return buf("curl", "--protocol", "grpc", "--http2-prior-knowledge", *args, f"http://{address}/{path}")


@pytest.fixture
def config_doc() -> dict[str, Any]:
    return {
        "head_server": {"host": LOOPBACK, "port": 0},
        "model": server_entry(closed_port(), api_key="sk-hidden", limits={"max": 3, "names": ["ä", "b"]}),
        "tools": server_entry(closed_port(), "resources_servers"),
        "checkpoint": {"enabled": True},
        "observability_enabled": True,
    }


@pytest.fixture
def head(tmp_path: Path, config_doc: dict[str, Any]) -> Any:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config_doc, allow_unicode=True, sort_keys=False), encoding="utf-8")
    with running_head(path) as running:
        yield running


def service_methods() -> list[str]:
    service = pb.DESCRIPTOR.services_by_name["ControlPlaneService"]
    return [f"{SERVICE_NAME}/{method.name}" for method in service.methods]


def test_buf_lint_passes() -> None:
    result = buf("lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_curl_get_global_config_by_reflection(head: HeadProcess, config_doc: dict[str, Any]) -> None:
    result = buf_curl(head.address, path=f"{SERVICE_NAME}/GetGlobalConfig")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    port = int(head.address.rsplit(":", 1)[1])
    assert re.fullmatch(r"[0-9a-f]{16}", answer["version"]), answer["version"]
    assert answer["headServer"] == {"host": LOOPBACK, "port": port}
    assert [server["name"] for server in answer["servers"]] == ["model", "tools"]
    assert answer["servers"][1]["serverType"] == "resources_servers"
    assert answer["checkpointEnabled"] is True
    assert answer["observabilityEnabled"] is True
    model_port = config_doc["model"]["responses_api_models"]["responses_api_models_impl"]["port"]
    expected = {
        **config_doc,
        "head_server": {"host": LOOPBACK, "port": port},
        "model": server_entry(model_port, api_key="<redacted>", limits={"max": 3, "names": ["ä", "b"]}),
    }
    assert json.loads(answer["configJson"]) == expected
    assert "sk-hidden" not in result.stdout


def test_buf_curl_lists_the_service_methods(head: HeadProcess) -> None:
    result = buf_curl(head.address, "--list-methods")
    assert result.returncode == 0, result.stderr
    listed = set(result.stdout.split())
    missing = [method for method in service_methods() if method not in listed]
    assert not missing, f"buf curl --list-methods lacks {missing}:\n{result.stdout}"


def test_buf_curl_lists_health_and_reflection(head: HeadProcess) -> None:
    result = buf_curl(head.address, "--list-services")
    assert result.returncode == 0, result.stderr
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= set(result.stdout.split())


def test_reflection_can_be_turned_off() -> None:
    with running_head(None, "--no-reflection") as quiet:
        result = buf_curl(quiet.address, "--list-services")
    assert result.returncode != 0
    assert result.stdout == ""
    assert result.stderr == "Failure: unimplemented: Method not found!\n"  # the reflection service is absent
