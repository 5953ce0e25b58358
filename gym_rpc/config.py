"""Global config: loading NeMo Gym-shaped documents and the typed view every part of gym_rpc looks things up in.

A document maps server names to `{server_type: {impl_name: {host, port, ...}}}`, beside global keys such as
`head_server`, `checkpoint` and `observability_enabled`. `GlobalConfig` is built once per document (on the head
at load and reload, on the client once per fetch), so no caller walks the document per lookup.
"""

from __future__ import annotations

import hashlib
import importlib
import ipaddress
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from gym_rpc.errors import ConfigError, UnknownServerError

HEAD_SERVER_KEY = "head_server"
DEFAULT_HEAD_HOST = "127.0.0.1"
DEFAULT_HEAD_PORT = 11000
# The shortest probe interval a head accepts: shorter rounds would keep a core busy probing (and every server
# answering) for statuses no caller can tell apart.
MIN_PROBE_INTERVAL_SECONDS = 0.05
REDACTED = "<redacted>"
SECRET_KEY_MARKERS = (
    "api_key",
    "apikey",
    "token",
    "secret",
    "secrets",
    "password",
    "authorization",
    "credential",
    "credentials",
    "private_key",
    "passwd",
    "passphrase",
    "auth",
    "jwt",
    "access_key",
)
_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]", "*"}


class BaseServerConfig(BaseModel):
    """Where a server listens."""

    # Errors never quote the input: a head_server block carries auth_token.
    model_config = ConfigDict(extra="allow", hide_input_in_errors=True)

    host: str
    port: int = Field(ge=0, le=65535)  # 0: a free port (the head's own); wrapping past 65535 would bind another

    def __repr_args__(self) -> Any:
        """repr() and str() show extras such as auth_token redacted (ServerClient's repr nests this model)."""
        for key, value in super().__repr_args__():
            secret = key is not None and is_secret_key(key) and _may_be_secret(value)
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


class HeadServerSettings(BaseModel):
    """The `head_server` block's keys beyond host and port (BaseServerConfig), the one model of them: a bearer
    token, TLS, and the extra ports (plaintext health only, NeMo Gym's HTTP head, the Connect protocol)."""

    model_config = ConfigDict(extra="ignore", frozen=True, hide_input_in_errors=True)

    auth_token: str | None = None
    tls: HeadTlsConfig | None = None
    health_port: int | None = Field(default=None, ge=0, lt=65536)  # 0: a free port
    http_port: StrictInt | None = Field(default=None, ge=0, lt=65536)  # None: no HTTP head; 0: a free port
    connect_port: StrictInt | None = Field(default=None, ge=0, lt=65536)  # None: no Connect port; 0: a free port


def validation_error_line(error: ValidationError, block: str) -> str:
    """One line a person reads for a pydantic error: `block.key: what is wrong` (pydantic's own text spans
    several lines and ends in a documentation URL), plus how many other problems there are."""
    problems = error.errors(include_url=False, include_input=False)
    if not problems:
        return f"{block}: invalid"
    first = problems[0]
    where = ".".join([block, *(str(part) for part in first["loc"])])
    more = (
        f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    )
    return f"{where}: {first['msg']}{more}"


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


def configured_token(value: str | None) -> str | None:
    """A usable token: neither empty nor the placeholder a redacted config carries."""
    if value is None:
        return None
    value = value.strip()
    return value if value and value != REDACTED else None


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

    def __repr_args__(self) -> Any:
        """repr() shows the entry's config redacted: entries land in logs and tracebacks with their API keys."""
        for key, value in super().__repr_args__():
            yield key, redact_secrets(value) if key == "config" else value


def is_wildcard_host(host: str) -> bool:
    """Whether a bind address means "every interface" (0.0.0.0, ::, empty): valid to bind, not to dial."""
    return host.strip() in _WILDCARD_HOSTS


def connectable_host(host: str) -> str:
    """Map a bind address to one a client can dial: wildcards become loopback of the same family."""
    host = host.strip()
    if host in _WILDCARD_HOSTS:
        return "::1" if ":" in host else "127.0.0.1"
    return host


def url_host(host: str) -> str:
    """Bracket IPv6 literals so they can stand in a URL authority."""
    bare = host.strip("[]")
    try:
        if ipaddress.ip_address(bare.split("%", 1)[0]).version == 6:
            return f"[{bare}]"
    except ValueError:
        pass
    return host


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 bracketed) as (host, port); `what` names the setting in the error."""
    try:
        parts = urlsplit(f"//{text.strip()}")
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or port is None:
        raise ConfigError(f"{what} {text!r}: expected HOST:PORT, e.g. 127.0.0.1:11000")
    return host, port


def checked_port(value: int | None, what: str) -> int | None:
    """A port to bind (0: a free one); anything outside 0..65535 is refused rather than wrapped by the OS."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535):
        raise ConfigError(f"{what} must be in 0..65535 (0 picks a free port), not {value!r}")
    return value


def checked_seconds(value: float, what: str, minimum: float = 0.0) -> float:
    """A positive, finite duration (at least `minimum`): 0 would spin a core in a loop that waits it, nan and inf
    never end one."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what} must be a positive number of seconds, not {value!r}")
    if value < minimum:
        raise ConfigError(f"{what} must be at least {minimum:g} seconds, not {value!r}")
    return float(value)


def checked_probe_interval(value: float) -> float:
    """The head's probe interval: positive, finite and no shorter than MIN_PROBE_INTERVAL_SECONDS."""
    return checked_seconds(value, "the probe interval (--probe-interval)", MIN_PROBE_INTERVAL_SECONDS)


def base_url(host: str, port: int) -> str:
    """The http:// base URL of a server bound at host:port."""
    authority = url_host(connectable_host(host))
    if authority.startswith("[") and "%" in authority and "%25" not in authority:
        authority = authority.replace("%", "%25", 1)  # an IPv6 zone id in a URL is written %25 (RFC 6874)
    return f"http://{authority}:{port}"


def is_secret_key(key: str) -> bool:
    """A marker must stand as whole words (`hf_token`, `apiKey`, `DB_PASSWORD`): `max_tokens` or `tokenizer`
    hold ordinary settings that must reach clients unredacted."""
    words = "_".join(re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", key)).lower()
    return any(re.search(rf"(?:^|_){marker}(?:_|$)", words) for marker in SECRET_KEY_MARKERS)


def redact_secrets(value: Any) -> Any:
    """A copy of a JSON-like value with the values of secret-looking keys replaced. Booleans, numbers and nulls
    are no secrets and stay (NeMo Gym's `return_token_id_information: false` must not become a truthy string)."""
    if isinstance(value, Mapping):
        return {
            k: (REDACTED if isinstance(k, str) and is_secret_key(k) and _may_be_secret(v) else redact_secrets(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact_secrets(v) for v in value]
    if isinstance(value, str):
        return redact_secret_text(value)
    return value


# `scheme://USERINFO@host`: greedy up to the last "@" before the path, since passwords may hold an unescaped "@".
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")
# `NAME=value` inside text: `env: ["OPENAI_API_KEY=sk-..."]`, a query string, a `--api-key=...` flag.
_ASSIGNMENT = re.compile(r"(?<![A-Za-z0-9_-])(?P<name>[A-Za-z0-9_-]+)=(?P<value>[^\s&;,]+)")


def redact_secret_text(text: str) -> str:
    """`text` with URL userinfo (`postgres://user:PW@db`) and the values of secret-named `NAME=value` pairs
    replaced: secrets hide inside strings under ordinary keys (a DSN, a command line, an `env:` list)."""
    if "@" in text:
        text = _URL_USERINFO.sub(rf"\g<scheme>{REDACTED}@", text)
    if "=" in text:
        text = _ASSIGNMENT.sub(lambda m: f"{m['name']}={REDACTED}" if is_secret_key(m["name"]) else m[0], text)
    return text


def _may_be_secret(value: Any) -> bool:
    return not (value is None or isinstance(value, bool | int | float))


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
    return ServerEntry(
        name=name,
        server_type=str(server_type),
        impl_name=str(impl_name),
        host=host,
        port=port,
        url=base_url(host, port),
        config=dict(entry),
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
        doc, unresolved = _resolved_leniently(document) if lenient else (_resolved(document), {})
        needed_now = [path for path in unresolved if path.split(".", 1)[0] in _GLOBAL_KEYS_READ_AT_ONCE]
        if needed_now:
            raise ConfigError(f"cannot resolve {needed_now[0]}: {unresolved[needed_now[0]]}")
        head = doc.get(HEAD_SERVER_KEY) or {"host": DEFAULT_HEAD_HOST, "port": DEFAULT_HEAD_PORT}
        if not isinstance(head, Mapping):
            raise ConfigError("head_server must be a mapping with host and port")
        try:
            head_server = BaseServerConfig.model_validate(dict(head))
        except ValidationError as exc:
            raise ConfigError(validation_error_line(exc, HEAD_SERVER_KEY)) from None
        head_settings = head_server_settings(head_server)  # a malformed block fails at load, not at first use
        unusable = _servers_with_unresolved_address(unresolved)
        nodes = {name: node for name, node in doc.items() if name not in unusable}
        servers = {name: entry for name, node in nodes.items() if (entry := _server_entry(name, node)) is not None}
        malformed = {name: reason for name, node in nodes.items() if (reason := _malformed_server(name, node))}
        try:
            config_json = json.dumps(doc, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config is not representable as JSON: {exc}") from exc
        return cls(
            document=doc,
            head_server=head_server,
            head_settings=head_settings,
            servers=servers,
            checkpoint_enabled=_enabled(doc.get("checkpoint", False)),
            observability_enabled=bool(doc.get("observability_enabled", False)),
            config_json=config_json,
            version=hashlib.sha256(config_json.encode()).hexdigest()[:16],
            malformed_servers=malformed,
            unresolved_servers=unusable,
        )

    def with_head_server(self, host: str, port: int) -> GlobalConfig:
        """This config with `head_server` saying where the head really listens (e.g. after binding port 0)."""
        if (host, port) == (self.head_server.host, self.head_server.port):
            return self
        head = self.document.get(HEAD_SERVER_KEY)
        head_block = dict(head) if isinstance(head, Mapping) else {}
        return GlobalConfig.from_document(
            {**self.document, HEAD_SERVER_KEY: {**head_block, "host": host, "port": port}}
        )

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


def _resolved(document: Mapping[str, Any]) -> dict[str, Any]:
    """A plain-dict copy of the document with OmegaConf interpolations (`${...}`) resolved."""
    if not isinstance(document, Mapping):
        raise ConfigError(f"a global config must be a mapping, not {type(document).__name__}")
    try:
        text = json.dumps(document, default=str)
    except (TypeError, ValueError) as exc:  # a self-referencing YAML anchor, a key JSON cannot carry
        raise ConfigError(f"config is not representable as JSON: {exc}") from exc
    except RecursionError:  # a document built in code, nested past Python's recursion limit
        raise ConfigError(f"config nested more than {MAX_CONFIG_DEPTH} levels deep") from None
    if "${" not in text:
        return dict(document)
    from omegaconf import OmegaConf  # only documents with interpolations pay for OmegaConf

    try:
        resolved = OmegaConf.to_container(OmegaConf.create(dict(document)), resolve=True)
    except Exception as exc:  # omegaconf raises many unrelated types
        raise ConfigError(f"cannot resolve config interpolations: {exc}") from exc
    assert isinstance(resolved, dict)
    return {str(k): v for k, v in resolved.items()}


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
_ADDRESS_KEYS = frozenset({"host", "port"})


def _resolved_leniently(document: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Like `_resolved`, but an interpolation that cannot be resolved stays as written: the document, and the
    dotted path of each unresolved value -> the reason. Subtrees that resolve at once are never walked."""
    if not isinstance(document, Mapping):
        raise ConfigError(f"a global config must be a mapping, not {type(document).__name__}")
    try:
        text = json.dumps(document, default=str)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config is not representable as JSON: {exc}") from exc
    if "${" not in text:
        return dict(document), {}
    from omegaconf import DictConfig, ListConfig, OmegaConf

    unresolved: dict[str, str] = {}

    def resolve(node: Any, path: str) -> Any:
        try:
            return OmegaConf.to_container(node, resolve=True)
        except Exception:  # omegaconf raises many unrelated types; walk down to the values that fail
            raw: Any = OmegaConf.to_container(node, resolve=False)
        keys = list(raw) if isinstance(raw, dict) else range(len(raw))
        resolved: dict[Any, Any] = {}
        for key in keys:
            child_path = f"{path}.{key}" if path else str(key)
            try:
                child = node[key]
            except Exception as exc:
                unresolved[child_path] = f"{raw[key]!r} ({str(exc).splitlines()[0]})"
                resolved[key] = raw[key]
                continue
            is_container = isinstance(child, DictConfig | ListConfig)
            resolved[key] = resolve(child, child_path) if is_container else child
        return resolved if isinstance(raw, dict) else [resolved[index] for index in keys]

    try:
        root = OmegaConf.create(dict(document))
    except Exception as exc:
        raise ConfigError(f"cannot read config interpolations: {exc}") from exc
    result = resolve(root, "")
    return {str(k): v for k, v in result.items()}, unresolved


def _servers_with_unresolved_address(unresolved: Mapping[str, str]) -> dict[str, str]:
    """server name -> the first unresolved host or port among `unresolved` (paths `name.type.impl.host|port`)."""
    unusable: dict[str, str] = {}
    for path, reason in unresolved.items():
        parts = path.split(".")
        if len(parts) == 4 and parts[3] in _ADDRESS_KEYS:
            unusable.setdefault(parts[0], f"{path} = {reason}")
    return unusable


# Bounds on a config document, far above any real one (a config of 1,000 servers is ~200 KiB, ~20,000 values,
# nested ~6 deep) and far below what hangs or exhausts the head: YAML aliases let 550 bytes expand to a billion
# values ("billion laughs"), and deep nesting overflows the parser's recursion.
MAX_CONFIG_BYTES = 16 * 1024 * 1024
MAX_CONFIG_DEPTH = 100
MAX_CONFIG_VALUES = 1_000_000  # counted with every alias expanded, as JSON or a DictConfig would expand them


class _BoundedYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with the bounds above checked while composing, and duplicate keys refused (YAML
    silently keeps the last one, so a second `policy_model:` would replace the first without a word)."""

    def __init__(self, text: str, source: str) -> None:
        super().__init__(text)
        self._source = source
        self._open_sizes: list[int] = [0]  # values composed so far under each node being composed
        self._sizes: dict[int, int] = {}  # id(anchored node) -> its expanded size

    def _refuse(self, problem: str, mark: Any) -> ConfigError:
        where = f"{self._source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else self._source
        return ConfigError(f"{where}: {problem}")

    def _count(self, size: int, mark: Any) -> None:
        self._open_sizes[-1] += size
        if sum(self._open_sizes) > MAX_CONFIG_VALUES:
            raise self._refuse(
                f"refusing a config of more than {MAX_CONFIG_VALUES:,} values (with its YAML aliases expanded)",
                mark,
            )

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            anchored = self.anchors.get(event.anchor)
            if anchored is not None:
                size = self._sizes.get(id(anchored))
                if size is None:  # the alias points into the node that is still being composed
                    raise self._refuse(f"the alias *{event.anchor} refers to itself", event.start_mark)
                self._count(size, event.start_mark)
            return super().compose_node(parent, index)  # an unknown anchor: PyYAML's own error
        mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
        if len(self._open_sizes) > MAX_CONFIG_DEPTH:
            raise self._refuse(f"refusing a config nested more than {MAX_CONFIG_DEPTH} levels deep", mark)
        self._open_sizes.append(0)
        try:
            node = super().compose_node(parent, index)
        finally:
            size = 1 + self._open_sizes.pop()
        self._sizes[id(node)] = size
        self._count(size, mark)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise self._refuse(f"duplicate key {key_node.value!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_config_text(text: str, source: str = "<config>") -> dict[str, Any]:
    """Parse YAML (or JSON, a subset) into a document; errors name the source and the line.

    Bounded: a document larger, deeper or (aliases expanded) bigger than the MAX_CONFIG_* limits is refused with
    a ConfigError in time linear in its text, never expanded.
    """
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: refusing a config larger than {MAX_CONFIG_BYTES // (1024 * 1024)} MiB")
    loader = None
    try:
        loader = _BoundedYamlLoader(text, source)  # its reader already refuses control characters
        document = loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        if isinstance(exc, yaml.reader.ReaderError):  # a control character: no mark, a position in the text
            where = f"{source}:{text.count(chr(10), 0, exc.position) + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]  # one line, without PyYAML's "in ..."
        raise ConfigError(f"{where}: invalid YAML: {problem}") from exc
    except RecursionError:  # a small recursion limit set by the embedding program; MAX_CONFIG_DEPTH is the rule
        raise ConfigError(f"{source}: config nested too deeply to parse") from None
    finally:
        if loader is not None:
            loader.dispose()
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(f"{source}: a global config must be a mapping, not {type(document).__name__}")
    return {str(k): v for k, v in document.items()}


def load_config_file(path: str | Path) -> GlobalConfig:
    """Read and validate a YAML config file; every problem is one ConfigError line naming the file."""
    path = Path(path)
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)  # never more: a huge (or endless, /dev/zero) file is refused
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: refusing a config larger than {MAX_CONFIG_BYTES // (1024 * 1024)} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            f"save the file as UTF-8"
        ) from None
    try:
        return GlobalConfig.from_document(parse_config_text(text, str(path)))
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(str(path)) else f"{path}: {message}") from exc


def default_config_text() -> str:
    """The embedded default config, so `gym-rpc head` runs with no file."""
    return resources.files("gym_rpc").joinpath("default_config.yaml").read_text(encoding="utf-8")
