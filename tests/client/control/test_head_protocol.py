"""The client finds out once per process and head address whether the head speaks gRPC or NeMo Gym's HTTP.

Real servers on loopback: a `gym-rpc head` subprocess (gRPC), and an aiohttp app serving NeMo Gym's HTTP head
endpoints (tests/nemo_gym/test_ng_run.py runs NeMo Gym's own head). The look is one HTTP/1.1 `GET /`, which a gRPC
head closes without a word and an HTTP head answers; it counts against the call's deadline.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from aiohttp import web
from grpc_health.v1 import health, health_pb2_grpc

from gym_rpc.client import SyncControlClient
from gym_rpc.client.control._channel import CHANNEL_OPTIONS
from gym_rpc.client.control._clients import ControlClient
from gym_rpc.client.control._credentials import ClientSecurity
from gym_rpc.client.control._heads import GrpcHead, Head, NemoGymHttpHead, head_for
from gym_rpc.client.control._watch import StatusWatch
from gym_rpc.client.nemo_gym._head_endpoints import NemoGymEndpoints
from gym_rpc.client.server_client import ServerClient
from gym_rpc.errors import ControlPlaneError, HeadTimeoutError, HeadUnreachableError
from gym_rpc.wire import SERVICE_NAME
from tests.support import REPO_ROOT
from tests.support.cli import running_head
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port


def _nemo_gym_like_head(config: dict, seen: list[str], root_delay_seconds: float = 0.0) -> web.Application:
    """NeMo Gym's HTTP head endpoints, answered as its FastAPI head answers them; every path asked is recorded."""

    async def root(request: web.Request) -> web.Response:
        seen.append(request.path)
        await asyncio.sleep(root_delay_seconds)
        return web.json_response({"status": "ok"})

    async def config_yaml(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response(yaml.safe_dump(config))  # the YAML text as a JSON string literal

    async def instances(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response([])

    app = web.Application()
    app.router.add_get("/", root)
    app.router.add_get("/global_config_dict_yaml", config_yaml)
    app.router.add_get("/server_instances", instances)
    return app


async def _grpc_health_head(
    address: str, control_plane: dict[str, grpc.RpcMethodHandler] | None = None
) -> grpc.aio.Server:
    """A gRPC head at `address` that serves the health service (and `control_plane`'s methods), started."""
    grpc_head = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), grpc_head)  # type: ignore[attr-defined]
    if control_plane is not None:
        grpc_head.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, control_plane),))
    grpc_head.add_insecure_port(address)
    await grpc_head.start()
    return grpc_head


async def _http_head_at(port: int, seen: list[str]) -> web.AppRunner:
    """`_nemo_gym_like_head` serving a config of one server ("tools"), started at `port` (0: a free one)."""
    config = {"head_server": {"host": LOOPBACK, "port": port or 1}, "tools": server_entry(closed_port())}
    runner = web.AppRunner(_nemo_gym_like_head(config, seen), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, port, reuse_address=True).start()
    return runner


async def _a_grpc_head_known_then_stopped() -> tuple[int, SyncControlClient]:
    """A port whose gRPC head a client (returned) has talked to, so the address is known as gRPC's; the head has
    stopped since, and no call has noticed."""
    port = closed_port()
    grpc_head = await _grpc_health_head(f"{LOOPBACK}:{port}")
    client = SyncControlClient(f"{LOOPBACK}:{port}", timeout_seconds=2)
    assert await asyncio.to_thread(client.head_status) == "success"
    await grpc_head.stop(None)
    return port, client


async def _port_of_an_http_head_that_went_away() -> int:
    """A port this process knows as NeMo Gym's HTTP head's (a config was read there: the protocol is remembered per
    process and address), whose head has stopped."""
    runner = await _http_head_at(0, [])
    port = int(runner.addresses[0][1])
    await asyncio.to_thread(SyncControlClient(f"{LOOPBACK}:{port}", timeout_seconds=2).get_global_config)
    await runner.cleanup()
    return port


async def test_an_http_head_is_looked_at_once_per_process_and_address(http_server) -> None:
    seen: list[str] = []
    config = {"head_server": {"host": LOOPBACK, "port": 1}, "tools": server_entry(closed_port())}
    port = await http_server(_nemo_gym_like_head(config, seen))
    address = f"{LOOPBACK}:{port}"
    for _ in range(3):  # three clients, two calls each: one look in all
        client = SyncControlClient(address)
        await asyncio.to_thread(client.get_global_config)
        await asyncio.to_thread(client.list_server_instances)
    assert seen.count("/") == 1
    assert seen.count("/global_config_dict_yaml") == 3 and seen.count("/server_instances") == 3


async def test_an_http_head_slow_to_answer_is_still_told_apart(http_server) -> None:
    """A loaded machine: NeMo Gym's head answers the look after 1.5 s. The look waits within the call's deadline
    (5 s) instead of giving up and speaking HTTP/2 to an HTTP/1.1 head (which refuses it, and logs warnings)."""
    seen: list[str] = []
    config = {"head_server": {"host": LOOPBACK, "port": 1}, "tools": server_entry(closed_port())}
    port = await http_server(_nemo_gym_like_head(config, seen, root_delay_seconds=1.5))
    found = await asyncio.to_thread(SyncControlClient(f"{LOOPBACK}:{port}", timeout_seconds=5).get_global_config)
    assert sorted(found.servers) == ["tools"]
    assert seen == ["/", "/global_config_dict_yaml"]


def test_a_grpc_head_is_looked_at_once_and_logs_nothing(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"head_server": {"host": LOOPBACK, "port": 0}}))
    with running_head(config, "--log-level", "debug") as head:
        script = (
            "from gym_rpc.client import SyncControlClient\n"
            "from gym_rpc.client.nemo_gym import _head_protocol as protocol\n"
            "looks = []\n"
            "detect = protocol.detect\n"
            "protocol.detect = lambda *args: looks.append(args) or detect(*args)\n"
            f"client = SyncControlClient({head.address!r})\n"
            "client.get_global_config(); client.list_server_statuses(); client.get_global_config()\n"
            "print(len(looks), protocol.known_head_protocol(client.address, tls=False))\n"
        )
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == ["1", "grpc"]
        time.sleep(0.3)  # anything the head would log about the look has been written by now
        log = head.stderr_text
    assert [line for line in log.splitlines() if re.search(r" (WARNING|ERROR) |Traceback", line)] == []


def test_a_silent_head_fails_within_the_calls_deadline(silent_server_port: int) -> None:
    """The look counts against the call's deadline: a head that accepts and never answers fails the call at its
    deadline, not later."""
    client = SyncControlClient(f"{LOOPBACK}:{silent_server_port}", timeout_seconds=1.5)
    started = time.monotonic()
    with pytest.raises(HeadTimeoutError):
        client.get_global_config()
    assert time.monotonic() - started < 1.5 + 0.9


async def test_a_slow_look_at_one_head_holds_up_no_other(http_server, silent_server_port: int) -> None:
    """One lock per address: while a look at a silent head waits out its 5 s, a client of another head is
    answered (it finishes while the first look is still waiting)."""
    silent = SyncControlClient(f"{LOOPBACK}:{silent_server_port}", timeout_seconds=5)
    waiting = asyncio.ensure_future(asyncio.to_thread(_raises_head_timeout, silent.get_global_config))
    await asyncio.sleep(0.3)  # the silent look has begun (its connect completes in the kernel's backlog)
    seen: list[str] = []
    config = {"head_server": {"host": LOOPBACK, "port": 1}, "tools": server_entry(closed_port())}
    port = await http_server(_nemo_gym_like_head(config, seen))
    found = await asyncio.to_thread(SyncControlClient(f"{LOOPBACK}:{port}", timeout_seconds=5).get_global_config)
    assert sorted(found.servers) == ["tools"]
    assert not waiting.done()  # a shared lock would have made this look wait out the silent one first
    await waiting


def _raises_head_timeout(call: Callable[[], object]) -> None:
    with pytest.raises(HeadTimeoutError):
        call()


@pytest.fixture
def silent_server_port() -> Iterator[int]:
    """A listening socket that never accepts: connections complete in the kernel's backlog, nothing answers."""
    with socket.create_server((LOOPBACK, 0)) as mute:
        yield mute.getsockname()[1]


async def test_a_head_that_went_away_is_looked_at_again() -> None:
    """A gRPC head known at an address stops; the refused call forgets what the address spoke, so NeMo Gym's HTTP
    head started there next is found (and then known: a poll is one direct probe, no second look)."""
    port, client = await _a_grpc_head_known_then_stopped()
    assert await asyncio.to_thread(client.head_status) == "connection_error"
    seen: list[str] = []
    runner = await _http_head_at(port, seen)
    try:
        found = await asyncio.to_thread(client.get_global_config)
        assert sorted(found.servers) == ["tools"] and seen[0] == "/"
        head = {"host": LOOPBACK, "port": port}
        server_client = await asyncio.to_thread(ServerClient.load_from_global_config, head)
        status = await asyncio.to_thread(server_client.poll_for_status, "tools", 2)
        assert status == "connection_error"
        assert seen.count("/") == 1  # the poll was one direct probe of the server
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("flavour", ["blocking", "async"])
async def test_an_http_head_where_a_grpc_head_was_answers_the_next_call(flavour: str) -> None:
    """A gRPC head known at an address stops with no call in between (nothing failed, nothing forgotten) and NeMo
    Gym's HTTP head starts there (`ng_run` on the port a `gym-rpc head` had): the next call's gRPC attempt fails,
    the address is looked at again, and the call is answered over HTTP. Before, it failed with gRPC's "Trying to
    connect an http1.x server" (CI, when an HTTP head of one test got a port a gRPC head of an earlier one had)."""
    port, blocking = await _a_grpc_head_known_then_stopped()
    address = blocking.address
    seen: list[str] = []
    runner = await _http_head_at(port, seen)
    try:
        if flavour == "blocking":
            found = await asyncio.to_thread(blocking.get_global_config)
        else:
            found = await ControlClient(address, timeout_seconds=2).get_global_config()
        assert sorted(found.servers) == ["tools"]
        assert seen == ["/", "/global_config_dict_yaml"]  # one look, then the call over HTTP
    finally:
        await runner.cleanup()


async def test_an_http_head_that_went_away_is_looked_at_again(head_factory) -> None:
    """The other way round: NeMo Gym's HTTP head known at an address goes away and a gRPC head starts there. The
    status watch's failed HTTP read forgets what the address spoke, so its next try finds the gRPC head (here it
    refuses a client with no token: UNAUTHENTICATED, raised at once). Before, the watch retried over HTTP without
    end (seen in the suite, when a gRPC head got a port an HTTP head of an earlier test had had)."""
    port = await _port_of_an_http_head_that_went_away()
    head_server = {"host": LOOPBACK, "port": port, "auth_token": "s3cret-watch-token"}
    head = await head_factory(document({}, head_server=head_server), port=port)
    tries: list[BaseException] = []
    watch = StatusWatch(
        ControlClient(head.address, security=ClientSecurity()), on_retry=lambda error, _: tries.append(error)
    )
    async with asyncio.timeout(30):  # bounded: the bug was a watch that never ended
        with pytest.raises(ControlPlaneError, match="UNAUTHENTICATED"):
            async for _ in watch:
                pass
    assert len(tries) <= 1, tries  # the one HTTP read that found the HTTP head gone


async def test_a_grpc_head_where_an_http_head_was_answers_the_next_call(head_factory) -> None:
    """NeMo Gym's HTTP head known at an address goes away and a gym_rpc head starts there: the config call that
    still speaks HTTP fails, the address is looked at again, and the gRPC head answers the call."""
    port = await _port_of_an_http_head_that_went_away()
    head = await head_factory(document({"tools": server_entry(closed_port())}), port=port)
    found = await asyncio.to_thread(SyncControlClient(head.address, timeout_seconds=2).get_global_config)
    assert sorted(found.servers) == ["tools"]


async def test_a_head_that_is_unavailable_in_its_own_protocol_is_not_called_twice() -> None:
    """A call is made again only when the second look finds the other protocol: a gRPC head answering UNAVAILABLE
    (still a gRPC head) gets the call once, and an HTTP head that went away fails with NeMo Gym's head's error."""
    calls: list[str] = []

    async def unavailable(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        calls.append("GetGlobalConfig")
        await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")

    address = f"{LOOPBACK}:{closed_port()}"
    grpc_head = await _grpc_health_head(
        address, {"GetGlobalConfig": grpc.unary_unary_rpc_method_handler(unavailable)}
    )
    client = SyncControlClient(address, timeout_seconds=2)
    try:
        assert await asyncio.to_thread(client.head_status) == "success"  # the address is known as gRPC's
        with pytest.raises(HeadUnreachableError, match="draining"):
            await asyncio.to_thread(client.get_global_config)
        service_config = json.loads(str(dict(CHANNEL_OPTIONS)["grpc.service_config"]))
        assert (
            len(calls) == service_config["methodConfig"][0]["retryPolicy"]["maxAttempts"]
        )  # one call, as retried
    finally:
        await grpc_head.stop(None)
    port = await _port_of_an_http_head_that_went_away()
    with pytest.raises(HeadUnreachableError, match="NeMo Gym's head at"):
        await asyncio.to_thread(SyncControlClient(f"{LOOPBACK}:{port}", timeout_seconds=2).get_global_config)


async def test_a_grpc_head_is_named_in_the_error_of_nemo_gyms_head_client() -> None:
    """NeMo Gym's head client reaching a gRPC head: the error says so readably (http.client's BadStatusLine holds
    the raw bytes of gRPC's SETTINGS frame)."""
    address = f"{LOOPBACK}:{closed_port()}"
    grpc_head = await _grpc_health_head(address)
    try:
        with pytest.raises(HeadUnreachableError, match="answered in HTTP/2, as a gRPC server does") as failed:
            await asyncio.to_thread(NemoGymEndpoints(address).config, 2.0, include_secrets=False)
        assert "\\x00" not in str(failed.value) and "\x00" not in str(failed.value)
    finally:
        await grpc_head.stop(None)


async def test_an_answer_in_no_known_protocol_is_shown_escaped_and_short() -> None:
    """NeMo Gym's head client reaching a server that answers bytes of neither HTTP: the error shows their escaped
    start, not the raw bytes."""
    answer = b"\x15\x03\x01\x00\x02\x02\x0b" + b"x" * 500 + b"\r\n"

    async def answer_garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer_garbage, LOOPBACK, 0)
    address = f"{LOOPBACK}:{server.sockets[0].getsockname()[1]}"
    try:
        with pytest.raises(HeadUnreachableError) as failed:
            await asyncio.to_thread(NemoGymEndpoints(address).config, 2.0, include_secrets=False)
        assert "its answer is no HTTP/1.x: b'\\x15\\x03\\x01\\x00\\x02\\x02\\x0bxxx" in str(failed.value)
        assert "x" * 100 not in str(failed.value) and "\x15" not in str(failed.value)
    finally:
        server.close()
        await server.wait_closed()


def test_every_rpc_has_an_answer_from_nemo_gyms_head_or_says_why_not() -> None:
    """Rows without an HTTP answer are exactly those NeMo Gym's head cannot give: they change the head, or (the
    head health watch, which only registering servers use, and NeMo Gym's head takes no registrations) stream."""
    from gym_rpc.client.control._clients import ControlRpcs
    from gym_rpc.client.control._rpc import Rpc

    rows = {name: row for name, row in vars(ControlRpcs).items() if isinstance(row, Rpc)}
    without = sorted(name for name, row in rows.items() if row.http is None)
    assert without == [
        "deregister_server_instance",
        "register_instance",
        "register_server_instance",
        "reload_global_config",
        "watch_head_health",
    ]


async def test_head_for_is_one_implementation_per_protocol(http_server) -> None:
    """The seam: `head_for` is the gRPC head where one listens and NeMo Gym's HTTP head where that listens, each
    saying what it offers; the blocking and the asyncio client go through the same one."""
    grpc_address = f"{LOOPBACK}:{closed_port()}"
    grpc_head = await _grpc_health_head(grpc_address)
    seen: list[str] = []
    config = {"head_server": {"host": LOOPBACK, "port": 1}, "tools": server_entry(closed_port())}
    http_address = f"{LOOPBACK}:{await http_server(_nemo_gym_like_head(config, seen))}"
    try:
        found = {
            address: await asyncio.to_thread(head_for, address, ClientSecurity(), 2.0)
            for address in (grpc_address, http_address)
        }
        assert isinstance(found[grpc_address], GrpcHead) and isinstance(found[http_address], NemoGymHttpHead)
        offers = {type(head).__name__: _offers(head) for head in found.values()}
        assert offers == {"GrpcHead": (True, True, True), "NemoGymHttpHead": (False, False, False)}
        assert SyncControlClient(http_address).head() is found[http_address]
        assert ControlClient(grpc_address).head() is found[grpc_address]
        assert seen == ["/"]  # one look at the HTTP head for the three
    finally:
        await grpc_head.stop(None)


def _offers(head: Head) -> tuple[bool, bool, bool]:
    return head.keeps_statuses, head.guards_secrets, head.pushes_instances


@pytest.mark.parametrize("flavour", ["blocking", "async"])
async def test_a_grpc_head_where_an_http_head_was_answers_either_client(head_factory, flavour: str) -> None:
    """As above, for both call paths: the re-detection is written once, in the seam."""
    port = await _port_of_an_http_head_that_went_away()
    head = await head_factory(document({"tools": server_entry(closed_port())}), port=port)
    if flavour == "blocking":
        found = await asyncio.to_thread(SyncControlClient(head.address, timeout_seconds=2).get_global_config)
    else:
        found = await ControlClient(head.address, timeout_seconds=2).get_global_config()
    assert sorted(found.servers) == ["tools"]


def test_only_the_seam_decides_the_head_protocol() -> None:
    """Outside the seam (client/control/_heads.py) and the look itself (client/nemo_gym/_head_protocol.py), no
    module of gym_rpc asks which protocol a head speaks: the others ask the head what it offers. (NeMo Gym's
    endpoints name the protocol of a broken answer in their error, client/nemo_gym/_head_endpoints.py; that decides
    no call's way; client/nemo_gym/__init__.py exports the look to the seam.)"""
    package = REPO_ROOT / "gym_rpc"
    deciding = re.compile(r"\b(head_protocol|known_head_protocol|remembered_head_protocol|NEMO_GYM_HTTP|GRPC)\b")
    found = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if deciding.search(path.read_text(encoding="utf-8"))
    )
    assert found == [
        "client/control/_heads.py",
        "client/nemo_gym/__init__.py",
        "client/nemo_gym/_head_endpoints.py",
        "client/nemo_gym/_head_protocol.py",
    ]
