"""Token authentication, TLS and mutual TLS, secret redaction and the plaintext health port, against real heads.

Certificates are made at test time (a throwaway CA, a server certificate for 127.0.0.1 / ::1 / localhost, a client
certificate, and an unrelated CA that must not be trusted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omegaconf import OmegaConf

from gym_rpc.client.control._clients import ControlClient, SyncControlClient
from gym_rpc.client.control._credentials import ClientSecurity, client_security
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import REDACTED, BaseServerConfig, GlobalConfig
from gym_rpc.errors import ConfigError, ControlPlaneError, HeadUnreachableError
from gym_rpc.server._head import HeadOptions, HeadServer
from gym_rpc.server.security._auth import UNAUTHENTICATED_MESSAGE, ServerSecurity
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import SERVICE_NAME, TLS_CA_ENV_VAR, TLS_CERT_ENV_VAR, TLS_KEY_ENV_VAR, TOKEN_ENV_VAR
from tests.support.cli import LISTENING_PATTERN, STARTUP_SECONDS, run_cli, running_cli
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.security import (
    API_KEY,
    Pki,
    tls_block,
    tls_client,
)

TOKEN = "tok-3f9c2a-never-printed"
FAST = 2.0


# --- throwaway certificates ---


def secured_doc(port: int, **head_keys: Any) -> dict[str, Any]:
    doc = document({"policy": server_entry(port, api_key=API_KEY, max_tokens=512)})
    doc["head_server"].update(head_keys)
    return doc


@pytest.fixture(autouse=True)
def _no_security_from_the_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (TOKEN_ENV_VAR, TLS_CA_ENV_VAR, TLS_CERT_ENV_VAR, TLS_KEY_ENV_VAR):
        monkeypatch.delenv(name, raising=False)


def authed(token: str = TOKEN) -> ClientSecurity:
    return ClientSecurity(token=token)


# --- token authentication ---


def _unary_methods() -> list[str]:
    service = pb.DESCRIPTOR.services_by_name["ControlPlaneService"]
    return [m.name for m in service.methods if not m.server_streaming]


async def _raw_call(channel: grpc.aio.Channel, method: str, metadata: tuple[tuple[str, str], ...]) -> Any:
    """Call a ControlPlaneService method with an empty request, bypassing the typed client."""
    path = f"/{SERVICE_NAME}/{method}"
    if method == "WatchServerStatuses":
        stream = channel.unary_stream(path, None, None)(b"", metadata=metadata, timeout=FAST)
        return [message async for message in stream][:1]
    return await channel.unary_unary(path, None, None)(b"", metadata=metadata, timeout=FAST)


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
        f"Basic {TOKEN}",
        TOKEN,
        "Bearer ",
        f"Bearer  {TOKEN.upper()}",
    ],
    ids=["missing", "longer", "prefix", "basic-scheme", "no-scheme", "empty", "wrong-case"],
)
async def test_every_rpc_but_health_needs_the_token(head_factory, http_server, authorization) -> None:
    head = await head_factory(secured_doc(await http_server(), auth_token=TOKEN))
    metadata = (("authorization", authorization),) if authorization is not None else ()
    async with grpc.aio.insecure_channel(head.address) as channel:
        for method in [*_unary_methods(), "WatchServerStatuses"]:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _raw_call(channel, method, metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
            assert caught.value.details() == UNAUTHENTICATED_MESSAGE
            assert TOKEN not in str(caught.value) and TOKEN.upper() not in str(caught.value)
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=FAST)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_needs_the_token_too(head_factory) -> None:
    """The refusal comes from the call's metadata alone. The client sends no request meanwhile: grpc.aio reports
    a request it could not send after the head had already answered as INTERNAL, in place of the head's status
    (5 calls in 300 under load)."""
    head = await head_factory(document({}, head_server={"host": LOOPBACK, "port": 0, "auth_token": TOKEN}))
    path = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    answered = asyncio.Event()

    async def no_request_until_answered() -> AsyncIterator[bytes]:
        await answered.wait()
        return
        yield

    async with grpc.aio.insecure_channel(head.address) as channel:
        call = channel.stream_stream(path, None, None)(no_request_until_answered(), timeout=FAST)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in call:
                    pass
        finally:
            answered.set()
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_the_right_token_opens_every_rpc_and_scheme_case_does_not_matter(head_factory, http_server) -> None:
    head = await head_factory(secured_doc(await http_server(), auth_token=TOKEN))
    for metadata in ((("authorization", f"Bearer {TOKEN}"),), (("authorization", f"bearer {TOKEN}"),)):
        async with grpc.aio.insecure_channel(head.address) as channel:
            for method in _unary_methods():
                # Empty requests: some are answered with an error (no server name), none with UNAUTHENTICATED.
                await _raw_call_past_authentication(channel, method, metadata)
    client = ControlClient(head.address, security=authed())
    assert (await client.get_head_server_config()).port == head.port
    events = client.watch_server_statuses()
    try:
        assert (await anext(events)).kind == "snapshot"
    finally:  # closed in this loop: a stream left to the garbage collector can stall the next test's gRPC calls
        await cast(AsyncGenerator[Any, None], events).aclose()


async def _raw_call_past_authentication(channel: grpc.aio.Channel, method: str, metadata: Any) -> None:
    try:
        await _raw_call(channel, method, metadata)
    except grpc.aio.AioRpcError as error:
        assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (method, error)


async def test_typed_client_error_names_the_problem_not_the_token(head_factory) -> None:
    head = await head_factory(document({}, head_server={"host": LOOPBACK, "port": 0, "auth_token": TOKEN}))
    for security in (ClientSecurity(), authed("wrong-" + TOKEN)):
        with pytest.raises(ControlPlaneError) as caught:
            await ControlClient(head.address, security=security).list_server_statuses()
        assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert head.address in str(caught.value) and TOKEN_ENV_VAR in str(caught.value)
        assert TOKEN not in str(caught.value)


async def test_token_from_the_environment_on_both_sides(head_factory, monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV_VAR, TOKEN)
    head = await head_factory(document({}))
    assert head.security.token == TOKEN
    assert (await ControlClient(head.address).list_server_statuses()).reports == []
    monkeypatch.delenv(TOKEN_ENV_VAR)
    with pytest.raises(ControlPlaneError, match="UNAUTHENTICATED"):
        await ControlClient(head.address).list_server_statuses()


def test_token_precedence_and_redacted_placeholders(monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV_VAR, "from-env")
    assert client_security().token == "from-env"
    head = BaseServerConfig.model_validate({"host": LOOPBACK, "port": 1, "auth_token": "from-config"})
    assert client_security(head).token == "from-config"
    assert client_security(head, token="explicit").token == "explicit"
    # A config fetched from a head carries the placeholder, never a usable token: fall back to the environment.
    assert client_security({"host": LOOPBACK, "port": 1, "auth_token": REDACTED}).token == "from-env"
    assert TOKEN not in repr(ClientSecurity(token=TOKEN))
    assert TOKEN not in ServerSecurity(token=TOKEN).describe()


# --- secret redaction ---


def test_reprs_never_show_the_token_or_keys(monkeypatch, pki: Pki) -> None:
    doc = secured_doc(8000, auth_token=TOKEN)
    config = GlobalConfig.from_document(doc)
    head = BaseServerConfig.model_validate({"host": LOOPBACK, "port": 1, "auth_token": TOKEN, "max_tokens": 5})
    client_tls = {
        "ca_file": str(pki.ca),
        "client_cert_file": str(pki.client_cert),
        "client_key_file": str(pki.client_key),
    }
    security = client_security({"host": LOOPBACK, "port": 1, "tls": client_tls, "auth_token": TOKEN})
    assert security.tls is not None
    assert security.tls.private_key == pki.client_key.read_bytes()  # read from the file, kept out of the repr
    key_text = security.tls.private_key.decode()
    monkeypatch.setenv("NEMO_GYM_CONFIG_DICT", json.dumps(doc))
    injected = ServerClient.load_from_global_config()
    shown = {
        "GlobalConfig": repr(config),
        "BaseServerConfig": repr(head),
        "str(BaseServerConfig)": str(head),
        "ServerSecurity": repr(ServerSecurity(token=TOKEN)),
        "ClientTls": repr(security.tls),
        "ServerClient": repr(injected),
    }
    for what, text in shown.items():
        assert TOKEN not in text and API_KEY not in text, what
        assert "PRIVATE KEY" not in text and key_text[40:80] not in text, what
    assert f"auth_token='{REDACTED}'" in repr(head) and "max_tokens=5" in repr(head)  # whole words only
    assert "auth_token" in shown["ServerClient"]  # the nested head_server_config is shown, redacted
    assert injected.head_server_config.model_extra == {"auth_token": TOKEN}  # the value itself is kept


@pytest.mark.parametrize(
    "head_server",
    [
        {"port": 1, "auth_token": "s3cret"},  # no host
        {"host": LOOPBACK, "port": 1, "auth_token": "s3cret", "health_port": 70000},
        {"host": LOOPBACK, "port": 1, "auth_token": "s3cret", "tls": {"cert": "s3cret"}},
    ],
)
def test_config_errors_never_quote_the_head_server_block(head_server: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="head_server") as caught:
        GlobalConfig.from_document({"head_server": head_server})
    assert "s3cret" not in str(caught.value)


async def test_secrets_only_for_authenticated_callers_who_ask(head_factory, http_server) -> None:
    head = await head_factory(secured_doc(await http_server(), auth_token=TOKEN))
    client = ControlClient(head.address, security=authed())
    with_secrets = await client.get_global_config(include_secrets=True)
    policy = with_secrets.document["policy"]["responses_api_models"]["responses_api_models_impl"]
    assert policy["api_key"] == API_KEY and policy["max_tokens"] == 512
    assert with_secrets.servers["policy"].config["api_key"] == API_KEY
    # Even an authenticated caller never gets the head's own token back.
    assert with_secrets.document["head_server"]["auth_token"] == REDACTED
    assert TOKEN not in with_secrets.config_json
    assert with_secrets.version == head.config.version

    redacted = await client.get_global_config()
    assert API_KEY not in redacted.config_json and TOKEN not in redacted.config_json
    assert redacted.version == head.config.version


async def test_without_a_token_nobody_gets_secrets(head_factory, http_server) -> None:
    head = await head_factory(secured_doc(await http_server()))
    for security in (ClientSecurity(), authed("anything")):
        config = await ControlClient(head.address, security=security).get_global_config(include_secrets=True)
        assert API_KEY not in config.config_json
        assert config.servers["policy"].config["api_key"] == REDACTED


async def test_server_client_sends_the_token_of_its_head_server_config(head_factory, http_server) -> None:
    head = await head_factory(secured_doc(await http_server(), auth_token=TOKEN))
    with_token = BaseServerConfig.model_validate({"host": LOOPBACK, "port": head.port, "auth_token": TOKEN})
    client = await asyncio.to_thread(ServerClient.load_from_global_config, with_token)
    # Authenticated: the server process gets the secrets it needs (an API key), never the head's token.
    assert client.global_config_dict.policy.responses_api_models.responses_api_models_impl.api_key == API_KEY
    assert await asyncio.to_thread(client.poll_for_status, "policy") == "success"

    without = BaseServerConfig(host=LOOPBACK, port=head.port)
    with pytest.raises(ControlPlaneError, match="UNAUTHENTICATED"):
        await asyncio.to_thread(ServerClient.load_from_global_config, without)


async def test_no_log_line_carries_a_secret(head_factory, http_server, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    head = await head_factory(secured_doc(await http_server(), auth_token=TOKEN))
    for security in (ClientSecurity(), authed("wrong"), authed()):
        client = ControlClient(head.address, security=security)
        try:
            await client.get_global_config(include_secrets=True)
        except ControlPlaneError as error:
            logging.getLogger("test").warning("call failed: %s", error)
    # A ServerClient without the token: its status poll is refused, and it logs that (without secrets).
    tokenless = ServerClient(
        head_server_config=BaseServerConfig(host=LOOPBACK, port=head.port),
        global_config_dict=OmegaConf.create(head.config.document),
    )
    assert await asyncio.to_thread(tokenless.poll_for_status, "policy") == "unknown_error"
    text = "\n".join(record.getMessage() for record in caplog.records)
    assert "refused" in text and "status of policy" in text  # the head and the client did log the refusals
    assert TOKEN not in text and API_KEY not in text


# --- TLS and mutual TLS ---


async def test_tls_head_serves_clients_that_trust_its_ca(head_factory, http_server, pki) -> None:
    head = await head_factory(secured_doc(await http_server(), tls=tls_block(pki)))
    assert head.security.describe() == "TLS, no token"
    trusted = ControlClient(head.address, security=tls_client(pki), timeout_seconds=FAST)
    assert (await trusted.get_head_server_config()).port == head.port
    for stranger in (ClientSecurity(), tls_client(pki, pki.other_ca)):
        with pytest.raises(HeadUnreachableError) as caught:
            await ControlClient(head.address, security=stranger, timeout_seconds=FAST).get_head_server_config()
        assert head.address in str(caught.value)


async def test_mutual_tls_needs_a_client_certificate_from_the_ca(head_factory, pki) -> None:
    head = await head_factory(
        document({}, head_server={"host": LOOPBACK, "port": 0, "tls": tls_block(pki, mutual=True)})
    )
    assert head.security.describe() == "mutual TLS, no token"
    with_cert = ControlClient(head.address, security=tls_client(pki, cert=True), timeout_seconds=FAST)
    assert (await with_cert.list_server_statuses()).reports == []
    with pytest.raises(HeadUnreachableError):
        await ControlClient(head.address, security=tls_client(pki), timeout_seconds=FAST).list_server_statuses()


async def test_tls_and_client_certificate_from_the_environment(head_factory, pki, monkeypatch) -> None:
    head = await head_factory(
        document(
            {}, head_server={"host": LOOPBACK, "port": 0, "tls": tls_block(pki, mutual=True), "auth_token": TOKEN}
        )
    )
    monkeypatch.setenv(TLS_CA_ENV_VAR, str(pki.ca))
    monkeypatch.setenv(TLS_CERT_ENV_VAR, str(pki.client_cert))
    monkeypatch.setenv(TLS_KEY_ENV_VAR, str(pki.client_key))
    monkeypatch.setenv(TOKEN_ENV_VAR, TOKEN)
    client = SyncControlClient(head.address, timeout_seconds=FAST)  # everything from the environment
    assert await asyncio.to_thread(client.list_server_statuses)
    assert await asyncio.to_thread(client.head_status) == "success"


async def test_plaintext_health_port_serves_only_health(head_factory, pki) -> None:
    head_server = {"host": LOOPBACK, "port": 0, "tls": tls_block(pki), "health_port": 0, "auth_token": TOKEN}
    head = await head_factory(document({}, head_server=head_server))
    assert head.health_port not in (None, 0, head.port)
    async with grpc.aio.insecure_channel(f"{LOOPBACK}:{head.health_port}") as channel:
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        response = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=FAST)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _raw_call(channel, "ListServerStatuses", (("authorization", f"Bearer {TOKEN}"),))
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    await head.stop()
    with pytest.raises(HeadUnreachableError):  # the health port closes with the head
        await asyncio.to_thread(
            SyncControlClient(f"{LOOPBACK}:{head.health_port}", timeout_seconds=1).get_global_config
        )


async def test_garbage_on_the_tls_port_leaves_the_head_serving(head_factory, pki) -> None:
    head = await head_factory(document({}, head_server={"host": LOOPBACK, "port": 0, "tls": tls_block(pki)}))
    held = []
    # Fixed bytes, not random ones: about one random start in a thousand (any byte, then 0x03 and a length of more
    # than 2 KB) reads as the header of a TLS record longer than what follows, and the head rightly waits for the
    # rest, as for the silent first connection (found when CI timed out on one).
    not_tls = bytes(range(256)) * 8
    for payload in (b"", not_tls, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"\x16\x03\x01\xff\xff"):
        reader, writer = await asyncio.open_connection(LOOPBACK, head.port)
        writer.write(payload)
        await writer.drain()
        held.append((reader, writer))
    client = ControlClient(head.address, security=tls_client(pki), timeout_seconds=FAST)
    assert (await client.list_server_statuses()).reports == []
    for reader, _ in held[1:3]:  # not TLS at all: the head hangs up (read() returns only at end of stream)
        await asyncio.wait_for(reader.read(), 5.0)
        assert reader.at_eof()
    for _, writer in held:
        writer.close()
    assert (await client.get_head_server_config()).port == head.port


def test_tls_settings_errors_are_config_errors(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(ConfigError, match="tls"):
        GlobalConfig.from_document({"head_server": {"host": LOOPBACK, "port": 0, "tls": {"cert": "x"}}})
    with pytest.raises(ConfigError, match="health_port"):
        GlobalConfig.from_document({"head_server": {"host": LOOPBACK, "port": 0, "health_port": 70000}})
    half = GlobalConfig.from_document(
        {"head_server": {"host": LOOPBACK, "port": 0, "tls": {"ca_file": str(pki.ca)}}}
    )
    with pytest.raises(ConfigError, match="cert_file and key_file"):
        ServerSecurity.from_config(half)  # never a silent fall back to plaintext
    missing = tmp_path / "missing.pem"
    with pytest.raises(ConfigError, match=str(missing)):
        client_security({"host": LOOPBACK, "port": 1, "tls": {"ca_file": str(missing)}})
    with pytest.raises(ConfigError, match="both a certificate and a key"):
        client_security({"host": LOOPBACK, "port": 1, "tls": {"client_cert_file": str(pki.client_cert)}})


async def test_unreadable_key_stops_the_head_naming_the_file(tmp_path: Path, pki: Pki) -> None:
    missing = tmp_path / "nope.key"
    doc = document(
        {},
        head_server={
            "host": LOOPBACK,
            "port": 0,
            "tls": {"cert_file": str(pki.server_cert), "key_file": str(missing)},
        },
    )
    head = HeadServer(GlobalConfig.from_document(doc), HeadOptions(port=0))
    with pytest.raises(ConfigError, match=str(missing)):
        await head.start()
    await head.stop()


# --- the CLI, as a user runs it ---


def test_cli_with_tls_and_token_from_the_environment(tmp_path: Path, pki: Pki) -> None:
    doc = secured_doc(closed_port(), auth_token=TOKEN, tls=tls_block(pki, mutual=True))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    with running_cli(["head", "--port", "0", "--config", str(path)]) as head:
        banner = head.wait_for_line(LISTENING_PATTERN, STARTUP_SECONDS).string
        address = LISTENING_PATTERN.search(banner).group(1)  # type: ignore[union-attr]
        assert "mutual TLS, token required" in banner and TOKEN not in banner

        tls_env = {
            TLS_CA_ENV_VAR: str(pki.ca),
            TLS_CERT_ENV_VAR: str(pki.client_cert),
            TLS_KEY_ENV_VAR: str(pki.client_key),
        }
        shown = run_cli(
            ["config", "--json", "--head", address, "--include-secrets"], env={**tls_env, TOKEN_ENV_VAR: TOKEN}
        )
        assert shown.returncode == 0, shown.stderr
        served = json.loads(shown.stdout)
        assert served["policy"]["responses_api_models"]["responses_api_models_impl"]["api_key"] == API_KEY
        assert served["head_server"]["auth_token"] == REDACTED
        assert TOKEN not in shown.stdout + shown.stderr

        refused = run_cli(["status", "--head", address], env={**tls_env, TOKEN_ENV_VAR: "presented-wrong-token"})
        assert refused.returncode == 4 and "UNAUTHENTICATED" in refused.stderr, refused.stderr  # refused: 4
        assert "presented-wrong-token" not in refused.stderr and TOKEN not in refused.stderr + refused.stdout
    assert TOKEN not in head.stderr_text


async def test_tls_server_name_is_the_name_checked_in_the_head_certificate(head_factory, pki) -> None:
    """SECURITY.md: a client's `tls.server_name` is "the name to verify in the head's certificate, when it differs
    from the address": dialled at 127.0.0.1, a name the certificate holds (localhost) passes, another fails."""
    head = await head_factory(document({}, head_server={"host": LOOPBACK, "port": 0, "tls": tls_block(pki)}))

    def named(server_name: str) -> ControlClient:
        tls = {"ca_file": str(pki.ca), "server_name": server_name}
        security = client_security({"host": LOOPBACK, "port": head.port, "tls": tls})
        return ControlClient(head.address, security=security, timeout_seconds=FAST)

    assert (await named("localhost").list_server_statuses()).reports == []
    with pytest.raises(HeadUnreachableError):
        await named("elsewhere.test").list_server_statuses()


SYSTEM_ROOTS_CLIENT = """
import sys
from gym_rpc.client import SyncControlClient, client_security
security = client_security({"host": "127.0.0.1", "port": 1, "tls": {}})
assert security.tls is not None and security.tls.root_certificates is None
print(SyncControlClient(sys.argv[1], security=security, timeout_seconds=5).get_head_server_config().port)
"""


async def test_a_tls_block_without_a_ca_uses_the_system_roots(head_factory, pki) -> None:
    """SECURITY.md: "a tls block turns TLS on (with the system's roots when no CA is given)". The system's roots do
    not know the test CA, so the head is refused; made the system's roots (gRPC's default roots file), it
    passes."""
    head = await head_factory(document({}, head_server={"host": LOOPBACK, "port": 0, "tls": tls_block(pki)}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYM_RPC_")}

    def run(extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", SYSTEM_ROOTS_CLIENT, head.address]
        merged = {**env, **extra}
        return subprocess.run(command, capture_output=True, text=True, timeout=60, env=merged, check=False)

    untrusted = await asyncio.to_thread(run, {})
    assert untrusted.returncode == 1 and "HeadUnreachableError" in untrusted.stderr, untrusted.stderr
    trusted = await asyncio.to_thread(run, {"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(pki.ca)})
    assert (trusted.returncode, trusted.stdout) == (0, f"{head.port}\n"), trusted.stderr
