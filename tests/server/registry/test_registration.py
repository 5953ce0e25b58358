"""Server registration against a real head on loopback: the RPCs, what the head advertises and probes, how
ServerClient resolves wildcard-bound servers, and the aiohttp / ASGI helpers.

On one machine every registration comes from 127.0.0.1, so these tests tell the advertised address from the
loopback fallback by the port: the config says a port nothing listens on, the server registers its real one.
(tests/project/test_multihost.py sees real peer addresses across network namespaces.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import grpc
import pytest
import uvicorn
from aiohttp import web

from gym_rpc.client.control._clients import ControlClient, SyncControlClient
from gym_rpc.client.control._head_view import ADVERTISED_LOOKUP_TIMEOUT_SECONDS
from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig, GlobalConfig
from gym_rpc.errors import ControlPlaneError, UnknownServerError
from gym_rpc.integrations._registration import (
    RegistrationLifespan,
    ServerRegistration,
    process_start_time,
    register_aiohttp_app,
    with_registration,
)
from gym_rpc.server._head import HeadServer
from gym_rpc.server.registry._registry import advertised_host, is_valid_host, peer_host
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.waiting import LoopStallDetector, eventually

TOKEN = "registration-token"


# --- helpers ---------------------------------------------------------------------------------------------------


def wildcard_doc(**servers_ports: int) -> dict[str, Any]:
    """A config whose servers bind 0.0.0.0 on the given (config) ports."""
    return document({name: server_entry(port, host="0.0.0.0") for name, port in servers_ports.items()})


def head_config(head: HeadServer, **extra: Any) -> BaseServerConfig:
    return BaseServerConfig.model_validate({"host": LOOPBACK, "port": head.port, **extra})


def registration(head: HeadServer, name: str, port: int, **options: Any) -> ServerRegistration:
    return ServerRegistration(name, port, head=head_config(head), refresh_seconds=None, **options)


async def instances(head: HeadServer) -> dict[str, Any]:
    return {i.name: i for i in await ControlClient(head.address).list_server_instances()}


async def answer_ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


# --- addresses -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.231.0.2:43210", "10.231.0.2"),
        ("ipv6:[::1]:5678", "::1"),
        ("ipv6:[::ffff:10.0.0.7]:5678", "10.0.0.7"),  # a dual-stack head sees IPv4 callers this way
        ("ipv6:[fe80::1%25eth0]:5678", "fe80::1%eth0"),
        ("unix:/tmp/head.sock", None),
        ("ipv4:not-an-ip:1", None),
        ("", None),
    ],
)
def test_peer_host(peer: str, host: str | None) -> None:
    assert peer_host(peer) == host


def test_advertised_host_rules() -> None:
    assert advertised_host("0.0.0.0", "", "ipv4:10.0.0.2:1") == "10.0.0.2"  # wildcard: where the call came from
    assert advertised_host("::", "", "ipv6:[2001:db8::5]:1") == "2001:db8::5"
    assert advertised_host("", "", "unix:/x") == "127.0.0.1"  # no usable peer: loopback, as without registration
    assert advertised_host("10.9.9.9", "", "ipv4:10.0.0.2:1") == "10.9.9.9"  # a specific bind host is kept
    assert advertised_host("0.0.0.0", "gpu-7.cluster", "ipv4:10.0.0.2:1") == "gpu-7.cluster"  # named wins


def test_process_start_time_is_this_process() -> None:
    started = process_start_time()
    assert 0 < started <= time.time()
    assert time.time() - started < 24 * 3600  # a test run's process, not the boot time or the epoch


# --- the RPCs --------------------------------------------------------------------------------------------------


async def test_register_list_and_deregister(head_factory, http_server) -> None:
    port = await http_server()
    head = await head_factory(wildcard_doc(policy=closed_port()))
    control = SyncControlClient(head.address)
    started = time.time() - 5
    url = await asyncio.to_thread(
        control.register_server_instance,
        "policy",
        listen_port=port,
        listen_host="0.0.0.0",
        pid=4242,
        start_time=started,
    )
    assert url == f"http://127.0.0.1:{port}"
    row = (await instances(head))["policy"]
    assert (row.pid, row.advertised_url) == (4242, url)
    assert row.start_time == pytest.approx(started, abs=1e-3)
    assert row.url.endswith(f":{head.config.servers['policy'].port}")  # `url` stays the config's

    assert await asyncio.to_thread(control.deregister_server_instance, "policy", pid=1) is False  # another pid
    assert (await instances(head))["policy"].advertised_url == url
    assert await asyncio.to_thread(control.deregister_server_instance, "policy", pid=4242) is True
    row = (await instances(head))["policy"]
    assert (row.pid, row.advertised_url) == (0, "")
    assert await asyncio.to_thread(control.deregister_server_instance, "policy", pid=4242) is False  # none left


async def test_register_errors(head_factory) -> None:
    head = await head_factory(wildcard_doc(policy=8000))
    control = ControlClient(head.address)
    with pytest.raises(UnknownServerError, match=r"'nope'.*known servers: head_server, policy"):
        await control.register_server_instance("nope", listen_port=1)
    with pytest.raises(UnknownServerError):
        await control.deregister_server_instance("nope", pid=1)
    for name, port, what in [
        ("", 1, "server_name"),
        ("policy", 0, "listen_port"),
        ("policy", 70000, "listen_port"),
    ]:
        with pytest.raises(ControlPlaneError, match=f"INVALID_ARGUMENT.*{what}"):
            await control.register_server_instance(name, listen_port=port)
    with pytest.raises(ControlPlaneError, match=r"INVALID_ARGUMENT.*pid"):
        await control.register_server_instance("policy", listen_port=1, pid=-1)


@pytest.mark.parametrize("host", ["10.0.0.5:8000", "evil.example/x#", "user@node", "a b", "[10.0.0.5]", "-x.y"])
def test_is_valid_host_refuses_what_could_rewrite_a_url(host: str) -> None:
    assert not is_valid_host(host)


async def test_register_refuses_hosts_that_are_not_hosts(head_factory) -> None:
    head = await head_factory(wildcard_doc(policy=8000))
    control = ControlClient(head.address)
    for bad in ("10.0.0.5:8000", "evil.example/x#"):
        for field in ("listen_host", "advertise_host"):
            hosts: dict[str, Any] = {field: bad}
            with pytest.raises(ControlPlaneError, match=f"INVALID_ARGUMENT.*{field}") as refused:
                await control.register_server_instance("policy", listen_port=8001, **hosts)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (await instances(head))["policy"].advertised_url == ""  # nothing was registered
    for good, url_host in [
        ("10.0.0.5", "10.0.0.5"),
        ("::1", "[::1]"),
        ("[::1]", "[::1]"),
        ("node-3.cluster.local", "node-3.cluster.local"),
    ]:
        for field in ("listen_host", "advertise_host"):
            hosts = {field: good}
            url = await control.register_server_instance("policy", listen_port=8001, **hosts)
            assert url == f"http://{url_host}:8001", (field, good)


async def test_registration_needs_the_token(head_factory, caplog) -> None:
    doc = wildcard_doc(policy=8000)
    doc["head_server"]["auth_token"] = TOKEN
    head = await head_factory(doc)
    anonymous = registration(head, "policy", 8000)
    with caplog.at_level(logging.WARNING, logger="gym_rpc.integrations._registration"):
        assert await asyncio.to_thread(anonymous.register) is False
    assert "UNAUTHENTICATED" in caplog.text and "serving anyway" in caplog.text
    assert head.registry.get("policy") is None
    trusted = ServerRegistration("policy", 8000, head=head_config(head, auth_token=TOKEN), refresh_seconds=None)
    assert await asyncio.to_thread(trusted.register) is True
    assert head.registry.get("policy") is not None


async def test_the_head_probes_the_advertised_address(head_factory, http_server) -> None:
    port = await http_server()
    config_port = closed_port()
    head = await head_factory(wildcard_doc(policy=config_port))
    control = ControlClient(head.address)
    assert (await control.get_server_status("policy")).status == "connection_error"  # loopback:config_port
    await control.register_server_instance("policy", listen_port=port, listen_host="0.0.0.0", pid=4343)
    report = await control.get_server_status("policy")
    assert (report.status, report.url) == ("success", f"http://127.0.0.1:{port}")

    async def listed_at_advertised_url() -> bool:
        reports = (await control.list_server_statuses()).reports
        return [(r.url, r.status) for r in reports] == [(f"http://127.0.0.1:{port}", "success")]

    await eventually(listed_at_advertised_url, within=5.0, every=0.02)
    assert await control.deregister_server_instance("policy", pid=4343)
    assert (await control.get_server_status("policy")).url == f"http://127.0.0.1:{config_port}"


async def test_a_specific_config_host_is_not_overridden(head_factory, http_server) -> None:
    """Only wildcard entries follow registrations: a config naming a host is the operator's word."""
    port = await http_server()
    head = await head_factory(document({"policy": server_entry(port)}))
    control = ControlClient(head.address)
    advertised = await control.register_server_instance("policy", listen_port=port + 1, advertise_host="elsewhere")
    assert advertised == f"http://elsewhere:{port + 1}"
    assert (await control.get_server_status("policy")).url == f"http://127.0.0.1:{port}"
    assert (await instances(head))["policy"].advertised_url == advertised


async def test_registration_survives_a_reload(head_factory, http_server) -> None:
    port = await http_server()
    doc = wildcard_doc(policy=closed_port())
    head = await head_factory(doc)
    control = ControlClient(head.address)
    await control.register_server_instance("policy", listen_port=port)
    assert head.config_path is not None
    head.config_path.write_text(head.config_path.read_text() + "observability_enabled: false\n")
    assert (await control.reload_global_config())[1] is True
    assert (await control.get_server_status("policy")).url == f"http://127.0.0.1:{port}"


# --- ServerClient ----------------------------------------------------------------------------------------------


async def test_server_client_dials_the_registered_address(head_factory, http_server, caplog) -> None:
    policy_port, tools_port = await http_server(), await http_server()
    head = await head_factory(wildcard_doc(policy=closed_port(), tools=closed_port(), idle=closed_port()))
    control = ControlClient(head.address)
    await control.register_server_instance("policy", listen_port=policy_port)
    await control.register_server_instance("tools", listen_port=tools_port)
    client = await asyncio.to_thread(ServerClient.load_from_global_config, head_config(head))
    try:
        # The async path asks the head off the loop (which serves that head here): no deadlock, no wait.
        response = await asyncio.wait_for(client.post("policy", "/v1/responses", json={}), 5)
        assert response.status == 200
        response.release()
        assert client._endpoints.advertised_urls == {
            "policy": f"http://127.0.0.1:{policy_port}",
            "tools": f"http://127.0.0.1:{tools_port}",
        }
        await head.stop()  # asked once: later lookups within the retry interval need no head
        with caplog.at_level(logging.WARNING, logger="gym_rpc.client.server_client"):
            assert client._resolve_base_url("tools") == f"http://127.0.0.1:{tools_port}"
            assert client._resolve_base_url("idle") == f"http://127.0.0.1:{head.config.servers['idle'].port}"
        assert "cannot ask the head" not in caplog.text  # a lookup would have found the head gone, and warned
    finally:
        await close_http_sessions()


async def test_a_server_registering_after_the_first_lookup_is_found_later(
    head_factory, http_server, monkeypatch, caplog
):
    """The loopback stand-in of an unregistered wildcard server is not cached: once the retry interval passes,
    the client asks the head again and dials the registered address from then on."""
    import gym_rpc.client._endpoints as endpoints_module

    port = await http_server()
    head = await head_factory(wildcard_doc(policy=closed_port()))
    client = await asyncio.to_thread(ServerClient.load_from_global_config, head_config(head))
    loopback = f"http://127.0.0.1:{head.config.servers['policy'].port}"
    assert await client._aresolve_base_url("policy") == loopback  # not registered yet
    await ControlClient(head.address).register_server_instance("policy", listen_port=port)
    assert await client._aresolve_base_url("policy") == loopback  # within the retry interval: not asked again
    monkeypatch.setattr(endpoints_module, "ADVERTISED_RETRY_SECONDS", 0.0)
    with caplog.at_level(logging.WARNING, logger="gym_rpc.client.server_client"):
        assert await client._aresolve_base_url("policy") == f"http://127.0.0.1:{port}"
    assert client._server_base_urls["policy"] == f"http://127.0.0.1:{port}"  # found: cached for good
    # The lookup falls due again at once (retry interval 0): a second, blocking lookup made on this loop, which
    # serves the head, could only time out and warn. None was made.
    assert "cannot ask the head" not in caplog.text


async def test_no_lookup_blocks_the_event_loop_that_serves_the_head(
    head_factory, http_server, monkeypatch, caplog
):
    """Wildcard-bound servers looked up from the loop, with every lookup always due: the head's answers arrive
    (it is served by this very loop, so a control call made on the loop could only time out) and the loop never
    stalls for anything near a lookup's deadline."""
    import gym_rpc.client._endpoints as endpoints_module

    policy_port = await http_server()
    head = await head_factory(wildcard_doc(policy=closed_port(), idle=closed_port()))
    await ControlClient(head.address).register_server_instance("policy", listen_port=policy_port)
    client = await asyncio.to_thread(ServerClient.load_from_global_config, head_config(head))
    monkeypatch.setattr(endpoints_module, "ADVERTISED_RETRY_SECONDS", 0.0)
    try:
        with caplog.at_level(logging.WARNING, logger="gym_rpc.client.server_client"):
            async with LoopStallDetector() as loop_watch:
                for _ in range(3):
                    response = await asyncio.wait_for(client.post("policy", "/v1/responses", json={}), 10)
                    assert response.status == 200
                    response.release()
                    idle = await asyncio.wait_for(client._aresolve_base_url("idle"), 10)  # unregistered: asks
                    assert idle == f"http://127.0.0.1:{head.config.servers['idle'].port}"
    finally:
        await close_http_sessions()
    assert "cannot ask the head" not in caplog.text  # every lookup was answered
    assert loop_watch.longest_stall < ADVERTISED_LOOKUP_TIMEOUT_SECONDS / 2, loop_watch.longest_stall


async def test_server_client_falls_back_to_loopback_when_the_head_cannot_say(caplog) -> None:
    config = GlobalConfig.from_document(wildcard_doc(policy=8000))
    client = ServerClient._from_global_config(BaseServerConfig(host=LOOPBACK, port=closed_port()), config)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gym_rpc.client.server_client"):
        assert await client._aresolve_base_url("policy") == "http://127.0.0.1:8000"
    assert time.monotonic() - started < 5  # bounded by ADVERTISED_LOOKUP_TIMEOUT_SECONDS and gRPC's retries
    assert "dialling them on loopback" in caplog.text
    assert client._endpoints.advertised_urls == {}


# --- the helpers -----------------------------------------------------------------------------------------------


async def test_a_refresh_after_deregister_does_not_register_again(head_factory) -> None:
    """A refresh whose thread outlives the cancelled refresher must not undo deregister()."""
    head = await head_factory(wildcard_doc(policy=closed_port()))
    registration = ServerRegistration("policy", port=closed_port(), head=head.address, refresh_seconds=None)
    assert await asyncio.to_thread(registration.register)
    assert await asyncio.to_thread(registration.deregister)
    assert await asyncio.to_thread(registration._refresh, True) is False  # the late refresh is dropped
    instances = await ControlClient(head.address).list_server_instances()
    assert [i.advertised_url for i in instances if i.name == "policy"] == [""]
    assert await asyncio.to_thread(registration.register)  # an explicit register() starts over
    instances = await ControlClient(head.address).list_server_instances()
    assert [i.advertised_url for i in instances if i.name == "policy"] != [""]


async def test_aiohttp_app_registers_while_it_serves(head_factory) -> None:
    head = await head_factory(wildcard_doc(policy=closed_port()))
    app = web.Application()
    app.router.add_get("/", answer_ok)
    port = closed_port()
    helper = register_aiohttp_app(app, "policy", port, head=head_config(head), refresh_seconds=None)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()  # startup: registered
    try:
        await web.TCPSite(runner, LOOPBACK, port).start()
        row = (await instances(head))["policy"]
        assert (row.pid, row.advertised_url) == (os.getpid(), f"http://127.0.0.1:{port}")
        assert helper.advertised_url == row.advertised_url
        assert (await ControlClient(head.address).get_server_status("policy")).status == "success"
    finally:
        await runner.cleanup()  # cleanup: deregistered
    assert (await instances(head))["policy"].advertised_url == ""
    assert helper.advertised_url is None


async def test_an_unreachable_head_costs_a_warning_only(caplog) -> None:
    app = web.Application()
    app.router.add_get("/", answer_ok)
    register_aiohttp_app(app, "policy", 1, head=f"{LOOPBACK}:{closed_port()}", refresh_seconds=None)
    runner = web.AppRunner(app, access_log=None)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gym_rpc.integrations._registration"):
        await runner.setup()
        await runner.cleanup()
    assert time.monotonic() - started < 6  # two bounded calls (2 s deadlines), never a hang
    assert "not registered" in caplog.text and "could not deregister" in caplog.text


async def test_refresh_registers_again_after_the_head_forgot(head_factory) -> None:
    head = await head_factory(wildcard_doc(policy=closed_port()))
    helper = ServerRegistration("policy", 9, head=head_config(head), refresh_seconds=0.05)
    async with helper:
        assert head.registry.get("policy") is not None
        head.registry.deregister("policy", 0)  # as a restarted head would have none

        async def registered_again() -> bool:
            return head.registry.get("policy") is not None

        await eventually(registered_again, within=5.0, every=0.02)
    assert head.registry.get("policy") is None


async def drive_lifespan(app: Any) -> list[str]:
    """Run the ASGI lifespan protocol against `app` as a server would; return what the app sent."""
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    sent: list[str] = []

    async def receive() -> dict[str, Any]:
        return await inbox.get()

    async def send(message: Any) -> None:
        sent.append(message["type"])

    await inbox.put({"type": "lifespan.startup"})
    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send))
    await eventually(lambda: _true_when(sent, "lifespan.startup.complete"), within=5.0, every=0.02)
    sent.append("<running>")
    await inbox.put({"type": "lifespan.shutdown"})
    await asyncio.wait_for(task, 5)
    return sent


async def _true_when(sent: list[str], message_type: str) -> bool:
    return message_type in sent


async def no_lifespan_app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        raise RuntimeError(f"unsupported scope {scope['type']}")


class LifespanApp:
    """A minimal app that speaks lifespan itself, recording when its startup and shutdown ran."""

    def __init__(self) -> None:
        self.events: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "lifespan"
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.events.append("app started")
                await send({"type": "lifespan.startup.complete"})
            else:
                self.events.append("app stopping")
                await send({"type": "lifespan.shutdown.complete"})
                return


@pytest.mark.parametrize("speaks_lifespan", [True, False], ids=["lifespan-app", "plain-app"])
async def test_asgi_lifespan_registers_and_deregisters(head_factory, speaks_lifespan: bool) -> None:
    head = await head_factory(wildcard_doc(policy=closed_port()))
    inner = LifespanApp() if speaks_lifespan else no_lifespan_app
    helper = registration(head, "policy", 8123)
    app = RegistrationLifespan(inner, helper)
    states: list[str] = []

    original_register, original_deregister = helper.aregister, helper.aderegister

    async def aregister() -> bool:
        states.append("register")
        registered = await original_register()
        found = head.registry.get("policy")  # the head itself holds the registration: register() reached it
        states.append(found.advertised_url if found is not None else "not at the head")
        return registered

    async def aderegister() -> bool:
        states.append("deregister")
        return await original_deregister()

    helper.aregister, helper.aderegister = aregister, aderegister  # type: ignore[method-assign]
    sent = await drive_lifespan(app)
    assert sent == ["lifespan.startup.complete", "<running>", "lifespan.shutdown.complete"]
    assert states == ["register", "http://127.0.0.1:8123", "deregister"]
    assert head.registry.get("policy") is None
    if isinstance(inner, LifespanApp):
        assert inner.events == ["app started", "app stopping"]  # registered after startup, gone before shutdown


async def test_asgi_app_under_uvicorn(head_factory) -> None:
    head = await head_factory(wildcard_doc(policy=closed_port()))
    port = closed_port()

    async def hello(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = with_registration(hello, "policy", port, head=head_config(head), refresh_seconds=None)
    server = uvicorn.Server(uvicorn.Config(app, host=LOOPBACK, port=port, lifespan="on", log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:

        async def up() -> bool:
            return server.started and (await instances(head))["policy"].advertised_url != ""

        await eventually(up, within=5.0, every=0.02)

        async def status() -> str | None:
            return (await ControlClient(head.address).get_server_status("policy")).status

        # uvicorn runs the lifespan startup (the registration) before it binds its port: a probe of the head in
        # between is refused, and that connection_error stands until the head's next probe (soak run 10, load 6)
        await eventually(status, lambda now: now == "success", within=10.0, every=0.05)
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
    assert head.registry.get("policy") is None
