"""A test PKI (a CA, server and client certificates it signed, an unrelated CA), TLS config blocks and TLS clients,
and the secrets the security tests look for in output."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gym_rpc.client.control._credentials import ClientSecurity, client_security
from tests.support.loopback import LOOPBACK

API_KEY = "sk-live-never-leaked"


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # trusts nothing above


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return path


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer or (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        names: list[x509.GeneralName] = [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
        ]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    elif not ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def make_pki(folder: Path) -> Pki:
    """A CA, a server and a client certificate it signed, and an unrelated CA, written to `folder`."""
    ca_key, other_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_cert = _certificate("gym-rpc test CA", ca_key, None, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    issuer = (ca_cert.subject, ca_key)
    return Pki(
        ca=_write_cert(folder / "ca.pem", ca_cert),
        server_cert=_write_cert(folder / "server.pem", _certificate("head", server_key, issuer, server=True)),
        server_key=_write_key(folder / "server.key", server_key),
        client_cert=_write_cert(folder / "client.pem", _certificate("worker", client_key, issuer)),
        client_key=_write_key(folder / "client.key", client_key),
        other_ca=_write_cert(folder / "other.pem", _certificate("unrelated CA", other_key, None, ca=True)),
    )


def tls_block(pki: Pki, *, mutual: bool = False) -> dict[str, str]:
    block = {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)}
    return {**block, "client_ca_file": str(pki.ca)} if mutual else block


def tls_client(
    pki: Pki, ca: Path | None = None, *, cert: bool = False, token: str | None = None
) -> ClientSecurity:
    tls: dict[str, str] = {"ca_file": str(ca or pki.ca)}
    if cert:
        tls.update(client_cert_file=str(pki.client_cert), client_key_file=str(pki.client_key))
    block: dict[str, Any] = {"host": LOOPBACK, "port": 1, "tls": tls}
    return client_security(block, token=token)
