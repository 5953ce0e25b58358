"""ServerClient across process boundaries: it pickles and copies without its live state, and Ray actors post
rollouts through pickled clients to a live data server.

Ray runs on this machine only: a local cluster with two CPUs, no dashboard, no usage stats, a small object store,
and the node address pinned to loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray take 127.0.0.1 as the
node IP instead of the address of the machine's network interface). Its files go to a directory of the test's own
(RAY_TMPDIR), whose logs a failure shows. ray.init forks Ray's GCS and raylet from this process, beside the head
serving in the test's loop: tests/__init__.py turns gRPC's fork support off, whose post-fork handler killed the
forked GCS before its exec in about one start in five (then ray.init waited for a port file that never came).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiohttp import web

from gym_rpc.cli.demo import MODEL_SERVER, RESOURCES_SERVER, DemoStats, model_app
from gym_rpc.client._dict_config import PendingDictConfig
from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.data._http_pools import HttpPools
from gym_rpc.client.data._rollout import rollout_context
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig, GlobalConfig
from gym_rpc.integrations._registration import ServerRegistration
from tests.support import REPO_ROOT
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port

EXAMPLE = REPO_ROOT / "examples" / "ray_rollouts.py"
RAY_TIME_BUDGET = 120  # starting Ray and three actor processes on a loaded 2-core machine: a hang guard only
RAY_ENVIRONMENT = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage report
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # "no cluster": node IP 127.0.0.1, not the interface's address
    # Ray runs its workers at nice 15 (so its raylet and GCS win on a node of its own). Here they share 2 cores
    # with the rest of the suite at nice 0, and the actors, the code under test, starved: in a `make test` at load
    # 7-9, constructing each actor (an import of the example) took 16-31 s, and the rollouts had not ended when
    # the 120 s guard ran out. At nice 0 they get the share any other test's processes get.
    "RAY_worker_niceness": "0",
}
RAY_LOG_LINES = 40  # the last lines of each of Ray's logs that a failure shows


class Recorder:
    """A data server that answers 200 with the path it saw, and remembers every path."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.record)

    async def record(self, request: web.Request) -> web.Response:
        self.paths.append(request.raw_path)
        return web.json_response({"path": request.raw_path})


def client_for(doc: dict[str, Any], head_port: int | None = None) -> ServerClient:
    head = BaseServerConfig(host=LOOPBACK, port=head_port or closed_port())
    return ServerClient._from_global_config(head, GlobalConfig.from_document(doc))


# --- pickling and copying ----------------------------------------------------------------------------------------


async def test_pickle_keeps_config_and_caches_and_drops_live_sessions() -> None:
    doc = document(
        {"policy": server_entry(8000), "tools": server_entry(8200, "resources_servers", host="0.0.0.0")},
        checkpoint={"enabled": True},
        http_client={"max_connections": 7},
    )
    client = client_for(doc)
    client._resolve_base_url("policy")
    client._endpoints.advertised_urls = {"tools": "http://10.0.0.9:8200"}
    assert client.checkpoint_enabled() is True
    sessions = client._http.sessions()  # live aiohttp sessions of this loop: not picklable themselves
    assert client._data_plane.pools is client._http  # what the hot path reads, gathered: it holds the live pools
    try:
        with pytest.raises((TypeError, AttributeError)):
            pickle.dumps(sessions)
        restored = pickle.loads(pickle.dumps(client))
        assert restored._server_base_urls == {"policy": "http://127.0.0.1:8000"}
        assert restored._endpoints.advertised_urls == {"tools": "http://10.0.0.9:8200"}
        assert restored._checkpoint_enabled is True
        assert restored._global_config == client._global_config
        assert restored.head_server_config == client.head_server_config
        assert isinstance(restored.__dict__["global_config_dict"], PendingDictConfig)  # still built lazily
        assert (
            restored.global_config_dict["policy"]["responses_api_models"]["responses_api_models_impl"]["port"]
            == 8000
        )
        assert isinstance(restored._http, HttpPools) and restored._http is not client._http
        assert restored._http.settings.max_connections == 7
        assert restored._http._last is None  # reconnects on first use
        assert restored._data_plane.pools is restored._http  # its own, never the sender's
        assert vars(restored)["post"].args[0] is restored._data_plane  # its direct calls too
        assert not sessions.data.closed  # the original keeps its sessions
        assert restored._resolve_base_url("tools") == "http://10.0.0.9:8200"  # the cache travelled
    finally:
        await close_http_sessions()


async def test_copies_get_their_own_pools() -> None:
    client = client_for(document({"policy": server_entry(8000)}))
    client._resolve_base_url("policy")
    client._http.sessions()
    assert client._data_plane.pools is client._http
    try:
        shallow, deep = copy.copy(client), copy.deepcopy(client)
        for clone in (shallow, deep):
            assert clone._http is not client._http and clone._http._last is None
            assert clone._data_plane.pools is clone._http  # what its calls read is its own
            assert (
                vars(clone)["post"].args[0] is vars(clone)["get"].args[0] is clone._data_plane
            )  # its direct calls
            assert clone._data_plane.base_urls is clone._server_base_urls
            assert clone._http.settings == client._http.settings
            assert clone._resolve_base_url("policy") == "http://127.0.0.1:8000"
        assert shallow._server_base_urls is client._server_base_urls  # shallow: the same cache
        assert deep._server_base_urls is not client._server_base_urls
        assert deep._server_base_urls == client._server_base_urls
    finally:
        await close_http_sessions()


def post_rollouts_in_this_process(pickled_client: bytes, rollout_ids: list[str]) -> tuple[int, list[int]]:
    """Runs in another process: unpickle the client and post one rollout per id."""
    client: ServerClient = pickle.loads(pickled_client)

    async def run() -> list[int]:
        statuses = []
        for rollout_id in rollout_ids:
            with rollout_context(rollout_id):
                response = await client.post("policy", "/v1/responses", json={"input": rollout_id})
                statuses.append(response.status)
                response.release()
        await client.aclose()
        return statuses

    return os.getpid(), asyncio.run(run())


async def test_a_pickled_client_works_in_a_spawned_process(http_server) -> None:
    recorder = Recorder()
    port = await http_server(recorder.app)
    client = client_for(document({"policy": server_entry(port)}, observability_enabled=True))
    client._http.sessions()  # the parent's live state must not travel
    try:
        pickled = pickle.dumps(client)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            future = pool.submit(post_rollouts_in_this_process, pickled, ["spawned-1", "spawned-2"])
            pid, statuses = await asyncio.to_thread(future.result, 60)
        assert pid != os.getpid() and statuses == [200, 200]
        assert recorder.paths == ["/ng-rollout/spawned-1/v1/responses", "/ng-rollout/spawned-2/v1/responses"]
    finally:
        await close_http_sessions()


# --- Ray ---------------------------------------------------------------------------------------------------------


def load_example() -> ModuleType:
    """examples/ray_rollouts.py, whose actors the Ray test runs (so the example cannot rot)."""
    spec = importlib.util.spec_from_file_location("ray_rollouts_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ray_logs(ray_dir: Path) -> str:
    """What Ray wrote under `ray_dir` (its RAY_TMPDIR): each session's log files, with the end of the GCS's, the
    raylet's and every non-empty .err."""
    sessions = sorted(ray_dir.glob("ray/session_2*"))
    if not sessions:
        return f"Ray made no session under {ray_dir}\n"
    lines = []
    for session in sessions:
        logs = sorted(path for path in (session / "logs").iterdir() if path.is_file())
        lines.append(f"--- Ray session {session}: {len(logs)} log files")
        if not any(path.name.startswith("gcs_server") for path in logs):
            lines.append("no gcs_server log: the GCS never started logging (killed before its exec, or at once)")
        for path in logs:
            shown = path.name.startswith(("gcs_server", "raylet")) or path.suffix == ".err"
            text = path.read_text(encoding="utf-8", errors="replace").splitlines() if shown else []
            lines.append(f"--- {path.name}: {path.stat().st_size} bytes{', ends:' if text else ''}")
            lines.extend(text[-RAY_LOG_LINES:])
    return "\n".join(lines) + "\n"


@contextmanager
def ray_files(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory of this test's own for Ray's sessions and logs (RAY_TMPDIR: short, as Ray's socket paths must
    be). On a failure Ray's logs go to stderr (pytest shows them with it) and the directory stays, else it goes."""
    ray_dir = Path(tempfile.mkdtemp(prefix="gym-rpc-ray-"))
    monkeypatch.setenv("RAY_TMPDIR", str(ray_dir))
    try:
        yield ray_dir
    except BaseException:
        sys.stderr.write(ray_logs(ray_dir) + f"Ray's files are kept in {ray_dir}\n")
        raise
    shutil.rmtree(ray_dir, ignore_errors=True)


def start_local_ray(ray: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local Ray on loopback: no dashboard, no usage stats, a small object store, workers that import tests."""
    # ray.init forks its GCS and raylet from this process while the head serves in the test's loop: safe only with
    # gRPC's fork support off (tests/__init__.py; tests/project/test_suite_guarantees.py shows why)
    assert os.environ.get("GRPC_ENABLE_FORK_SUPPORT") == "0"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    constants = sys.modules.get("ray._private.ray_constants")  # read at import: right if ray came in earlier
    if constants is not None:
        monkeypatch.setattr(constants, "ENABLE_RAY_CLUSTER", False, raising=False)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=80 * 1024 * 1024,
        log_to_driver=False,
        configure_logging=False,
        namespace=f"gym-rpc-test-{os.getpid()}",
    )
    addresses = {node["NodeManagerAddress"] for node in ray.nodes()}
    if addresses != {LOOPBACK}:
        ray.shutdown()
        pytest.fail(f"Ray chose node addresses {addresses}, not loopback only")


@pytest.mark.timeout(240)  # Ray's start alone took most of the suite's 60 s on a loaded 2-core machine
async def test_ray_rollouts_spread_over_replica_actors_and_survive_one_killed(
    head_factory, http_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/ray_rollouts.py on a local Ray: three replicas of a stateful resources server as actors that
    register themselves, two rollout workers with pickled clients (each follows the head in its own process), and
    one replica killed mid-run. Every rollout ends with its reward; only rollouts that began on the killed replica
    moved; the model server, bound to a wildcard address, is reached at the address it registered."""
    for name, value in RAY_ENVIRONMENT.items():  # before the import: Ray reads some of them at import time
        monkeypatch.setenv(name, value)
    ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'gym-rpc[ray]' (in the dev extra)")
    example = load_example()
    started = time.monotonic()
    stats = DemoStats()
    model_port = await http_server(model_app(stats))
    resources_port = example.free_port()  # the config's own address: the first replica serves there
    doc = document(
        {
            MODEL_SERVER: server_entry(closed_port(), host="0.0.0.0"),
            RESOURCES_SERVER: server_entry(resources_port, "resources_servers"),
        },
        observability_enabled=True,
    )
    # probes of 5 s: at a load average of 17 the actors answered the default 0.5 s probes too late, and the head
    # called both live replicas timed out (NoHealthyInstanceError in the workers)
    head = await head_factory(doc, probe_interval_seconds=0.25, probe_timeout_seconds=5.0)
    head_server = BaseServerConfig(host=LOOPBACK, port=head.port)
    registration = ServerRegistration(MODEL_SERVER, model_port, head=head_server, refresh_seconds=None)
    assert await registration.aregister()
    client = await asyncio.to_thread(ServerClient.load_from_global_config, head_server)
    client._http.sessions()  # live state in the driver, which must not travel

    with ray_files(monkeypatch):
        await asyncio.to_thread(start_local_ray, ray, monkeypatch)
        try:
            start = asyncio.to_thread(example.start_replicas, f"{LOOPBACK}:{head.port}", 3, resources_port)
            replicas, addresses = await asyncio.wait_for(start, RAY_TIME_BUDGET)
            results = await asyncio.wait_for(
                asyncio.to_thread(example.run_rollouts, client, 2, 12, replicas=replicas, kill_after_seeded=2),
                RAY_TIME_BUDGET,
            )
        finally:
            await asyncio.to_thread(ray.shutdown)
            await close_http_sessions()
        seen = example.summary(results, addresses[1])
        assert seen["rewards"] == [1.0] * 24
        rollouts = [rollout for result in results for rollout in result["results"]]
        assert {rollout["replicas"][0] for rollout in rollouts} == set(addresses)  # spread over all three
        assert seen["moved"] == seen["moved_off_the_killed_one"]  # only the killed replica's rollouts moved
        assert addresses[1] not in seen["finished_on"] or all(
            rollout["attempts"] == 1 for rollout in rollouts if rollout["replicas"][-1] == addresses[1]
        )
        assert len({r["pid"] for r in results} | {os.getpid()}) == 3  # two worker processes besides this one
        assert stats.rollout_ids_seen == {f"worker{w}-task{t}" for w in range(2) for t in range(12)}
        assert time.monotonic() - started < RAY_TIME_BUDGET
