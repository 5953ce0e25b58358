"""Other languages use the control plane from the .proto alone: stubs from buf.gen.yaml's local plugins, made
into packages (npm, Go module); a TypeScript client (interop/ts/client.ts) and a Go client (interop/go, importing
the stubs module) run the same script against a real `gym-rpc head`, which the test asserts from what they print;
the npm package installs into a scratch project and type-checks there; `buf breaking` guards the released contract.

Stubs are generated afresh into a temporary folder (`buf generate -o`), never into the work tree, so a stale
or concurrent `make stubs` cannot change what a test sees.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from gym_rpc.client.control._clients import SyncControlClient
from gym_rpc.client.control._credentials import ClientSecurity, ClientTls
from tests.support import REPO_ROOT
from tests.support.cli import ThreadedHttpServer, running_head, threaded_http_server
from tests.support.documents import server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.security import Pki, tls_block

OTHER_LANGUAGES_PAGE = REPO_ROOT / "docs" / "other-languages.md"  # the programs it shows are the ones run here
NODE_BIN = REPO_ROOT / "node_modules" / ".bin"
BUF = NODE_BIN / "buf"
TSX = NODE_BIN / "tsx"
TSC = NODE_BIN / "tsc"
CLIENT_DIR = REPO_ROOT / "interop" / "ts"
PACKAGE_CONSUMER_DIR = REPO_ROOT / "interop" / "ts-package"
GO_CLIENT_DIR = REPO_ROOT / "interop" / "go"
RELEASED_CONTRACT = REPO_ROOT / "proto" / "released" / "gym_rpc_v1.binpb"
RELEASED_VERSION = REPO_ROOT / "proto" / "released" / "VERSION"  # `make release-contract` copies proto/VERSION
GOPATH_SYSTEM = Path("/usr/share/gocode")  # where Debian's golang-*-dev packages put Go sources
GO_MODULE_PATH = "gym_rpc/stubs/go"  # tools/package_stubs.py's go.mod
GO_IMPORT_PATH = f"{GO_MODULE_PATH}/gym_rpc/v1"  # buf.gen.yaml maps the .proto file here (M option)
GO_DEBIAN_PACKAGES = "golang-go protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev golang-google-protobuf-dev"
TOOL_SECONDS = 60.0
GO_BUILD_SECONDS = 240.0  # the first build on a machine compiles grpc: ~45-90 s on two busy cores
CLIENT_SECONDS = 60.0  # a hang guard: Node starting at a load average of 20 printed nothing within 15 s
TOKEN = "interop-token-5d1e"


def load_tool(name: str) -> ModuleType:
    """tools/ is not a package, so load a script by path."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


package_stubs = load_tool("package_stubs")
go_vendor_debian = load_tool("go_vendor_debian")

needs_npm_tools = pytest.mark.skipif(
    not (BUF.exists() and TSX.exists() and TSC.exists() and shutil.which("node")),
    reason="node or the pinned npm tools (buf, tsx, tsc) are missing; `make install` runs `npm ci`",
)


def run(
    args: list[str | Path], cwd: Path = REPO_ROOT, env: dict[str, str] | None = None, timeout: float = TOOL_SECONDS
) -> str:
    """Run a tool to completion; fail the test with its output when it exits non-zero."""
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, check=False
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
    package_stubs.package(out_root / "stubs")


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

    def __init__(
        self, args: list[str | Path], cwd: Path, stderr_path: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self._stderr_path = stderr_path
        with stderr_path.open("w") as stderr:
            self.process = subprocess.Popen(
                [str(a) for a in args], cwd=cwd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
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
        return dict(json.loads(self.text_line(timeout)))

    def text_line(self, timeout: float) -> str:
        """The next stdout line; fails the test when none comes in time or the program ended."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the client printed nothing within {timeout}s: {self.stderr}") from None
        if line is None:
            raise AssertionError(f"the client ended (exit {self.finish(5.0)}) early: {self.stderr}")
        return line.rstrip("\n")

    def finish(self, timeout: float) -> int:
        """The exit code; fails the test when the program does not end by itself in time."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the client still runs after {timeout}s") from None

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


def wait_for_statuses(
    address: str, expected: dict[str, str], security: ClientSecurity, timeout: float = 10.0
) -> None:
    """Poll the head (Python client) until every server has the expected probe status."""
    client = SyncControlClient(address, timeout_seconds=2.0, security=security)
    deadline = time.monotonic() + timeout
    while True:
        seen = {report.server_name: report.status for report in client.list_server_statuses().reports}
        if seen == expected:
            return
        assert time.monotonic() < deadline, f"head statuses {seen}, expected {expected}"
        time.sleep(0.05)


STOPPED_MODEL = ({"model": "SERVER_STATUS_CONNECTION_ERROR"}, {"model": "SERVER_STATUS_TIMEOUT"})


def statuses_by_name(reports: list[dict[str, Any]]) -> dict[str, str]:
    return {report["serverName"]: report["status"] for report in reports}


@dataclass(frozen=True)
class HeadSecurity:
    """How the head of one interop run guards its port, and what a client must bring."""

    token: str | None = None
    pki: Pki | None = None  # TLS with this CA's server certificate

    def head_keys(self) -> dict[str, Any]:
        keys: dict[str, Any] = {"auth_token": self.token} if self.token else {}
        return {**keys, "tls": tls_block(self.pki)} if self.pki else keys

    def python_client(self) -> ClientSecurity:
        tls = ClientTls(root_certificates=self.pki.ca.read_bytes()) if self.pki else None
        return ClientSecurity(token=self.token, tls=tls)


def run_interop_script(
    command: list[str | Path],
    cwd: Path,
    tmp_path: Path,
    model_server: ThreadedHttpServer,
    security: HeadSecurity = HeadSecurity(),
    env: Mapping[str, str] | None = None,
    *,
    connect: bool = False,
    arguments: Callable[[str], list[str]] | None = None,
) -> None:
    """Start a head with a server that answers and one that refuses, run the client command with the head's
    address appended (its Connect port's with `connect`) and assert every line it printed: the config, the
    statuses, the snapshot. With `arguments` (the address -> the arguments asking for one change), it runs with
    those instead, the answering server is stopped after the snapshot, and the change must follow; without, the
    head stays quiet and the program must end by itself after the snapshot."""
    tools_port = closed_port()
    connect_port = {"connect_port": 0} if connect else {}
    doc = {
        "head_server": {"host": LOOPBACK, "port": 0, **connect_port, **security.head_keys()},
        "model": server_entry(model_server.port),
        "tools": server_entry(tools_port, "resources_servers"),
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    with running_head(config) as head:
        wait_for_statuses(
            head.address, {"model": "success", "tools": "connection_error"}, security.python_client()
        )
        address = connect_address(head.banner) if connect else head.address
        args = [address] if arguments is None else arguments(address)
        client = LineReader([*command, *args], cwd, tmp_path / "client.stderr", env)
        try:
            got_config = client.json_line(CLIENT_SECONDS)["config"]
            statuses = client.json_line(5.0)["statuses"]
            snapshot = client.json_line(5.0)["watch"]
            change = None
            if arguments is not None:
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
    document = json.loads(got_config["configJson"])
    assert document["model"] == doc["model"]
    if security.token:  # redaction as for any caller that does not ask for secrets
        assert document["head_server"]["auth_token"] == "<redacted>"
    expected = {"model": "SERVER_STATUS_SUCCESS", "tools": "SERVER_STATUS_CONNECTION_ERROR"}
    assert statuses_by_name(statuses["reports"]) == expected
    assert snapshot["type"] == "WATCH_EVENT_TYPE_SNAPSHOT"
    assert statuses_by_name(snapshot["reports"]) == expected
    assert int(snapshot["revision"]) >= int(statuses["revision"])
    if change is None:
        return  # a quiet head: the snapshot, then the program ended with 0
    assert change["type"] == "WATCH_EVENT_TYPE_CHANGE"
    # Refused once stopped; TIMEOUT when a probe was in flight while the server shut down (a loaded machine).
    assert statuses_by_name(change["reports"]) in STOPPED_MODEL
    assert int(change["revision"]) == int(snapshot["revision"]) + 1


def connect_address(banner: str) -> str:
    """HOST:PORT of the Connect port a head's startup line announces."""
    match = re.search(r"; Connect on http://(\S+)", banner)
    assert match, f"the head announced no Connect port: {banner}"
    return match.group(1)


@needs_npm_tools
@pytest.mark.parametrize("protocol", ["grpc", "connect"])
def test_typescript_client_calls_the_python_head(
    protocol: str, ts_workspace: Path, tmp_path: Path, model_server: ThreadedHttpServer
) -> None:
    """Over gRPC (the head's port) and over the Connect protocol (head_server.connect_port), a change included."""
    command: list[str | Path] = [TSX, "interop/ts/client.ts", protocol]

    def one_change(address: str) -> list[str]:
        return [address, "1"]

    connect = protocol == "connect"
    run_interop_script(command, ts_workspace, tmp_path, model_server, connect=connect, arguments=one_change)


@needs_npm_tools
def test_typescript_client_ends_after_the_snapshot_on_a_quiet_head(
    ts_workspace: Path, tmp_path: Path, model_server: ThreadedHttpServer
) -> None:
    run_interop_script([TSX, "interop/ts/client.ts", "grpc"], ts_workspace, tmp_path, model_server)


@needs_npm_tools
def test_typescript_client_type_checks_against_the_stubs(ts_workspace: Path) -> None:
    """tsx runs TypeScript without checking types; tsc --strict catches, e.g., a misspelt request field."""
    run([TSC, "-p", ts_workspace / "interop" / "ts"])


@pytest.fixture(scope="module")
def npm_tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The npm package as `make stubs` packs it, from freshly generated stubs."""
    root = tmp_path_factory.mktemp("npm_package")
    generate(root, "stubs/npm")
    name = run(["npm", "pack", "--silent", "--pack-destination", root, root / "stubs" / "npm"]).strip()
    assert name == f"gym-rpc-control-plane-{package_stubs.contract_version()}.tgz"
    return root / name


@needs_npm_tools
def test_npm_package_installs_from_its_tarball_into_a_scratch_project(npm_tarball: Path, tmp_path: Path) -> None:
    """Installed by npm (offline: the tarball, and the runtime it peers with from the repo's node_modules), the
    package type-checks with Node's own module resolution and no skipLibCheck, and its JavaScript runs."""
    scratch = tmp_path / "scratch"
    shutil.copytree(PACKAGE_CONSUMER_DIR, scratch)
    (scratch / "package.json").write_text('{"name": "scratch", "private": true, "type": "module"}\n')
    runtime = REPO_ROOT / "node_modules" / "@bufbuild" / "protobuf"
    run(
        ["npm", "install", "--offline", "--no-audit", "--no-fund", "--loglevel=error", npm_tarball, runtime],
        scratch,
    )
    installed = json.loads((scratch / "node_modules" / "@gym-rpc" / "control-plane" / "package.json").read_text())
    assert (installed["name"], installed["version"]) == (
        "@gym-rpc/control-plane",
        package_stubs.contract_version(),
    )
    assert installed["types"] == "./gym_rpc/v1/control_plane_pb.d.ts"
    assert installed["peerDependencies"] == {"@bufbuild/protobuf": "^2.13.0"}
    run([TSC, "-p", scratch])
    printed = json.loads(run(["node", scratch / "dist" / "consumer.js"]))
    assert printed["service"] == "gym_rpc.v1.ControlPlaneService"
    assert printed["methods"][:5] == [
        "GetHeadServerConfig",
        "GetGlobalConfig",
        "GetServerStatus",
        "ListServerStatuses",
        "WatchServerStatuses",
    ]
    assert printed["event"] == {
        "type": "WATCH_EVENT_TYPE_CHANGE",
        "revision": "42",
        "reports": [{"serverName": "policy_model", "status": "SERVER_STATUS_SUCCESS"}],
    }


def test_contract_version_matches_the_proto_package() -> None:
    """proto/VERSION versions both stub packages; its major is the `vN` of the package the contract declares."""
    version = package_stubs.contract_version()
    major, minor, patch = version.split(".")
    assert all(part.isdigit() for part in (major, minor, patch)), version
    proto = (REPO_ROOT / "proto" / "gym_rpc" / "v1" / "control_plane.proto").read_text()
    assert f"package gym_rpc.v{major};" in proto


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


needs_go = pytest.mark.skipif(go_tools_missing() is not None, reason=go_tools_missing() or "")
go_build_timeout = pytest.mark.timeout(2 * GO_BUILD_SECONDS + 60)  # the module fixture builds in the first test


def go_env() -> dict[str, str]:
    """Module mode from vendor/ only: no module proxy, no checksum database, no download of any kind. Go's own
    build cache (GOCACHE, else ~/.cache/go-build) is shared by every run, and -trimpath keeps source directories
    out of its keys: each run builds in a new temporary folder, yet only the first one on a machine compiles grpc
    (~45 s on two busy cores; ~3 s after)."""
    return {
        **os.environ,
        "GO111MODULE": "on",
        "GOFLAGS": "-mod=vendor -trimpath",
        "GOPROXY": "off",
        "GOSUMDB": "off",
        "GOPATH": str(REPO_ROOT / "build" / "gopath"),  # module cache would go here; vendor mode leaves it empty
    }


@pytest.fixture(scope="module")
def go_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """interop/go built as a module: freshly generated stubs (the module gym_rpc/stubs/go, with the go.mod
    `make stubs` writes) beside a copy of interop/go, whose go.mod requires and replaces it; vendor/ from
    Debian's sources (tools/go_vendor_debian.py)."""
    root = tmp_path_factory.mktemp("go_workspace")
    generate(root, "stubs/go")
    program_dir = root / "interop" / "go"
    shutil.copytree(GO_CLIENT_DIR, program_dir, ignore=shutil.ignore_patterns("vendor"))
    go_vendor_debian.vendor(program_dir)
    binary = root / "gym-rpc-go-client"
    env = go_env()
    run(["go", "build", "-o", binary, "."], cwd=program_dir, env=env, timeout=GO_BUILD_SECONDS)
    run(["go", "vet", "."], cwd=program_dir, env=env, timeout=GO_BUILD_SECONDS)
    assert run(["gofmt", "-l", "."], cwd=GO_CLIENT_DIR, env=env) == "", "interop/go is not gofmt-formatted"
    # The stubs come from the module, by module path: not loose files found by their location.
    listed = run(
        ["go", "list", "-deps", "-f", "{{.ImportPath}} {{with .Module}}{{.Path}}{{end}}", "."], program_dir, env
    )
    assert f"{GO_IMPORT_PATH} {GO_MODULE_PATH}" in listed.splitlines()
    return binary


@needs_npm_tools
@needs_go
@go_build_timeout
def test_go_client_calls_the_python_head(
    go_client: Path, tmp_path: Path, model_server: ThreadedHttpServer
) -> None:
    run_interop_script([go_client], tmp_path, tmp_path, model_server, arguments=_one_go_change)


def _one_go_change(address: str) -> list[str]:
    return ["-changes", "1", address]


@needs_npm_tools
@needs_go
@go_build_timeout
def test_go_client_ends_after_the_snapshot_on_a_quiet_head(
    go_client: Path, tmp_path: Path, model_server: ThreadedHttpServer
) -> None:
    run_interop_script([go_client], tmp_path, tmp_path, model_server)


@needs_npm_tools
@needs_go
@go_build_timeout
def test_go_client_calls_a_head_with_tls_and_a_token(
    go_client: Path, tmp_path: Path, model_server: ThreadedHttpServer, pki: Pki
) -> None:
    security = HeadSecurity(token=TOKEN, pki=pki)
    env = {**os.environ, "GYM_RPC_TOKEN": TOKEN}
    command: list[str | Path] = [go_client, "-ca", pki.ca]
    run_interop_script(command, tmp_path, tmp_path, model_server, security, env, arguments=_one_go_change)


@needs_npm_tools
@needs_go
@go_build_timeout
def test_go_client_without_the_token_is_refused(go_client: Path, tmp_path: Path, pki: Pki) -> None:
    doc = {"head_server": {"host": LOOPBACK, "port": 0, **HeadSecurity(token=TOKEN, pki=pki).head_keys()}}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(doc), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "GYM_RPC_TOKEN"}
    with running_head(config) as head:
        result = subprocess.run(
            [str(go_client), "-ca", str(pki.ca), head.address],
            capture_output=True,
            text=True,
            timeout=CLIENT_SECONDS,
            env=env,
            check=False,
        )
    assert result.returncode == 1
    assert result.stdout == ""
    assert "code = Unauthenticated desc = missing or invalid bearer token" in result.stderr


def test_go_module_file_names_the_stubs_module_and_its_floor_versions(tmp_path: Path) -> None:
    (tmp_path / "go").mkdir()
    package_stubs.package(tmp_path)
    assert (tmp_path / "go" / "go.mod").read_text() == (
        "module gym_rpc/stubs/go\n\ngo 1.19\n\nrequire (\n"
        "\tgoogle.golang.org/grpc v1.33.3\n\tgoogle.golang.org/protobuf v1.28.1\n)\n"
    )
    program = go_vendor_debian.read_go_mod(GO_CLIENT_DIR / "go.mod")
    assert program.replacements == {GO_MODULE_PATH: "../../stubs/go"}
    assert program.requirements[GO_MODULE_PATH] == f"v{package_stubs.contract_version()}"


@needs_npm_tools
def test_buf_breaking_passes_against_the_released_contract() -> None:
    run([BUF, "breaking", "--against", RELEASED_CONTRACT])


def copy_of_the_contract(tmp_path: Path) -> Path:
    """proto/ and buf.yaml copied into tmp_path, and the copy's .proto file, to change."""
    shutil.copy(REPO_ROOT / "buf.yaml", tmp_path)
    shutil.copytree(REPO_ROOT / "proto", tmp_path / "proto")
    return tmp_path / "proto" / "gym_rpc" / "v1" / "control_plane.proto"


@needs_npm_tools
def test_buf_breaking_reports_a_breaking_change(tmp_path: Path) -> None:
    """The check is live: renumbering a field in a copy of proto/ fails against the committed image."""
    proto = copy_of_the_contract(tmp_path)
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


def differs_from_the_release(root: Path, tmp_path: Path) -> bool:
    """Whether the contract under `root` is not the released image's (comments aside: no source info)."""
    released, current = tmp_path / "released.binpb", tmp_path / "current.binpb"
    run([BUF, "build", RELEASED_CONTRACT, "--exclude-source-info", "-o", released])
    run([BUF, "build", "--exclude-source-info", "-o", current], cwd=root)
    return released.read_bytes() != current.read_bytes()


def semver(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


@needs_npm_tools
def test_one_version_is_one_contract(tmp_path: Path) -> None:
    """The stub packages carry proto/VERSION: it is the released version while proto/ is the released contract,
    and higher once proto/ adds to it, so two packages of one version never hold different contracts."""
    released, current = RELEASED_VERSION.read_text().strip(), package_stubs.contract_version()
    if differs_from_the_release(REPO_ROOT, tmp_path):
        assert semver(current) > semver(released), (
            f"proto/ is no longer the released contract {released}: raise proto/VERSION ({current}), its minor "
            "for an addition (then `make release-contract` when it is released)"
        )
    else:
        assert current == released, f"proto/ is the released contract {released}, but proto/VERSION says {current}"
    (tmp_path / "added").mkdir()
    proto = copy_of_the_contract(tmp_path / "added")  # the comparison sees an addition
    text = proto.read_text()
    field = "  uint32 http_status = 7;\n"
    assert field in text
    proto.write_text(text.replace(field, f"{field}  bool added = 99;\n"))
    assert differs_from_the_release(tmp_path / "added", tmp_path)


@pytest.mark.parametrize(
    ("fence", "program"),
    [
        ("ts", CLIENT_DIR / "client.ts"),
        ("ts", PACKAGE_CONSUMER_DIR / "consumer.ts"),
        ("go", GO_CLIENT_DIR / "main.go"),
    ],
    ids=["typescript-client", "npm-package-consumer", "go-client"],
)
def test_readme_shows_the_programs_the_tests_run(fence: str, program: Path) -> None:
    text = program.read_text().rstrip()
    readme = OTHER_LANGUAGES_PAGE.read_text()
    assert f"```{fence}\n{text}\n```" in readme, f"docs' copy of {program.relative_to(REPO_ROOT)} differs"


def test_readme_installs_and_requires_the_stubs_at_the_contract_version() -> None:
    """The docs' npm install line and go.mod lines name the version `make stubs` packs, as interop/go does."""
    readme = OTHER_LANGUAGES_PAGE.read_text().splitlines()
    version = package_stubs.contract_version()
    npm_installs = [line for line in readme if line.startswith("npm install ./gym-rpc-control-plane-")]
    assert npm_installs and all(f"-{version}.tgz " in line for line in npm_installs), npm_installs
    go_mod = (GO_CLIENT_DIR / "go.mod").read_text()
    for line in (f"require {GO_MODULE_PATH} v{version}", f"replace {GO_MODULE_PATH} => ../../stubs/go"):
        assert line in readme, f"docs/other-languages.md lacks the go.mod line {line!r}"
        assert line.split(None, 1)[1] in go_mod, f"interop/go/go.mod lacks {line!r}"


def readme_python_client() -> str:
    """The docs' complete Python client (docs/other-languages.md, "Python")."""
    readme = OTHER_LANGUAGES_PAGE.read_text()
    marker = "```python\n# The head's config, every server's status, then the watch's snapshot"
    start = readme.index(marker) + len("```python\n")
    return readme[start : readme.index("```", start)]


def test_readme_python_client_runs_the_same_script(tmp_path: Path, model_server: ThreadedHttpServer) -> None:
    script = tmp_path / "client.py"
    script.write_text(readme_python_client())
    tools_port = closed_port()
    doc = {
        "head_server": {"host": LOOPBACK, "port": 0},
        "model": server_entry(model_server.port),
        "tools": server_entry(tools_port, "resources_servers"),
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    with running_head(config) as head:
        wait_for_statuses(head.address, {"model": "success", "tools": "connection_error"}, ClientSecurity())
        version = SyncControlClient(head.address, security=ClientSecurity()).get_global_config().version
        env = {**os.environ, "GYM_RPC_HEAD": head.address}
        quiet = LineReader([sys.executable, script], tmp_path, tmp_path / "quiet.stderr", env)
        try:  # a quiet head: the snapshot, then the program ends by itself
            quiet_lines = [quiet.text_line(CLIENT_SECONDS) for _ in range(4)]
            quiet_exit = quiet.finish(10.0)
        finally:
            quiet.close()
        client = LineReader([sys.executable, script, "1"], tmp_path, tmp_path / "client.stderr", env)
        try:
            lines = [client.text_line(CLIENT_SECONDS) for _ in range(4)]
            model_server.stop()
            lines.append(client.text_line(5.0))
            exit_code = client.finish(5.0)
        finally:
            client.close()
    assert quiet_exit == 0, quiet.stderr
    assert quiet_lines == lines[:4]
    assert exit_code == 0, client.stderr
    assert lines[:4] == [
        f"config {version} model tools",
        "status model success",
        "status tools connection_error",
        "snapshot model=success tools=connection_error",
    ]
    assert lines[4] in ("change model=connection_error", "change model=timeout")  # as STOPPED_MODEL
