"""The pydantic models of a config: where a server listens, the head_server block, one Gym server entry."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from gym_rpc.config._addresses import InstanceAddress, checked_watch_relay, parse_head_addresses
from gym_rpc.config._redaction import REDACTED, is_secret_key, may_be_secret, redact_secrets
from gym_rpc.config._validators import checked_network_or_host, validation_error_line
from gym_rpc.errors import ConfigError

HEAD_SERVER_KEY = "head_server"
DEFAULT_HEAD_HOST = "127.0.0.1"
DEFAULT_HEAD_PORT = 11000


class BaseServerConfig(BaseModel):
    """Where a server listens."""

    # Errors never quote the input: a head_server block carries auth_token.
    model_config = ConfigDict(extra="allow", hide_input_in_errors=True)

    host: str
    port: int = Field(ge=0, le=65535)  # 0: a free port (the head's own); wrapping past 65535 would bind another

    def __repr_args__(self) -> Any:
        """repr() and str() show extras such as auth_token redacted (ServerClient's repr nests this model)."""
        for key, value in super().__repr_args__():
            secret = key is not None and is_secret_key(key) and may_be_secret(value)
            yield key, REDACTED if secret else redact_secrets(value)


class HeadTlsConfig(BaseModel):
    """`head_server.tls`: the head's certificate (and, for mutual TLS, the CA its clients' certificates come
    from); clients read the CA they trust (and their own certificate) from the same block or the environment."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    cert_file: str | None = None  # head: its certificate chain (PEM)
    key_file: str | None = None  # head: its private key (PEM)
    client_ca_file: str | None = None  # head: require client certificates signed by this CA (mutual TLS)
    ca_file: str | None = None  # clients: the CA that signed the head's certificate (default: system roots)
    client_cert_file: str | None = None  # clients: their certificate chain for mutual TLS
    client_key_file: str | None = None  # clients: their private key for mutual TLS
    server_name: str | None = None  # clients: the name to verify in the head's certificate (default: the host)


class RegistrationSettings(BaseModel):
    """`head_server.registration`: what a registering server may advertise
    (gym_rpc.server.security._address_policy)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # CIDRs ("10.0.0.0/8", "fd00::/8") and hostnames ("gpu7", "*.cluster.local"); empty: any address but the
    # link-local and cloud metadata ones, which are accepted only when listed here.
    allowed_networks: tuple[str, ...] = ()
    # How much may be registered (gym_rpc.server.registry._limits): past a cap, RESOURCE_EXHAUSTED.
    max_instances_per_server: StrictInt = Field(default=128, ge=1)  # registered instances of one server name
    max_instances: StrictInt = Field(default=4096, ge=1)  # registered instances on the head, every name
    max_instances_per_client: StrictInt = Field(default=256, ge=1)  # held from one client address
    registrations_per_second: float = Field(default=20.0, gt=0, allow_inf_nan=False)  # per client; not renewals
    registration_burst: StrictInt = Field(default=200, ge=1)  # registrations one client may make at once

    @field_validator("allowed_networks")
    @classmethod
    def _check_entries(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(checked_network_or_host(entry) for entry in entries)


class HeadServerSettings(BaseModel):
    """The `head_server` block's keys beyond host and port (BaseServerConfig), the one model of them: a bearer
    token, TLS, the extra ports (plaintext health only, NeMo Gym's HTTP head, the Connect protocol), and what
    registrations may advertise."""

    model_config = ConfigDict(extra="ignore", frozen=True, hide_input_in_errors=True)

    auth_token: str | None = None
    tls: HeadTlsConfig | None = None
    health_port: int | None = Field(default=None, ge=0, lt=65536)  # 0: a free port
    http_port: StrictInt | None = Field(default=None, ge=0, lt=65536)  # None: no HTTP head; 0: a free port
    connect_port: StrictInt | None = Field(default=None, ge=0, lt=65536)  # None: no Connect port; 0: a free port
    registration: RegistrationSettings = RegistrationSettings()
    # Every head of the deployment, HOST:PORT each, in the order clients try them (docs/multi-host.md, "Several
    # heads"); empty: the one head at host and port. A head binds its own host and port and reads none of these.
    addresses: tuple[str, ...] = ()
    # A node's watch relay (`gym-rpc relay`), unix:PATH or HOST:PORT on each node, through which clients follow the
    # head's instances (docs/multi-host.md, "A watch relay per node"); GYM_RPC_WATCH_RELAY wins. None: the head.
    watch_relay: str | None = None

    @field_validator("watch_relay", mode="before")
    @classmethod
    def _check_watch_relay(cls, value: Any) -> str | None:
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise ValueError("expected unix:PATH or HOST:PORT, e.g. unix:/run/gym-rpc/relay.sock")
        return checked_watch_relay(value, "")

    @field_validator("addresses", mode="before")
    @classmethod
    def _check_addresses(cls, value: Any) -> tuple[str, ...]:
        if value is None or (not isinstance(value, str) and not value):
            return ()
        if not isinstance(value, str | list | tuple):
            raise ValueError("expected a list of HOST:PORT, e.g. [head-a:11000, head-b:11000]")
        return parse_head_addresses(value, "")


class ServerAddress(Protocol):
    """Any server config with a host and a port: gym_rpc's or NeMo Gym's BaseServerConfig, a dataclass..."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


# What entry points taking a head or server config accept (`as_server_config` turns it into a BaseServerConfig).
ServerConfigLike = ServerAddress | Mapping[str, Any]

# Attributes read from a server config that is neither a mapping nor a pydantic model (a dataclass, a namespace).
_SERVER_CONFIG_ATTRIBUTES = ("host", "port", "num_workers", "auth_token", "tls", "health_port")


def server_config_block(value: ServerConfigLike, what: str = HEAD_SERVER_KEY) -> dict[str, Any]:
    """A server config of any shape as a plain dict: gym_rpc's or another library's pydantic model (NeMo Gym's
    `BaseServerConfig`), an OmegaConf DictConfig, a mapping, or any object with `host` and `port` attributes."""
    if isinstance(value, BaseModel):
        return value.model_dump()
    plain: Any = value
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf  # only callers holding a DictConfig pay for OmegaConf

        plain = OmegaConf.to_container(value, resolve=True)
    if isinstance(plain, Mapping):
        return {str(k): v for k, v in plain.items()}
    if hasattr(value, "host") or hasattr(value, "port"):
        return {name: getattr(value, name) for name in _SERVER_CONFIG_ATTRIBUTES if hasattr(value, name)}
    raise ConfigError(
        f"{what} must be a mapping or an object with host and port (such as a BaseServerConfig), "
        f"not {type(value).__name__}"
    )


def as_server_config(value: ServerConfigLike, what: str = HEAD_SERVER_KEY) -> BaseServerConfig:
    """gym_rpc's BaseServerConfig from a server config of any shape (see `server_config_block`); extra keys such
    as the head's security settings are kept. Raises ConfigError naming a missing or malformed host or port."""
    if type(value) is BaseServerConfig:
        return value
    # Unset optional keys (NeMo Gym's `num_workers: None`) say nothing: two configs of one address compare equal.
    block = {key: item for key, item in server_config_block(value, what).items() if item is not None}
    missing = [key for key in ("host", "port") if key not in block]
    if missing:
        raise ConfigError(f"{what} has no {' and no '.join(missing)}: a server config needs host and port")
    try:
        return BaseServerConfig.model_validate(block)
    except ValidationError as exc:
        raise ConfigError(f"{what}: {exc}") from exc


def head_server_settings(head_server: ServerConfigLike) -> HeadServerSettings:
    """The settings of a head_server block (of any shape `server_config_block` accepts), validated: the one place
    they are parsed (the head, the bridge, and clients reading their token and TLS)."""
    block = server_config_block(head_server)
    try:
        return HeadServerSettings.model_validate(block)
    except ValidationError as exc:
        raise ConfigError(validation_error_line(exc, HEAD_SERVER_KEY)) from None


def read_file_bytes(path: str, what: str) -> bytes:
    """A key, certificate or CA file named by the config or the environment; a ConfigError names `what`."""
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


class ServerEntry(BaseModel):
    """One Gym server of the global config, with the URL clients connect to."""

    model_config = ConfigDict(frozen=True)

    name: str
    server_type: str
    impl_name: str
    host: str
    port: int
    url: str
    config: dict[str, Any]
    # The static replicas the entry lists (its `replicas:` key, gym_rpc.config._replicas), in the listed order.
    replicas: tuple[InstanceAddress, ...] = Field(default=(), repr=False)
    # The header an engine or router takes the rollout's session key in (its `session_affinity_header` key,
    # gym_rpc.config._affinity); None: the key travels in the path (`/ng-rollout/<id>`), as for Gym servers.
    session_affinity_header: str | None = Field(default=None, repr=False)
    # Whether the head reads this engine's /metrics (its `engine_metrics` key), with a session affinity header.
    engine_metrics: bool = Field(default=True, repr=False)
    # The calls in flight to it a client process allows at once (its `max_concurrent_requests` key, NeMo Gym
    # #1208), the rest queued within their deadline; None: no cap.
    max_concurrent_requests: int | None = Field(default=None, repr=False)

    @property
    def instances(self) -> tuple[InstanceAddress, ...]:
        """Every instance the config names: the entry's own address first, then its replicas (the head adds the
        ones that register). Client and head read this one list."""
        return (InstanceAddress(host=self.host, port=self.port, url=self.url), *self.replicas)

    def __repr_args__(self) -> Any:
        """repr() shows the entry's config redacted: entries land in logs and tracebacks with their API keys."""
        for key, value in super().__repr_args__():
            yield key, redact_secrets(value) if key == "config" else value
