"""The head as one `ServerClient` sees it: where it is, with what token and TLS, and what the client asks it (the
config and its version, statuses, the instances it lists), over the blocking control client.

Also where a client's config comes from when it is made: a config a parent injected in NEMO_GYM_CONFIG_DICT, or
the head's. The control client (gRPC) loads on first use: a worker whose config was injected and that never asks
the head never loads it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from gym_rpc._environment import NEMO_GYM_CONFIG_DICT_ENV_VAR, environment
from gym_rpc.client.control._credentials import ClientSecurity, client_security
from gym_rpc.config import (
    DEFAULT_HEAD_HOST,
    DEFAULT_HEAD_PORT,
    HEAD_SERVER_KEY,
    BaseServerConfig,
    GlobalConfig,
    connectable_host,
    parse_config_text,
    parse_head_addresses,
    parse_host_port,
    url_host,
)
from gym_rpc.errors import ConfigError, ControlPlaneError, GymRpcError, HeadTimeoutError, HeadUnreachableError
from gym_rpc.telemetry import TRACING
from gym_rpc.wire import HEAD_ADDRESS_ENV_VAR, ServerStatus

if TYPE_CHECKING:
    from gym_rpc.client.control._clients import SyncControlClient
    from gym_rpc.wire import ServerInstance

# ServerClient's log (gym_rpc.client.server_client), whichever of its parts writes the line.
logger = logging.getLogger("gym_rpc.client.server_client")

# Bound on the one ListServerInstances call a client makes to learn where wildcard-bound servers registered.
ADVERTISED_LOOKUP_TIMEOUT_SECONDS = 2.0
# The least time a direct status probe gets when the head's attempt used up the caller's timeout.
_MIN_DIRECT_PROBE_SECONDS = 0.1

T = TypeVar("T")


class HeadView:
    """One client's head: its config block, and its token and TLS, read once (TLS files included) on first need."""

    __slots__ = ("_security", "config")

    def __init__(self, config: BaseServerConfig) -> None:
        self.config = config
        self._security: ClientSecurity | None = None

    @property
    def address(self) -> str:
        return head_address(self.config)

    @property
    def security(self) -> ClientSecurity:
        if self._security is None:
            self._security = client_security(self.config)
        return self._security

    def control(self, timeout_seconds: float | None = None) -> SyncControlClient:
        return control_client(self.address, security=self.security, timeout_seconds=timeout_seconds)

    def fetch_config(self, build: Callable[[GlobalConfig], T]) -> T:
        """`build` of the head's config (the secrets included when this client may have them). When `build` turns
        tracing on (it decides it with the config's observability_enabled), the fetch is recorded as a span too."""
        control = self.control()
        traced_already = TRACING.enabled  # the channel is traced from the start when the environment says so
        started_ns = time.time_ns()
        config = control.get_global_config(include_secrets=asks_for_secrets(control))
        ended_ns = time.time_ns()
        built = build(config)
        if TRACING.enabled and not traced_already:
            from gym_rpc.client.tracing import record_config_fetch_span  # tracing on only

            record_config_fetch_span(control.address, started_ns, ended_ns)
        return built

    def config_if_changed(self, version: str) -> GlobalConfig | None:
        """The head's config when its version differs from `version`; None (nothing sent) when unchanged."""
        control = self.control()
        return control.get_global_config_if_changed(version, include_secrets=asks_for_secrets(control))

    def poll_for_status(
        self, server_name: str, timeout_seconds: float, direct_url: Callable[[str], str]
    ) -> ServerStatus:
        """`ServerClient.poll_for_status`: the head's answer, else the server probed directly at `direct_url(name)`
        (a NeMo Gym HTTP head keeps no statuses: there every poll is one direct probe)."""
        deadline = time.monotonic() + timeout_seconds
        control = self.control(timeout_seconds)
        if server_name == HEAD_SERVER_KEY:
            return control.head_status()
        if not control.head().keeps_statuses:  # NeMo Gym's HTTP head: a poll is one direct probe
            return _probe_directly(direct_url(server_name), deadline)
        try:
            report = control.get_server_status(server_name)
        except HeadTimeoutError:  # the head is there but answered too late: as NeMo Gym's client says then
            return "timeout"
        except HeadUnreachableError as exc:
            logger.warning(
                "status of %s: the head at %s is unreachable (%s); skipped it and probed the server directly",
                server_name,
                exc.address,
                exc.code,
            )
            return _probe_directly(direct_url(server_name), deadline)
        except ControlPlaneError as exc:
            logger.warning("status of %s: %s", server_name, exc)
            return "unknown_error"
        return report.status or "unknown_error"

    def list_instances(self) -> list[ServerInstance]:
        """Every instance the head lists (ListServerInstances, bounded); none when the head cannot say."""
        address = self.address
        try:
            return self.control(ADVERTISED_LOOKUP_TIMEOUT_SECONDS).list_server_instances()
        except GymRpcError as exc:
            logger.warning(
                "cannot ask the head at %s where wildcard-bound servers registered (%s); dialling them on "
                "loopback",
                address,
                exc,
            )
            return []


def _probe_directly(url: str, deadline: float) -> ServerStatus:
    """GET the server's base URL: any HTTP answer is "success", refused "connection_error", none in time
    "timeout", anything else "unknown_error" (NeMo Gym's rule)."""
    from gym_rpc.client.nemo_gym import probe  # http.client (and ssl) load with the first direct probe

    return probe(url, max(deadline - time.monotonic(), _MIN_DIRECT_PROBE_SECONDS)).status


def head_address(head_server_config: BaseServerConfig) -> str:
    """Where the client reaches the head: host and port, or every head the block's `addresses` lists, as
    `a:11000,b:11000` (the control clients fail over among them)."""
    addresses = (head_server_config.model_extra or {}).get("addresses")
    if addresses:
        return ",".join(parse_head_addresses(addresses, f"{HEAD_SERVER_KEY}.addresses"))
    return f"{url_host(connectable_host(head_server_config.host))}:{head_server_config.port}"


def control_client(
    address: str, *, security: ClientSecurity, timeout_seconds: float | None = None
) -> SyncControlClient:
    """A control client to the head, gRPC imported on first use: a worker whose config was injected
    (`NEMO_GYM_CONFIG_DICT`) and never asks the head never loads it, nor pays for it at import."""
    from gym_rpc.client.control._clients import SyncControlClient

    if timeout_seconds is None:
        return SyncControlClient(address, security=security)
    return SyncControlClient(address, timeout_seconds=timeout_seconds, security=security)


def asks_for_secrets(control: SyncControlClient) -> bool:
    """A worker needs its servers' API keys: a gym_rpc head gives them to a caller with its token; NeMo Gym's HTTP
    head gives everyone the whole config, as NeMo Gym's own client gets it."""
    return control.security.token is not None or not control.head().guards_secrets


def injected_config() -> GlobalConfig | None:
    """The config a parent injected in NEMO_GYM_CONFIG_DICT (YAML or JSON text), or None when not set.

    Interpolations nothing reads stay unresolved (GlobalConfig.from_document, lenient), as in NeMo Gym."""
    text = environment().nemo_gym_config_dict
    if not text:
        return None
    document: Any = None
    if text.lstrip().startswith("{"):
        try:
            document = json.loads(text)  # far faster than YAML for the large documents launchers inject
        except ValueError:
            document = None  # maybe YAML flow style: the YAML parser below reports real errors
    if document is None:
        document = parse_config_text(text, NEMO_GYM_CONFIG_DICT_ENV_VAR)
    return GlobalConfig.from_document(document, lenient=True)


def injected_head_server(injected: GlobalConfig) -> BaseServerConfig:
    """The injected config's head_server: a config injected without one is an error, never a silent default."""
    if HEAD_SERVER_KEY not in injected.document:
        raise ConfigError(
            f"the config injected in {NEMO_GYM_CONFIG_DICT_ENV_VAR} has no {HEAD_SERVER_KEY} "
            f"(host and port of the head): add it, or pass head_server_config"
        )
    return injected.head_server


def configured_head_server() -> BaseServerConfig:
    """The injected config's head_server, else GYM_RPC_HEAD (HOST:PORT), else 127.0.0.1:11000."""
    injected = injected_config()
    if injected is not None:
        return injected_head_server(injected)
    address = environment().head_address
    if address:
        return _head_server_from_address(address)
    return BaseServerConfig(host=DEFAULT_HEAD_HOST, port=DEFAULT_HEAD_PORT)


def _head_server_from_address(address: str) -> BaseServerConfig:
    """HOST:PORT (IPv6 bracketed) as a head server config; several (`a:11000,b:11000`) as the first one's, with
    every one in `addresses` (docs/multi-host.md, "Several heads")."""
    if "," in address:
        addresses = parse_head_addresses(address, HEAD_ADDRESS_ENV_VAR)
        host, port = parse_host_port(addresses[0], HEAD_ADDRESS_ENV_VAR)
        return BaseServerConfig.model_validate({"host": host, "port": port, "addresses": list(addresses)})
    host, port = parse_host_port(address, HEAD_ADDRESS_ENV_VAR)
    return BaseServerConfig(host=host, port=port)
