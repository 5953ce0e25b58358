"""Global config: NeMo Gym-shaped documents, loaded and checked, and the typed view every part of gym_rpc looks
things up in. One module per job, each importing only those listed after it:

* `_global`: `GlobalConfig`, the read-only view of one document, and loading it from a file;
* `_models`: the pydantic models (where a server listens, the `head_server` block, one server entry);
* `_replicas`: the static replicas an entry lists (its `replicas:` key);
* `_affinity`: the header an engine or router takes a rollout's session key in (its `session_affinity_header:`);
* `_parsing`: the bounds on config text and OmegaConf interpolations, resolved strictly or tolerantly;
* `_yaml`: the bounded YAML loader (PyYAML imported with the first text parsed);
* `_validators`: checks of typed values whose one-line messages name the flag or key;
* `_redaction`: which keys look secret, and redacted copies of documents and text;
* `_addresses`: wildcard bind hosts, what a client dials instead, base URLs.
"""

from gym_rpc.config._addresses import (
    InstanceAddress,
    base_url,
    checked_watch_relay,
    connectable_host,
    is_wildcard_host,
    parse_head_addresses,
    parse_host_port,
    url_authority,
    url_host,
)
from gym_rpc.config._affinity import DEFAULT_SESSION_AFFINITY_HEADER, SESSION_AFFINITY_HEADER_KEY
from gym_rpc.config._global import (
    GlobalConfig,
    config_from_bytes,
    default_config_text,
    get_first_server_config_dict,
    load_config_file,
    read_config_file,
)
from gym_rpc.config._models import (
    DEFAULT_HEAD_HOST,
    DEFAULT_HEAD_PORT,
    HEAD_SERVER_KEY,
    BaseServerConfig,
    HeadServerSettings,
    HeadTlsConfig,
    RegistrationSettings,
    ServerAddress,
    ServerConfigLike,
    ServerEntry,
    as_server_config,
    head_server_settings,
    read_file_bytes,
    server_config_block,
)
from gym_rpc.config._parsing import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_CONFIG_VALUES, parse_config_text
from gym_rpc.config._redaction import (
    REDACTED,
    SECRET_KEY_MARKERS,
    configured_token,
    is_secret_key,
    redact_secret_text,
    redact_secrets,
)
from gym_rpc.config._replicas import REPLICAS_KEY
from gym_rpc.config._validators import (
    MIN_PROBE_INTERVAL_SECONDS,
    checked_port,
    checked_probe_interval,
    checked_seconds,
    validation_error_line,
)

__all__ = [
    "DEFAULT_HEAD_HOST",
    "DEFAULT_HEAD_PORT",
    "DEFAULT_SESSION_AFFINITY_HEADER",
    "HEAD_SERVER_KEY",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_VALUES",
    "MIN_PROBE_INTERVAL_SECONDS",
    "REDACTED",
    "REPLICAS_KEY",
    "SECRET_KEY_MARKERS",
    "SESSION_AFFINITY_HEADER_KEY",
    "BaseServerConfig",
    "GlobalConfig",
    "HeadServerSettings",
    "HeadTlsConfig",
    "InstanceAddress",
    "RegistrationSettings",
    "ServerAddress",
    "ServerConfigLike",
    "ServerEntry",
    "as_server_config",
    "base_url",
    "checked_port",
    "checked_probe_interval",
    "checked_seconds",
    "checked_watch_relay",
    "config_from_bytes",
    "configured_token",
    "connectable_host",
    "default_config_text",
    "get_first_server_config_dict",
    "head_server_settings",
    "is_secret_key",
    "is_wildcard_host",
    "load_config_file",
    "parse_config_text",
    "parse_head_addresses",
    "parse_host_port",
    "read_config_file",
    "read_file_bytes",
    "redact_secret_text",
    "redact_secrets",
    "server_config_block",
    "url_authority",
    "url_host",
    "validation_error_line",
]
