"""The head's token check and what guards its ports, exactly: the bearer token read, refusals logged by method,
the banner, the health port's bounds, TLS files and head tokens refused with the reason.

Found by mutation testing (`make mutate`, bench/MUTATION.md; these tests were tests/test_exact_behaviour.py):
exact answers no other test pinned down. Each test names the mutant class it kills: a change to the code
that left the rest of the suite green.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_rpc.client import ClientSecurity, ClientTls, ControlClient
from gym_rpc.config import (
    HeadTlsConfig,
)
from gym_rpc.errors import (
    ConfigError,
    ControlPlaneError,
    GymRpcError,
)
from gym_rpc.server.security._auth import (
    ServerSecurity,
    _bearer_token,
    check_tls_files,
    head_token,
)
from gym_rpc.v1 import control_plane_pb2 as pb
from tests.support.documents import document
from tests.support.loopback import LOOPBACK
from tests.support.security import make_pki


def test_client_security_repr_says_whether_a_token_and_tls_are_set() -> None:
    assert repr(ClientSecurity(token="t0ken", tls=ClientTls())) == "ClientSecurity(token=<set>, tls=True)"
    assert repr(ClientSecurity()) == "ClientSecurity(token=None, tls=False)"


@pytest.mark.parametrize(
    ("metadata", "token"),
    [
        ((("authorization", "Bearer t0k"),), "t0k"),
        ((("authorization", b"Bearer t0k"),), "t0k"),  # a bytes value is decoded, not shown as b'...'
        ((("authorization", "  bearer   t0k  "),), "t0k"),
        ((("authorization", "Basic t0k"),), None),
        ((("authorization", b"Bearer t\xffk"),), "t\ufffdk"),  # undecodable bytes are replaced, never raised
        ((("authorization", "Bearer a b"),), "a b"),
        ((("x-other", "Bearer t0k"), ("authorization", "Bearer 2nd")), "2nd"),
        ((), None),
    ],
)
def test_the_bearer_token_is_read_from_the_first_authorization_entry(metadata: object, token: str | None) -> None:
    assert _bearer_token(metadata) == token


async def test_a_refused_call_is_logged_naming_the_method_only(head_factory, caplog) -> None:
    caplog.set_level(logging.INFO, logger="gym_rpc.server._security")
    head = await head_factory(document({}, head_server={"host": LOOPBACK, "port": 0, "auth_token": "s3cret-t0k"}))
    with pytest.raises(ControlPlaneError):
        await ControlClient(head.address, security=ClientSecurity(token="wrong")).list_server_statuses()
    refused = [r.getMessage() for r in caplog.records if r.name == "gym_rpc.server._security"]
    assert refused == [
        "refused /gym_rpc.v1.ControlPlaneService/ListServerStatuses: missing or invalid bearer token"
    ]


@pytest.mark.parametrize(
    ("security", "banner"),
    [
        (ServerSecurity(), "plaintext, no token"),
        (ServerSecurity(token="t"), "plaintext, token required"),
        (ServerSecurity(tls=HeadTlsConfig(cert_file="c", key_file="k")), "TLS, no token"),
        (
            ServerSecurity(tls=HeadTlsConfig(cert_file="c", key_file="k", client_ca_file="ca"), token="t"),
            "mutual TLS, token required",
        ),
    ],
)
def test_the_banner_says_what_guards_the_port(security: ServerSecurity, banner: str) -> None:
    assert security.describe() == banner


async def test_the_health_port_has_the_main_ports_bounds(head_factory) -> None:
    """build_health_server: the plaintext health port has the main port's bounds (4 MiB requests, no sharing)."""
    head = await head_factory(document({}, head_server={"host": LOOPBACK, "port": 0, "health_port": 0}))
    async with grpc.aio.insecure_channel(f"{LOOPBACK}:{head.health_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert (
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        ).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Check(health_pb2.HealthCheckRequest(service="x" * (5 * 1024 * 1024)), timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with socket.socket() as intruder:  # SO_REUSEPORT off, as on the main port: no second process shares it
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        with pytest.raises(OSError, match="Address already in use"):
            intruder.bind((LOOPBACK, head.health_port))


def test_a_server_without_a_config_of_its_own_takes_the_token_of_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GYM_RPC_TOKEN", " s3cret ")
    assert ServerSecurity.from_environment() == ServerSecurity(token="s3cret")
    monkeypatch.setenv("GYM_RPC_TOKEN", "")
    assert ServerSecurity.from_environment() == ServerSecurity(token=None)


def test_tls_files_the_head_cannot_serve_are_named_with_the_reason(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not pem")
    refusals = {
        f"cannot read head_server.tls.cert_file {tmp_path}/gone.pem: No such file or directory": HeadTlsConfig(
            cert_file=str(tmp_path / "gone.pem"), key_file=str(pki.server_key)
        ),
        f"cannot read head_server.tls.key_file {tmp_path}/gone.key: No such file or directory": HeadTlsConfig(
            cert_file=str(pki.server_cert), key_file=str(tmp_path / "gone.key")
        ),
        f"head_server.tls: {pki.server_cert} (cert_file) and {pki.client_key} (key_file) are not a PEM "
        "certificate chain and its unencrypted private key (KEY_VALUES_MISMATCH)": HeadTlsConfig(
            cert_file=str(pki.server_cert), key_file=str(pki.client_key)
        ),
        f"head_server.tls.client_ca_file {not_pem} is not a PEM CA certificate (NO_CERTIFICATE_OR_CRL_FOUND)": (
            HeadTlsConfig(
                cert_file=str(pki.server_cert), key_file=str(pki.server_key), client_ca_file=str(not_pem)
            )
        ),
    }
    for message, tls in refusals.items():
        with pytest.raises(ConfigError) as refused:
            check_tls_files(tls)
        assert str(refused.value) == message


async def test_a_method_nobody_serves_is_unimplemented_behind_the_token_check_too(head_factory) -> None:
    """The token interceptor passes a call no handler serves through untouched (gRPC answers UNIMPLEMENTED)."""
    head = await head_factory(document({}, head_server={"host": LOOPBACK, "port": 0, "auth_token": "s3cret-t0k"}))
    async with grpc.aio.insecure_channel(head.address) as channel:
        missing = channel.unary_unary("/gym_rpc.v1.ControlPlaneService/NoSuchMethod", None, None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await missing(b"", timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_port_in_use_is_named_with_grpcs_reason_and_the_likely_cause() -> None:
    taken = socket.socket()
    taken.bind((LOOPBACK, 0))
    taken.listen()
    port = taken.getsockname()[1]
    server = grpc.aio.server(options=(("grpc.so_reuseport", 0),))
    try:
        with pytest.raises(GymRpcError) as refused:
            ServerSecurity().add_port(server, LOOPBACK, port)
    finally:
        taken.close()
    assert str(refused.value) == (
        f"cannot listen on {LOOPBACK}:{port}: Failed to bind to address {LOOPBACK}:{port}; "
        "set GRPC_VERBOSITY=debug environment variable to see detailed error message.; "
        "is another process using the port?"
    )


_PLACEHOLDER_TOKEN_REFUSAL = (
    "auth_token is a placeholder (such as <redacted>, which `gym-rpc config` prints in place of the token), not a "
    "token; set the real token, or remove the key to run without one"
)


def test_a_blank_head_token_is_refused_with_the_exact_reason() -> None:
    with pytest.raises(ConfigError) as refused:
        head_token("  ", "auth_token")
    assert str(refused.value) == (
        "auth_token is empty, which would run the head without authentication; set a real token, or remove "
        "the key to run without one"
    )


@pytest.mark.parametrize(
    "value",
    ["none", " Changeme ", "TOKEN", "[token]", "{set}", "*****", "()", "<your token here>", "<x", "<redacted>"],
)
def test_a_placeholder_head_token_is_refused_whatever_its_case_and_brackets(value: str) -> None:
    """Every placeholder rule on its own: a word in any case, a word in brackets, only brackets, a leading '<'."""
    with pytest.raises(ConfigError) as refused:
        head_token(value, "auth_token")
    assert str(refused.value) == _PLACEHOLDER_TOKEN_REFUSAL


@pytest.mark.parametrize(
    ("value", "token"),
    [(" XsetX ", "XsetX"), ("t0ken>", "t0ken>"), ("tokens", "tokens"), ("x<none>", "x<none>"), (None, None)],
)
def test_a_real_head_token_is_kept_without_its_outer_spaces(value: str | None, token: str | None) -> None:
    """Only the listed brackets are stripped before the word check; a token that merely contains one is kept."""
    assert head_token(value, "auth_token") == token


async def test_a_client_without_a_token_sends_no_authorization_at_all() -> None:
    """Kills ClientSecurity.metadata mutant 2: with no token (none, or empty) a call carries no `authorization`
    metadata (not a "Bearer None"); with one it carries "Bearer <token>"."""
    seen: list[list[tuple[str, str | bytes]]] = []

    async def list_statuses(
        request: pb.ListServerStatusesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListServerStatusesResponse:
        seen.append([(key, value) for key, value in context.invocation_metadata() or () if key == "authorization"])
        return pb.ListServerStatusesResponse()

    handler = grpc.unary_unary_rpc_method_handler(
        list_statuses,
        request_deserializer=pb.ListServerStatusesRequest.FromString,
        response_serializer=pb.ListServerStatusesResponse.SerializeToString,
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("gym_rpc.v1.ControlPlaneService", {"ListServerStatuses": handler}),)
    )
    port = server.add_insecure_port(f"{LOOPBACK}:0")
    await server.start()
    try:
        for security in (ClientSecurity(), ClientSecurity(token=""), ClientSecurity(token="s3cret-t0k")):
            await ControlClient(f"{LOOPBACK}:{port}", security=security).list_server_statuses()
    finally:
        await server.stop(None)
    assert seen == [[], [], [("authorization", "Bearer s3cret-t0k")]]
