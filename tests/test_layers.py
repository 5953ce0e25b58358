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
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_importing_server_client_loads_no_server_module() -> None:
    code = (
        "import gym_rpc.client.server_client, sys, json; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('gym_rpc', 'grpc', 'google.protobuf')))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    loaded = json.loads(result.stdout)
    assert "gym_rpc.client.server_client" in loaded
    # gRPC, protobuf and the control client load on the first call to the head, not with the module.
    assert [m for m in loaded if m.startswith(("grpc", "google.protobuf", "gym_rpc.client._control"))] == []
    above_the_client = {"server", "integrations", "cli", "demo", "_render"}
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
            boxes[title].append(line.strip("│ ").split()[0])
    return boxes


def test_the_readme_picture_has_one_line_per_module_in_its_layer() -> None:
    package = REPO_ROOT / "gym_rpc"
    expected: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        if parts[0] == "v1" or path.name in {"__init__.py", "__main__.py"}:
            continue
        box = f"{parts[0]}/" if len(parts) > 1 else "top-level"
        expected.setdefault(box, []).append(path.name)
    boxes = _architecture_boxes()
    top_level = [name for title in ("on", "foundations") for name in boxes[title] if name != "v1/"]
    assert sorted(top_level) == expected.pop("top-level")
    assert {box: sorted(boxes[box]) for box in expected} == expected
    assert "v1/" in boxes["foundations"]
