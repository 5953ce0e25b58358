"""The client's side of control-plane security: the bearer token it sends and the TLS it dials with.

Token: an explicit one, else `auth_token` of the head_server block, else GYM_RPC_TOKEN. TLS: from the block's `tls`
or GYM_RPC_TLS_CA (plus GYM_RPC_TLS_CERT / GYM_RPC_TLS_KEY for a client certificate).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gym_rpc._environment import Environment, environment
from gym_rpc.config import (
    HEAD_SERVER_KEY,
    HeadTlsConfig,
    ServerConfigLike,
    configured_token,
    head_server_settings,
    read_file_bytes,
)
from gym_rpc.errors import ConfigError

if TYPE_CHECKING:
    import grpc

from gym_rpc.wire import (
    AUTHORIZATION_METADATA_KEY,
    MAX_REQUEST_BYTES,
    MAX_RESPONSE_BYTES,
    TLS_CA_ENV_VAR,
    TLS_CERT_ENV_VAR,
    TLS_KEY_ENV_VAR,
)

CLIENT_MESSAGE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES),
)


@dataclass(frozen=True)
class ClientTls:
    """What a client channel needs for TLS, read from files once; hashable, so channels can be shared by it."""

    root_certificates: bytes | None = None  # None: the system's roots
    private_key: bytes | None = field(default=None, repr=False)
    certificate_chain: bytes | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        import grpc  # on first use: a worker that never dials the head with TLS never loads it

        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)

    def channel_options(self) -> tuple[tuple[str, str], ...]:
        return (("grpc.ssl_target_name_override", self.server_name),) if self.server_name else ()


@dataclass(frozen=True)
class ClientSecurity:
    """The token a client sends and the TLS it uses (None: plaintext)."""

    token: str | None = None
    tls: ClientTls | None = None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTHORIZATION_METADATA_KEY, f"Bearer {self.token}"),) if self.token else ()

    def __repr__(self) -> str:  # never show the token
        return f"ClientSecurity(token={'<set>' if self.token else None}, tls={self.tls is not None})"


def client_security(head_server: ServerConfigLike | None = None, *, token: str | None = None) -> ClientSecurity:
    """The token and TLS to use towards a head (`head_server`: any shape `server_config_block` accepts, NeMo
    Gym's BaseServerConfig included).

    Token: `token`, else `auth_token` of the head_server block, else GYM_RPC_TOKEN. TLS: on when the block has
    `tls` or GYM_RPC_TLS_CA is set; each file comes from the block, else its environment variable.
    """
    settings = head_server_settings({} if head_server is None else head_server)
    env = environment()
    chosen_token = configured_token(token) or configured_token(settings.auth_token) or configured_token(env.token)
    return ClientSecurity(token=chosen_token, tls=_client_tls(settings.tls, env))


def _client_tls(tls: HeadTlsConfig | None, env: Environment) -> ClientTls | None:
    ca_file = (tls.ca_file if tls else None) or env.tls_ca_file
    if tls is None and ca_file is None:
        return None
    cert_file = (tls.client_cert_file if tls else None) or env.tls_cert_file
    key_file = (tls.client_key_file if tls else None) or env.tls_key_file
    if bool(cert_file) != bool(key_file):
        raise ConfigError(
            f"a client certificate needs both a certificate and a key ({TLS_CERT_ENV_VAR} and {TLS_KEY_ENV_VAR}, "
            f"or {HEAD_SERVER_KEY}.tls.client_cert_file and client_key_file)"
        )
    return ClientTls(
        root_certificates=read_file_bytes(ca_file, f"CA file ({TLS_CA_ENV_VAR})") if ca_file else None,
        private_key=read_file_bytes(key_file, f"client key ({TLS_KEY_ENV_VAR})") if key_file else None,
        certificate_chain=(
            read_file_bytes(cert_file, f"client certificate ({TLS_CERT_ENV_VAR})") if cert_file else None
        ),
        server_name=tls.server_name if tls else None,
    )
