"""The data plane's settings: the optional `http_client:` block of the global config.

Apart from the pools (gym_rpc.client.data._http) so that reading a config loads no aiohttp: a process imports
aiohttp on its first data-plane call. The resend policy (`retry`) is gym_rpc.client.resend._policy's, aiohttp-free
too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, ValidationError

from gym_rpc.client.replicas import OutlierDetection
from gym_rpc.client.resend import RetryPolicy
from gym_rpc.config import validation_error_line
from gym_rpc.errors import ConfigError

HTTP_CLIENT_KEY = "http_client"
# NeMo Gym's top-level keys for its shared aiohttp pool and its sockets -> the `http_client:` setting each one is.
UPSTREAM_POOL_KEYS = {
    "global_aiohttp_connector_limit": "max_connections",
    "global_aiohttp_connector_limit_per_host": "max_connections_per_host",
    "global_aiohttp_tcp_keepalive_idle_seconds": "tcp_keepalive_idle_seconds",
    "global_aiohttp_tcp_keepalive_interval_seconds": "tcp_keepalive_interval_seconds",
    "global_aiohttp_tcp_keepalive_probes": "tcp_keepalive_probes",
}
DEFAULT_TOTAL_TIMEOUT_SECONDS = 1800.0  # per data-plane call, headers included; see HttpClientSettings
# How long an idle pooled connection is kept: NeMo Gym's 15 s, below the 30 s after which its uvicorn servers close
# an idle connection (NeMo Gym #1555): a connection the server may be closing is never reused.
DEFAULT_POOL_KEEPALIVE_SECONDS = 15.0


class HttpClientSettings(BaseModel):
    """The optional `http_client:` block of the global config; every key has a default."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    # NeMo Gym's defaults (its `global_aiohttp_connector_limit` and `..._per_host`, honoured as aliases below).
    max_connections: PositiveInt = 102400
    max_connections_per_host: NonNegativeInt = 1024  # 0: only max_connections bounds one host
    control_max_connections: PositiveInt = 16
    keepalive_timeout_seconds: PositiveFloat = DEFAULT_POOL_KEEPALIVE_SECONDS  # an idle connection's time
    # TCP keepalive on every connection (NeMo Gym's `global_aiohttp_tcp_keepalive_*`, its defaults, the kernel's
    # bounds): a peer that vanished is noticed on idle and long-waiting connections.
    tcp_keepalive_idle_seconds: int = Field(default=60, ge=1, le=32767)
    tcp_keepalive_interval_seconds: int = Field(default=10, ge=1, le=32767)
    tcp_keepalive_probes: int = Field(default=3, ge=1, le=127)
    connect_timeout_seconds: PositiveFloat = 10.0
    # Long enough for the slowest model generation, short enough that a server that accepted and went silent
    # fails the call instead of hanging the rollout; null turns the deadline off.
    total_timeout_seconds: PositiveFloat | None = DEFAULT_TOTAL_TIMEOUT_SECONDS
    control_total_timeout_seconds: PositiveFloat = 30.0
    retry: RetryPolicy = RetryPolicy()
    # When an instance of a replicated server is taken out of rotation (gym_rpc.client.replicas._outliers).
    outlier_detection: OutlierDetection = OutlierDetection()

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> HttpClientSettings:
        """From the `http_client:` block, and NeMo Gym's top-level pool keys (which must agree with the block)."""
        block = document.get(HTTP_CLIENT_KEY) or {}
        if not isinstance(block, Mapping):
            raise ConfigError(f"{HTTP_CLIENT_KEY} must be a mapping, not {type(block).__name__}")
        settings = dict(block)
        from_upstream = {}
        for upstream_key, key in UPSTREAM_POOL_KEYS.items():
            if document.get(upstream_key) is None:
                continue
            if settings.get(key, document[upstream_key]) != document[upstream_key]:
                raise ConfigError(
                    f"{upstream_key} ({document[upstream_key]}) and {HTTP_CLIENT_KEY}.{key} ({settings[key]}) "
                    f"disagree: set one of them"
                )
            settings[key] = document[upstream_key]
            from_upstream[key] = upstream_key
        try:
            return cls.model_validate(settings)
        except ValidationError as exc:
            line = validation_error_line(exc, HTTP_CLIENT_KEY)
            for key, upstream_key in from_upstream.items():  # a bad value is named where the document has it
                line = line.replace(f"{HTTP_CLIENT_KEY}.{key}:", f"{upstream_key}:", 1)
            raise ConfigError(line) from None
