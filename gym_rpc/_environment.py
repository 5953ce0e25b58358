"""Every environment variable gym_rpc reads, read by one settings object.

Nothing else in gym_rpc reads `os.environ`: the library (head address, token, TLS, NeMo Gym's injected
config), the CLI's flag defaults and OpenTelemetry's standard variables all come from `environment()`. The
"Environment variables" table of docs/cli.md lists the same names (tests/cli/test_environment.py keeps them in
step).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

# The library's own.
HEAD_ADDRESS_ENV_VAR = "GYM_RPC_HEAD"
TOKEN_ENV_VAR = "GYM_RPC_TOKEN"
TLS_CA_ENV_VAR = "GYM_RPC_TLS_CA"
TLS_CERT_ENV_VAR = "GYM_RPC_TLS_CERT"
TLS_KEY_ENV_VAR = "GYM_RPC_TLS_KEY"
# A node's watch relay (`gym-rpc relay`): workers follow the head's instances through it (docs/multi-host.md).
WATCH_RELAY_ENV_VAR = "GYM_RPC_WATCH_RELAY"
# What a NeMo Gym launcher sets for the processes it starts.
NEMO_GYM_CONFIG_DICT_ENV_VAR = "NEMO_GYM_CONFIG_DICT"
NEMO_GYM_MODEL_SERVER_BASE_URL_ENV_VAR = "NEMO_GYM_MODEL_SERVER_BASE_URL"
NEMO_GYM_MODEL_SERVER_NAME_ENV_VAR = "NEMO_GYM_MODEL_SERVER_NAME"
# NeMo Gym's telemetry switches (gym_rpc._telemetry_switches): NEMO_GYM_OTEL_<KEY>, else NEMO_LENS_<KEY>.
NEMO_GYM_TELEMETRY_KEYS = ("ENABLED", "TRACES_ENABLED", "METRICS_ENABLED", "EXPORTER")
NEMO_GYM_TELEMETRY_PREFIXES = ("NEMO_GYM_OTEL", "NEMO_LENS")
# The CLI's flag defaults (gym_rpc.cli._flags.env_flag parses them, naming a bad one).
TIMEOUT_ENV_VAR = "GYM_RPC_TIMEOUT"
OUTPUT_ENV_VAR = "GYM_RPC_OUTPUT"
LOG_LEVEL_ENV_VAR = "GYM_RPC_LOG_LEVEL"
LOG_FORMAT_ENV_VAR = "GYM_RPC_LOG_FORMAT"
CONFIG_ENV_VAR = "GYM_RPC_CONFIG"
PROBE_INTERVAL_ENV_VAR = "GYM_RPC_PROBE_INTERVAL"
PROBE_TIMEOUT_ENV_VAR = "GYM_RPC_PROBE_TIMEOUT"
HTTP_PORT_ENV_VAR = "GYM_RPC_HTTP_PORT"
METRICS_PORT_ENV_VAR = "GYM_RPC_METRICS_PORT"
CONNECT_PORT_ENV_VAR = "GYM_RPC_CONNECT_PORT"
WAIT_TIMEOUT_ENV_VAR = "GYM_RPC_WAIT_TIMEOUT"
# OpenTelemetry's standard variables that decide whether and where gym_rpc traces and measures.
SDK_DISABLED_ENV_VAR = "OTEL_SDK_DISABLED"
SERVICE_NAME_ENV_VAR = "OTEL_SERVICE_NAME"
RESOURCE_ATTRIBUTES_ENV_VAR = "OTEL_RESOURCE_ATTRIBUTES"
TRACES_EXPORTER_ENV_VAR = "OTEL_TRACES_EXPORTER"
METRICS_EXPORTER_ENV_VAR = "OTEL_METRICS_EXPORTER"
EXEMPLAR_FILTER_ENV_VAR = "OTEL_METRICS_EXEMPLAR_FILTER"
OTLP_ENDPOINT_ENV_VAR = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTLP_PROTOCOL_ENV_VAR = "OTEL_EXPORTER_OTLP_PROTOCOL"
OTLP_TRACES_ENDPOINT_ENV_VAR = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
OTLP_TRACES_PROTOCOL_ENV_VAR = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
OTLP_METRICS_ENDPOINT_ENV_VAR = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
OTLP_METRICS_PROTOCOL_ENV_VAR = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"
# Per signal, the signal's own variable first: OpenTelemetry's order of precedence.
OTLP_TRACES_ENDPOINT_ENV_VARS = (OTLP_TRACES_ENDPOINT_ENV_VAR, OTLP_ENDPOINT_ENV_VAR)
OTLP_TRACES_PROTOCOL_ENV_VARS = (OTLP_TRACES_PROTOCOL_ENV_VAR, OTLP_PROTOCOL_ENV_VAR)
OTLP_METRICS_ENDPOINT_ENV_VARS = (OTLP_METRICS_ENDPOINT_ENV_VAR, OTLP_ENDPOINT_ENV_VAR)
OTLP_METRICS_PROTOCOL_ENV_VARS = (OTLP_METRICS_PROTOCOL_ENV_VAR, OTLP_PROTOCOL_ENV_VAR)


_NAME = "variable"  # each field's metadata key: the variable it reads


def _variable(name: str, *, secret: bool = False) -> Any:
    return dataclasses.field(default=None, repr=not secret, metadata={_NAME: name})


@dataclasses.dataclass(frozen=True)
class Environment:
    """What the environment says. Values stay text: each reader parses its own (the CLI names a bad flag default,
    the config a bad address). An empty value counts as unset (an empty export is how shells unset).

    A plain dataclass over `os.environ`, not a pydantic-settings model: text needs no validation, and importing
    pydantic-settings cost a worker's `import gym_rpc.client.server_client` about 55 ms."""

    head_address: str | None = _variable(HEAD_ADDRESS_ENV_VAR)
    token: str | None = _variable(TOKEN_ENV_VAR, secret=True)
    tls_ca_file: str | None = _variable(TLS_CA_ENV_VAR)
    tls_cert_file: str | None = _variable(TLS_CERT_ENV_VAR)
    tls_key_file: str | None = _variable(TLS_KEY_ENV_VAR)
    watch_relay: str | None = _variable(WATCH_RELAY_ENV_VAR)
    nemo_gym_config_dict: str | None = _variable(NEMO_GYM_CONFIG_DICT_ENV_VAR, secret=True)
    model_server_base_url: str | None = _variable(NEMO_GYM_MODEL_SERVER_BASE_URL_ENV_VAR)
    model_server_name: str | None = _variable(NEMO_GYM_MODEL_SERVER_NAME_ENV_VAR)
    nemo_gym_otel_enabled: str | None = _variable("NEMO_GYM_OTEL_ENABLED")
    nemo_gym_otel_traces_enabled: str | None = _variable("NEMO_GYM_OTEL_TRACES_ENABLED")
    nemo_gym_otel_metrics_enabled: str | None = _variable("NEMO_GYM_OTEL_METRICS_ENABLED")
    nemo_gym_otel_exporter: str | None = _variable("NEMO_GYM_OTEL_EXPORTER")
    nemo_lens_enabled: str | None = _variable("NEMO_LENS_ENABLED")
    nemo_lens_traces_enabled: str | None = _variable("NEMO_LENS_TRACES_ENABLED")
    nemo_lens_metrics_enabled: str | None = _variable("NEMO_LENS_METRICS_ENABLED")
    nemo_lens_exporter: str | None = _variable("NEMO_LENS_EXPORTER")
    cli_timeout: str | None = _variable(TIMEOUT_ENV_VAR)
    cli_output: str | None = _variable(OUTPUT_ENV_VAR)
    cli_log_level: str | None = _variable(LOG_LEVEL_ENV_VAR)
    cli_log_format: str | None = _variable(LOG_FORMAT_ENV_VAR)
    cli_config: str | None = _variable(CONFIG_ENV_VAR)
    cli_probe_interval: str | None = _variable(PROBE_INTERVAL_ENV_VAR)
    cli_probe_timeout: str | None = _variable(PROBE_TIMEOUT_ENV_VAR)
    cli_http_port: str | None = _variable(HTTP_PORT_ENV_VAR)
    cli_metrics_port: str | None = _variable(METRICS_PORT_ENV_VAR)
    cli_connect_port: str | None = _variable(CONNECT_PORT_ENV_VAR)
    cli_wait_timeout: str | None = _variable(WAIT_TIMEOUT_ENV_VAR)
    otel_sdk_disabled: str | None = _variable(SDK_DISABLED_ENV_VAR)
    otel_service_name: str | None = _variable(SERVICE_NAME_ENV_VAR)
    otel_resource_attributes: str | None = _variable(RESOURCE_ATTRIBUTES_ENV_VAR)
    otel_traces_exporter: str | None = _variable(TRACES_EXPORTER_ENV_VAR)
    otel_metrics_exporter: str | None = _variable(METRICS_EXPORTER_ENV_VAR)
    otel_exemplar_filter: str | None = _variable(EXEMPLAR_FILTER_ENV_VAR)
    otlp_endpoint: str | None = _variable(OTLP_ENDPOINT_ENV_VAR)
    otlp_protocol: str | None = _variable(OTLP_PROTOCOL_ENV_VAR)
    otlp_traces_endpoint: str | None = _variable(OTLP_TRACES_ENDPOINT_ENV_VAR)
    otlp_traces_protocol: str | None = _variable(OTLP_TRACES_PROTOCOL_ENV_VAR)
    otlp_metrics_endpoint: str | None = _variable(OTLP_METRICS_ENDPOINT_ENV_VAR)
    otlp_metrics_protocol: str | None = _variable(OTLP_METRICS_PROTOCOL_ENV_VAR)

    def model_server_override(self, server_name: str) -> str | None:
        """NEMO_GYM_MODEL_SERVER_BASE_URL when NEMO_GYM_MODEL_SERVER_NAME names `server_name`."""
        if self.model_server_base_url and self.model_server_name == server_name:
            return self.model_server_base_url
        return None

    def by_name(self) -> dict[str, str]:
        """The variables that are set, by their names: for readers written against a mapping (the OpenTelemetry
        rules, the CLI's flag defaults), which tests feed a mapping of their own."""
        values = ((field.metadata[_NAME], getattr(self, field.name)) for field in dataclasses.fields(self))
        return {name: value for name, value in values if value is not None}


def variable_names() -> list[str]:
    """Every variable gym_rpc reads, in declaration order."""
    return [field.metadata[_NAME] for field in dataclasses.fields(Environment)]


_NAMES = tuple(variable_names())


def environment() -> Environment:
    """The environment as it is now: read when needed, never at import (tests and launchers set variables after
    gym_rpc is imported). Reading every name takes well under a millisecond: callers read it afresh each time."""
    return Environment(*(os.environ.get(name) or None for name in _NAMES))  # the fields in declaration order
