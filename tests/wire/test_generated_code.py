"""gym_rpc/v1/ is exactly what the pinned generator makes from proto/, and only the control layer touches it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

from tests.support import REPO_ROOT

GENERATED_DIR = REPO_ROOT / "gym_rpc" / "v1"
GENERATOR = REPO_ROOT / "tools" / "generate_python_stubs.py"
# Hand-written modules that may import generated messages: the conversion layer and its callers.
# The gRPC-facing code: the generated stubs, the wire layer, the control client and the server layer.
PB2_ALLOWED_DIRS = (
    REPO_ROOT / "gym_rpc" / "v1",
    REPO_ROOT / "gym_rpc" / "wire",
    REPO_ROOT / "gym_rpc" / "client" / "control" / "_clients.py",
    REPO_ROOT / "gym_rpc" / "client" / "control" / "_heads.py",  # the gRPC head: stubs per channel
    REPO_ROOT / "gym_rpc" / "client" / "nemo_gym" / "_head_answers.py",  # the rows' answers from NeMo Gym's head
    REPO_ROOT / "gym_rpc" / "server",
)


def load_generator() -> ModuleType:
    """tools/ is not a package, so load the script by path."""
    spec = importlib.util.spec_from_file_location("generate_python_stubs", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed_files() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in GENERATED_DIR.iterdir() if p.is_file()}


def test_generated_code_matches_a_fresh_generation(tmp_path: Path) -> None:
    written = load_generator().generate(tmp_path)
    fresh_dir = tmp_path / "gym_rpc" / "v1"
    assert sorted(written) == sorted(p for p in fresh_dir.iterdir() if p.is_file())
    fresh = {p.name: p.read_bytes() for p in fresh_dir.iterdir() if p.is_file()}
    committed = committed_files()
    assert sorted(committed) == sorted(fresh), "gym_rpc/v1/ holds a different set of files; run `make proto`"
    drifted = sorted(name for name in fresh if fresh[name] != committed[name])
    assert not drifted, f"gym_rpc/v1/ differs from proto/ in {drifted}; run `make proto` and commit the result"


def test_generation_covers_every_proto() -> None:
    protos = {p.stem for p in (REPO_ROOT / "proto" / "gym_rpc" / "v1").glob("*.proto")}
    assert protos
    for stem in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"):
            assert (GENERATED_DIR / f"{stem}{suffix}").is_file(), f"{stem}{suffix} missing"


def hand_written_modules() -> list[Path]:
    return [
        path
        for path in sorted((REPO_ROOT / "gym_rpc").rglob("*.py"))
        if not any(path.is_relative_to(allowed) for allowed in PB2_ALLOWED_DIRS)
    ]


def test_only_the_grpc_facing_modules_import_generated_messages() -> None:
    modules = hand_written_modules()
    assert REPO_ROOT / "gym_rpc" / "config" / "_global.py" in modules  # the scan does look at hand-written code
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
        for path in modules
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if re.search(r"_pb2", line)
    ]
    assert not offenders, "generated messages used outside the gRPC-facing modules:\n" + "\n".join(offenders)


def test_the_service_name_is_the_contracts() -> None:
    from gym_rpc.v1 import control_plane_pb2 as pb
    from gym_rpc.wire import SERVICE_NAME

    assert pb.DESCRIPTOR.services_by_name["ControlPlaneService"].full_name == SERVICE_NAME
