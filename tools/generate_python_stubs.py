"""Regenerate gym_rpc/v1/ from proto/: messages and gRPC stubs (grpcio-tools), typed .pyi stubs (mypy-protobuf).

buf cannot drive grpcio-tools as a local plugin, so Python stubs are made here; `make proto` runs this and
tests/wire/test_generated_code.py runs it into a temporary folder to catch drift.

The pinned generator writes code that refuses to run on any grpcio or protobuf older than itself (a version gate
in each module) and uses grpcio 1.63's registered methods unconditionally. Nothing else in the code needs them, so
`without_version_gates` takes the gates out and uses registered methods where the installed grpcio has them:
the stubs then run on the lowest grpcio and protobuf pyproject.toml declares (tests/lowest_versions.txt's tests
prove it), and the result is still exactly reproducible from proto/ with the pinned generator.
"""

from __future__ import annotations

import argparse
import re
import sys
import sysconfig
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PACKAGE_DIR = Path("gym_rpc") / "v1"
INIT_TEXT = '"""Generated from proto/gym_rpc/v1 by tools/generate_python_stubs.py. Do not edit."""\n'

_PROTOBUF_GATE = re.compile(
    r"^from google\.protobuf import runtime_version as _runtime_version\n"
    r"|^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:    .*\n)*?\)\n",
    re.M,
)
_GRPC_GATE = re.compile(r"^GRPC_GENERATED_VERSION = [\s\S]*?\n\nif _version_not_supported:\n(?:    .*\n)+", re.M)
_REGISTERED_SWITCH = (
    "# Registered methods (grpcio >= 1.63) where this grpcio has them; older ones call by name as before.\n"
    '_REGISTERED_METHOD = {"_registered_method": True} if hasattr(grpc.Server, "add_registered_method_handlers") '
    "else {}\n"
)
_ADD_REGISTERED = re.compile(r"^(    )(server\.add_registered_method_handlers\(.*\))$", re.M)


def without_version_gates(name: str, text: str) -> str:
    """The generated module without the generator's version gates (see the module's docstring)."""
    if name.endswith("_pb2.py"):
        text, count = _PROTOBUF_GATE.subn("", text)
        assert count == 2, f"{name}: the protobuf version gate changed shape ({count} parts found)"
    elif name.endswith("_pb2_grpc.py"):
        text, count = _GRPC_GATE.subn(_REGISTERED_SWITCH, text)
        assert count == 1, f"{name}: the grpcio version gate changed shape"
        text = text.replace("_registered_method=True)", "**_REGISTERED_METHOD)")
        text = _ADD_REGISTERED.sub(r"\1if _REGISTERED_METHOD:\n\1    \2", text)
        assert "_registered_method=True" not in text
    return text


def generate(out_root: Path) -> list[Path]:
    """Write the generated package under out_root and return the files written."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    well_known = str(resources.files("grpc_tools") / "_proto")
    target = out_root / PACKAGE_DIR
    target.mkdir(parents=True, exist_ok=True)
    for stale in target.glob("*_pb2*"):
        stale.unlink()
    scripts = Path(sysconfig.get_path("scripts"))  # mypy-protobuf's plugins sit beside this interpreter
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={scripts / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={scripts / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for module in target.glob("*_pb2*.py"):
        module.write_text(without_version_gates(module.name, module.read_text()))
    (target / "__init__.py").write_text(INIT_TEXT)
    (target / "py.typed").write_text("")
    return sorted(p for p in target.iterdir() if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write gym_rpc/v1/ under")
    for path in generate(parser.parse_args().out):
        print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
