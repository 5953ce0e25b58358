"""Regenerate gym_rpc/v1/ from proto/: messages and gRPC stubs (grpcio-tools), typed .pyi stubs (mypy-protobuf).

buf cannot drive grpcio-tools as a local plugin, so Python stubs are made here; `make proto` runs this and
tests/test_generated_code.py runs it into a temporary folder to catch drift.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PACKAGE_DIR = Path("gym_rpc") / "v1"
INIT_TEXT = '"""Generated from proto/gym_rpc/v1 by tools/generate_python_stubs.py. Do not edit."""\n'


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
