"""Other languages use the control plane from the .proto alone: stubs from buf.gen.yaml's local plugins, a
TypeScript client (interop/ts/client.ts, the README's example) talking gRPC to a real `gym-rpc head`, Go stubs
that compile against Debian's Go packages, and `buf breaking` guarding the released contract.

Stubs are generated afresh into a temporary folder (`buf generate -o`), never into the work tree, so a stale
or concurrent `make stubs` cannot change what a test sees.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_rpc.client._control import SyncControlClient
from tests.cli_helpers import LOOPBACK, ThreadedHttpServer, running_head, threaded_http_server
from tests.conftest import closed_port, server_entry

REPO_ROOT = Path(__file__).resolve().parent.parent
NODE_BIN = REPO_ROOT / "node_modules" / ".bin"
BUF = NODE_BIN / "buf"
TSX = NODE_BIN / "tsx"
TSC = NODE_BIN / "tsc"
CLIENT_DIR = REPO_ROOT / "interop" / "ts"
RELEASED_CONTRACT = REPO_ROOT / "proto" / "released" / "gym_rpc_v1.binpb"
GOPATH_SYSTEM = Path("/usr/share/gocode")  # where Debian's golang-*-dev packages put Go sources
GO_IMPORT_PATH = "gym_rpc/stubs/go/gym_rpc/v1"  # buf.gen.yaml maps the .proto file here (M option)
GO_DEBIAN_PACKAGES = "golang-go protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev golang-google-protobuf-dev"
TOOL_SECONDS = 60.0  # a cold Go build of grpc on two noisy cores
CLIENT_SECONDS = 15.0

needs_npm_tools = pytest.mark.skipif(
    not (BUF.exists() and TSX.exists() and TSC.exists() and shutil.which("node")),
    reason="node or the pinned npm tools (buf, tsx, tsc) are missing; `make install` runs `npm ci`",
)


def run(args: list[str | Path], cwd: Path = REPO_ROOT, env: dict[str, str] | None = None) -> str:
    """Run a tool to completion; fail the test with its output when it exits non-zero."""
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=TOOL_SECONDS, env=env, check=False
    )
    assert result.returncode == 0, (
        f"{' '.join(map(str, args))} exited {result.returncode}:\n{result.stdout}{result.stderr}"
    )
    return result.stdout


def generate(out_root: Path, out_prefix: str) -> None:
    """`buf generate` with buf.gen.yaml's plugins whose `out` starts with `out_prefix`, under `out_root`."""
    template = yaml.safe_load((REPO_ROOT / "buf.gen.yaml").read_text())
    template["plugins"] = [p for p in template["plugins"] if p["out"].startswith(out_prefix)]
    assert template["plugins"], f"buf.gen.yaml has no plugin writing to {out_prefix}"
    run([BUF, "generate", "--template", json.dumps(template), "-o", out_root])


@pytest.fixture(scope="module")
def ts_workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of interop/ts beside freshly generated stubs/ts, sharing the repo's package.json and node_modules."""
    root = tmp_path_factory.mktemp("ts_workspace")
    generate(root, "stubs/ts")
    (root / "package.json").symlink_to(REPO_ROOT / "package.json")
    (root / "node_modules").symlink_to(REPO_ROOT / "node_modules")
    shutil.copytree(CLIENT_DIR, root / "interop" / "ts")
    return root


class LineReader:
    """A subprocess whose stdout lines are awaited with a deadline (a reader thread drains the pipe; stderr goes
    to a file, so neither pipe can fill up and block the program)."""

    def __init__(self, args: list[str | Path], cwd: Path, stderr_path: Path) -> None:
        self._stderr_path = stderr_path
        with stderr_path.open("w") as stderr:
            self.process = subprocess.Popen(
                [str(a) for a in args], cwd=cwd, stdout=subprocess.PIPE, stderr=stderr, text=True
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    @property
    def stderr(self) -> str:
        return self._stderr_path.read_text()

    def json_line(self, timeout: float) -> dict[str, Any]:
        """The next stdout line, parsed; fails the test when none comes in time or the program ended."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"the TypeScript client printed nothing within {timeout}s: {self.stderr}"
            ) from None
        if line is None:
            raise AssertionError(f"the TypeScript client ended (exit {self.finish(5.0)}) early: {self.stderr}")
        return dict(json.loads(line))

    def finish(self, timeout: float) -> int:
        """The exit code; fails the test when the program does not end by itself in time."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the TypeScript client still runs after {timeout}s") from None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self._thread.join(timeout=5)
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture
def model_server() -> Iterator[ThreadedHttpServer]:
    with threaded_http_server() as server:
        yield server


def wait_for_statuses(address: str, expected: dict[str, str], timeout: float = 10.0) -> None:
    """Poll the head (Python client) until every server has the expected probe status."""
    client = SyncControlClient(address, timeout_seconds=2.0)
    deadline = time.monotonic() + timeout
    while True:
        seen = {report.server_name: report.status for report in client.list_server_statuses().reports}
        if seen == expected:
            return
        assert time.monotonic() < deadline, f"head statuses {seen}, expected {expected}"
        time.sleep(0.05)


def statuses_by_name(reports: list[dict[str, Any]]) -> dict[str, str]:
    return {report["serverName"]: report["status"] for report in reports}


@needs_npm_tools
def test_typescript_client_calls_the_python_head(
    ts_workspace: Path, tmp_path: Path, model_server: ThreadedHttpServer
) -> None:
    tools_port = closed_port()
    doc = {
        "head_server": {"host": LOOPBACK, "port": 0},
        "model": server_entry(model_server.port),
        "tools": server_entry(tools_port, "resources_servers"),
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    with running_head(config) as head:
        wait_for_statuses(head.address, {"model": "success", "tools": "connection_error"})
        command: list[str | Path] = [TSX, "interop/ts/client.ts", head.address]
        client = LineReader(command, ts_workspace, tmp_path / "client.stderr")
        try:
            got_config = client.json_line(CLIENT_SECONDS)["config"]
            statuses = client.json_line(5.0)["statuses"]
            snapshot = client.json_line(5.0)["watch"]
            model_server.stop()
            change = client.json_line(5.0)["watch"]
            exit_code = client.finish(5.0)
            stderr = client.stderr
        finally:
            client.close()

    assert exit_code == 0, stderr
    port = int(head.address.rsplit(":", 1)[1])
    assert got_config["headServer"] == {"host": LOOPBACK, "port": port}
    assert [(s["name"], s["serverType"], s["port"]) for s in got_config["servers"]] == [
        ("model", "responses_api_models", model_server.port),
        ("tools", "resources_servers", tools_port),
    ]
    assert json.loads(got_config["configJson"])["model"] == doc["model"]
    expected = {"model": "SERVER_STATUS_SUCCESS", "tools": "SERVER_STATUS_CONNECTION_ERROR"}
    assert statuses_by_name(statuses["reports"]) == expected
    assert snapshot["type"] == "WATCH_EVENT_TYPE_SNAPSHOT"
    assert statuses_by_name(snapshot["reports"]) == expected
    assert int(snapshot["revision"]) >= int(statuses["revision"])
    assert change["type"] == "WATCH_EVENT_TYPE_CHANGE"
    assert statuses_by_name(change["reports"]) == {"model": "SERVER_STATUS_CONNECTION_ERROR"}
    assert int(change["revision"]) == int(snapshot["revision"]) + 1


@needs_npm_tools
def test_typescript_client_type_checks_against_the_stubs(ts_workspace: Path) -> None:
    """tsx runs TypeScript without checking types; tsc --strict catches, e.g., a misspelt request field."""
    run([TSC, "-p", ts_workspace / "interop" / "ts"])


def go_tools_missing() -> str | None:
    """Why the Go stubs cannot be built here, or None when everything they need is installed."""
    missing = [tool for tool in ("go", "protoc-gen-go", "protoc-gen-go-grpc") if shutil.which(tool) is None]
    missing += [
        module
        for module in ("google.golang.org/grpc", "google.golang.org/protobuf")
        if not (GOPATH_SYSTEM / "src" / module).is_dir()
    ]
    if not missing:
        return None
    return f"missing {', '.join(missing)}: `apt-get install {GO_DEBIAN_PACKAGES}` (.ci/run does)"


@needs_npm_tools
@pytest.mark.skipif(go_tools_missing() is not None, reason=go_tools_missing() or "")
def test_go_stubs_build_and_vet_against_debian_go_packages(tmp_path: Path) -> None:
    """GOPATH mode with Debian's sources: no module download, so it works without the Go module proxy."""
    gopath = tmp_path / "gopath"
    generate(gopath / "src" / "gym_rpc", "stubs/go")
    package_dir = gopath / "src" / GO_IMPORT_PATH
    assert sorted(p.name for p in package_dir.iterdir()) == ["control_plane.pb.go", "control_plane_grpc.pb.go"]
    env = {
        **os.environ,
        "GO111MODULE": "off",
        "GOPATH": f"{gopath}{os.pathsep}{GOPATH_SYSTEM}",
        "GOCACHE": str(REPO_ROOT / "build" / "go-cache"),  # kept between runs; `make clean` removes build/
        "GOFLAGS": "",
        "GOPROXY": "off",
    }
    run(["go", "build", GO_IMPORT_PATH], cwd=tmp_path, env=env)
    run(["go", "vet", GO_IMPORT_PATH], cwd=tmp_path, env=env)
    listed = run(["go", "list", "-f", '{{.Name}} {{join .Imports " "}}', GO_IMPORT_PATH], cwd=tmp_path, env=env)
    assert listed.split()[0] == "gymrpcv1"
    assert "google.golang.org/grpc" in listed.split()


@needs_npm_tools
def test_buf_breaking_passes_against_the_released_contract() -> None:
    run([BUF, "breaking", "--against", RELEASED_CONTRACT])


@needs_npm_tools
def test_buf_breaking_reports_a_breaking_change(tmp_path: Path) -> None:
    """The check is live: renumbering a field in a copy of proto/ fails against the committed image."""
    shutil.copy(REPO_ROOT / "buf.yaml", tmp_path)
    shutil.copytree(REPO_ROOT / "proto", tmp_path / "proto")
    proto = tmp_path / "proto" / "gym_rpc" / "v1" / "control_plane.proto"
    text = proto.read_text()
    assert "uint32 http_status = 7;" in text
    proto.write_text(text.replace("uint32 http_status = 7;", "uint32 http_status = 99;"))  # a number no field has
    result = subprocess.run(
        [str(BUF), "breaking", "--against", str(RELEASED_CONTRACT)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TOOL_SECONDS,
        check=False,
    )
    assert result.returncode != 0
    assert "http_status" in result.stdout + result.stderr


def test_readme_shows_the_client_the_test_runs() -> None:
    client = (CLIENT_DIR / "client.ts").read_text().rstrip()
    readme = (REPO_ROOT / "README.md").read_text()
    assert f"```ts\n{client}\n```" in readme, "README's TypeScript example differs from interop/ts/client.ts"
