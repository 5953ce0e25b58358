"""The typed, read-only view of one global-config document (`GlobalConfig`), and loading it from a file.

A document maps server names to `{server_type: {impl_name: {host, port, ...}}}`, beside global keys such as
`head_server`, `checkpoint` and `observability_enabled`. `GlobalConfig` is built once per document (on the head
at load and reload, on the client once per fetch), so no caller walks the document per lookup.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gym_rpc.config._addresses import InstanceAddress, base_url
from gym_rpc.config._affinity import (
    ENGINE_METRICS_KEY,
    SESSION_AFFINITY_HEADER_KEY,
    engine_metrics,
    session_affinity_header,
)
from gym_rpc.config._models import (
    DEFAULT_HEAD_HOST,
    DEFAULT_HEAD_PORT,
    HEAD_SERVER_KEY,
    BaseServerConfig,
    HeadServerSettings,
    ServerEntry,
    head_server_settings,
)
from gym_rpc.config._parsing import MAX_CONFIG_BYTES, parse_config_document, resolved, resolved_leniently
from gym_rpc.config._redaction import redact_secrets
from gym_rpc.config._replicas import REPLICAS_KEY, replica_addresses
from gym_rpc.config._validators import MAX_CONCURRENT_REQUESTS_KEY, checked_concurrency_cap, validation_error_line
from gym_rpc.errors import ConfigError, UnknownServerError


def get_first_server_config_dict(document: Mapping[str, Any], server_name: str) -> Mapping[str, Any]:
    """The entry two levels under `server_name` (`{server_type: {impl_name: entry}}` -> entry)."""
    node = document.get(server_name)
    if node is None:
        raise UnknownServerError(server_name, [k for k, v in document.items() if _server_entry(k, v)])
    for _ in range(2):
        if not isinstance(node, Mapping) or not node:
            raise ConfigError(
                f"config entry {server_name!r} is not of the form {{server_type: {{impl: {{...}}}}}}"
            )
        node = next(iter(node.values()))
    if not isinstance(node, Mapping):
        raise ConfigError(f"config entry {server_name!r} is not of the form {{server_type: {{impl: {{...}}}}}}")
    return node


def _server_entry(name: str, node: Any) -> ServerEntry | None:
    """The ServerEntry a top-level key describes, or None when it is not a server (a global key)."""
    if name == HEAD_SERVER_KEY or not isinstance(node, Mapping) or len(node) != 1:
        return None
    server_type, impls = next(iter(node.items()))
    if not isinstance(impls, Mapping) or len(impls) != 1:
        return None
    impl_name, entry = next(iter(impls.items()))
    if not isinstance(entry, Mapping) or "host" not in entry or "port" not in entry:
        return None
    host, port = entry["host"], entry["port"]
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"server {name!r}: host must be a string and port an integer in 1..65535")
    url = base_url(host, port)
    return ServerEntry(
        name=name,
        server_type=str(server_type),
        impl_name=str(impl_name),
        host=host,
        port=port,
        url=url,
        config=dict(entry),
        replicas=replica_addresses(name, InstanceAddress(host, port, url), entry.get(REPLICAS_KEY)),
        session_affinity_header=session_affinity_header(name, entry.get(SESSION_AFFINITY_HEADER_KEY)),
        engine_metrics=engine_metrics(name, entry.get(ENGINE_METRICS_KEY)),
        max_concurrent_requests=checked_concurrency_cap(name, entry.get(MAX_CONCURRENT_REQUESTS_KEY)),
    )


def _malformed_server(name: str, node: Any) -> str | None:
    """Why a top-level key that looks like a server entry (`{type: {impl: {...}}}`) is not one, or None.

    Such a key is no server and no global setting: a typo (a missing host, a second impl) that would otherwise
    make the server vanish without a word.
    """
    if name == HEAD_SERVER_KEY or not isinstance(node, Mapping) or _server_entry(name, node) is not None:
        return None
    typed = {str(t): impls for t, impls in node.items() if _looks_like_impls(impls)}
    if not typed:
        return None
    if len(node) > 1:
        return f"it has {len(node)} server types ({', '.join(map(str, node))}); one server name holds one type"
    server_type, impls = next(iter(typed.items()))
    if len(impls) > 1:
        return (
            f"{server_type} has {len(impls)} implementations ({', '.join(map(str, impls))}); "
            f"one server name holds one"
        )
    impl_name, entry = next(iter(impls.items()))
    missing = [key for key in ("host", "port") if key not in entry]
    return f"{server_type}.{impl_name} has no {' and no '.join(missing)}"


def _looks_like_impls(value: Any) -> bool:
    """`{impl_name: {...}}` with at least one mapping entry: the shape under a server type."""
    return isinstance(value, Mapping) and bool(value) and any(isinstance(v, Mapping) for v in value.values())


def _enabled(value: Any) -> bool:
    """`checkpoint: {enabled: true}` or a bare boolean."""
    if isinstance(value, Mapping):
        return bool(value.get("enabled", False))
    return bool(value)


@dataclass(frozen=True)
class GlobalConfig:
    """The typed, read-only view of one global-config document."""

    document: dict[str, Any] = field(repr=False)  # holds secrets (API keys, the head's token)
    head_server: BaseServerConfig = field(repr=False)
    head_settings: HeadServerSettings = field(repr=False)  # the head_server block's other keys, parsed
    servers: dict[str, ServerEntry] = field(repr=False)
    checkpoint_enabled: bool
    observability_enabled: bool
    config_json: str = field(repr=False)
    version: str
    # Top-level keys shaped like a server entry but not one (name -> why): warned about at start, and a reload
    # that would turn a served server into one is refused.
    malformed_servers: dict[str, str] = field(default_factory=dict, repr=False)
    # Servers left out of `servers` because their host or port is an interpolation that could not be resolved
    # (lenient documents only): name -> what could not be resolved, for the error raised when one is called.
    unresolved_servers: dict[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_document(cls, document: Mapping[str, Any], *, lenient: bool = False) -> GlobalConfig:
        """The typed view of a document, its `${...}` interpolations resolved.

        `lenient` (clients building from a config they were handed): an interpolation that cannot be resolved is
        kept as written, and fails only when something needs it, as with NeMo Gym's DictConfig: a server whose host
        or port cannot be resolved raises ConfigError when it is called, a global key the client reads at once
        (`head_server`, `observability_enabled`, `checkpoint`, the pool settings) raises here. Otherwise (the head
        loading its file) any unresolvable interpolation is an error.
        """
        doc, unresolved = resolved_leniently(document) if lenient else (resolved(document), {})
        needed_now = [path for path in unresolved if path.split(".", 1)[0] in _GLOBAL_KEYS_READ_AT_ONCE]
        if needed_now:
            raise ConfigError(f"cannot resolve {needed_now[0]}: {unresolved[needed_now[0]]}")
        try:
            config_json = json.dumps(doc, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config is not representable as JSON: {exc}") from exc
        return cls._of_resolved(doc, config_json, _servers_with_unresolved_address(unresolved))

    @classmethod
    def from_served_json(cls, config_json: str, version: str = "") -> GlobalConfig:
        """The typed view of the document a head serves (GetGlobalConfig's `config_json`, its `version`).

        The head resolved and checked it when it loaded it, so it is neither resolved again (a `${` still in it is
        text the head's document holds, such as an escaped `\\${...}`: resolving it again would fail the client)
        nor serialised again (the text is the document's JSON as `from_document` writes it). The version is the
        head's: one computed here from a redacted document would miss secret changes."""
        try:
            document = json.loads(config_json)
        except ValueError as exc:
            raise ConfigError(f"the head's config is not JSON: {exc}") from exc
        if not isinstance(document, dict):
            raise ConfigError(f"the head's config must be a mapping, not {type(document).__name__}")
        return cls._of_resolved(document, config_json, {}, version)

    @classmethod
    def _of_resolved(
        cls, doc: dict[str, Any], config_json: str, unusable: dict[str, str], version: str = ""
    ) -> GlobalConfig:
        """The typed view of a resolved document whose JSON is `config_json`; `unusable`: servers whose address
        could not be resolved (left out of `servers`)."""
        head = doc.get(HEAD_SERVER_KEY) or {"host": DEFAULT_HEAD_HOST, "port": DEFAULT_HEAD_PORT}
        if not isinstance(head, Mapping):
            raise ConfigError("head_server must be a mapping with host and port")
        try:
            head_server = BaseServerConfig.model_validate(dict(head))
        except ValidationError as exc:
            raise ConfigError(validation_error_line(exc, HEAD_SERVER_KEY)) from None
        head_settings = head_server_settings(head_server)  # a malformed block fails at load, not at first use
        nodes = {name: node for name, node in doc.items() if name not in unusable}
        servers = {name: entry for name, node in nodes.items() if (entry := _server_entry(name, node)) is not None}
        malformed = {
            name: reason
            for name, node in nodes.items()
            if name not in servers and (reason := _malformed_server(name, node))
        }
        return cls(
            document=doc,
            head_server=head_server,
            head_settings=head_settings,
            servers=servers,
            checkpoint_enabled=_enabled(doc.get("checkpoint", False)),
            observability_enabled=bool(doc.get("observability_enabled", False)),
            config_json=config_json,
            version=version or hashlib.sha256(config_json.encode()).hexdigest()[:16],
            malformed_servers=malformed,
            unresolved_servers=unusable,
        )

    def with_head_server(self, host: str, port: int) -> GlobalConfig:
        """This config with `head_server` saying where the head really listens (e.g. after binding port 0). Its
        document is resolved already: resolving it again would turn an escaped interpolation's text into one."""
        if (host, port) == (self.head_server.host, self.head_server.port):
            return self
        head = self.document.get(HEAD_SERVER_KEY)
        head_block = dict(head) if isinstance(head, Mapping) else {}
        doc = {**self.document, HEAD_SERVER_KEY: {**head_block, "host": host, "port": port}}
        return GlobalConfig._of_resolved(doc, json.dumps(doc, ensure_ascii=False), self.unresolved_servers)

    @cached_property
    def redacted_json(self) -> str:
        """config_json with the values of secret-looking keys replaced."""
        return json.dumps(redact_secrets(self.document), ensure_ascii=False)

    def server(self, name: str) -> ServerEntry:
        try:
            return self.servers[name]
        except KeyError:
            self.raise_unusable(name)
            raise UnknownServerError(name, [*self.servers, HEAD_SERVER_KEY]) from None

    def raise_unusable(self, name: str) -> None:
        """Raise ConfigError when `name` is a server whose address could not be resolved."""
        reason = self.unresolved_servers.get(name)
        if reason is not None:
            raise ConfigError(f"server {name!r} cannot be called: cannot resolve {reason}")

    def assistant_message_header(self, model_server_name: str) -> bytes | None:
        """The header declared by the harnesses whose `model_server` is this server; None when none declares one.

        Read from `assistant_message_header` in a harness's entry or the `ASSISTANT_MESSAGE_HEADER` attribute of
        its light `harness_package` module, so model workers never import an agent's app.
        """
        found: dict[str, bytes] = {}
        for entry in self.servers.values():
            model_server = entry.config.get("model_server")
            if not isinstance(model_server, Mapping) or model_server.get("name") != model_server_name:
                continue
            header = _declared_header(entry)
            if header is not None:
                found[entry.name] = header
        if len(set(found.values())) > 1:
            raise ConfigError(
                f"harnesses using model server {model_server_name!r} declare different assistant message "
                f"headers: {', '.join(sorted(found))}"
            )
        return next(iter(found.values()), None)


def _declared_header(entry: ServerEntry) -> bytes | None:
    value = entry.config.get("assistant_message_header")
    if value is None and (package := entry.config.get("harness_package")):
        try:
            module = importlib.import_module(str(package))
        except Exception as exc:  # a broken package raises anything at import (SyntaxError, RuntimeError, ...)
            raise ConfigError(
                f"server {entry.name!r}: cannot import harness_package {package!r}: {type(exc).__name__}: {exc}"
            ) from exc
        value = getattr(module, "ASSISTANT_MESSAGE_HEADER", None)
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise ConfigError(f"server {entry.name!r}: assistant_message_header must be text or bytes")


# Global keys a client reads when it is built: an unresolvable interpolation there fails at once even when lenient.
_GLOBAL_KEYS_READ_AT_ONCE = frozenset(
    {
        HEAD_SERVER_KEY,
        "observability_enabled",
        "checkpoint",
        "http_client",
        "global_aiohttp_connector_limit",
        "global_aiohttp_connector_limit_per_host",
    }
)
# An entry's keys that say how it is called: one that cannot be resolved makes the server unusable, not the config.
_ROUTING_KEYS = frozenset({"host", "port", SESSION_AFFINITY_HEADER_KEY, ENGINE_METRICS_KEY})


def _servers_with_unresolved_address(unresolved: Mapping[str, str]) -> dict[str, str]:
    """server name -> the first unresolved address among `unresolved`: a host, port or session affinity header
    (`name.type.impl.host`), or anything in its replicas (`name.type.impl.replicas.0.host`)."""
    unusable: dict[str, str] = {}
    for path, reason in unresolved.items():
        parts = path.split(".")
        if (len(parts) == 4 and parts[3] in _ROUTING_KEYS) or (len(parts) >= 4 and parts[3] == REPLICAS_KEY):
            unusable.setdefault(parts[0], f"{path} = {reason}")
    return unusable


def load_config_file(path: str | Path) -> GlobalConfig:
    """Read and validate a YAML config file; every problem is one ConfigError line naming the file."""
    return config_from_bytes(read_config_file(path), path)


def read_config_file(path: str | Path) -> bytes:
    """The bytes of a config file, at most MAX_CONFIG_BYTES (a huge, or endless /dev/zero, file is refused)."""
    path = Path(path)
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: refusing a config larger than {MAX_CONFIG_BYTES // (1024 * 1024)} MiB")
    return data


def config_from_bytes(data: bytes, path: str | Path) -> GlobalConfig:
    """The config in the bytes of the file at `path` (which every error names). An empty file, or one of only
    whitespace, comments or a null (`~`), is no config: serving it would silently drop every server."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            f"save the file as UTF-8"
        ) from None
    try:
        document = parse_config_document(text, str(path))
        if document is None:
            raise ConfigError(
                f"{path}: the file holds no config (it is empty, or only whitespace, comments or a null); a "
                f"config is a mapping such as `head_server: {{host: 127.0.0.1, port: 11000}}`"
            )
        return GlobalConfig.from_document(document)
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(str(path)) else f"{path}: {message}") from exc


def default_config_text() -> str:
    """The embedded default config, so `gym-rpc head` runs with no file."""
    return resources.files("gym_rpc").joinpath("default_config.yaml").read_text(encoding="utf-8")
