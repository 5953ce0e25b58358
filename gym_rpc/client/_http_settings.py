"""The data plane's settings: the optional `http_client:` block of the global config and its resend policy.

Apart from the pools (gym_rpc.client._http) so that reading a config, or a control client's backoff, loads no
aiohttp: a process imports aiohttp on its first data-plane call.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, ValidationError

from gym_rpc.config import validation_error_line
from gym_rpc.errors import ConfigError

HTTP_CLIENT_KEY = "http_client"
# NeMo Gym's top-level keys for its shared aiohttp pool -> the `http_client:` setting each one is.
UPSTREAM_POOL_KEYS = {
    "global_aiohttp_connector_limit": "max_connections",
    "global_aiohttp_connector_limit_per_host": "max_connections_per_host",
}
DEFAULT_TOTAL_TIMEOUT_SECONDS = 1800.0  # per data-plane call, headers included; see HttpClientSettings


class RetryPolicy(BaseModel):
    """Bounded exponential backoff with jitter for resending after a dropped connection."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    attempts: PositiveInt = 3
    initial_backoff_seconds: PositiveFloat = 0.05
    max_backoff_seconds: PositiveFloat = 1.0
    multiplier: float = Field(default=2.0, ge=1.0)  # below 1 the backoff shrinks (or flips sign) per attempt

    def backoff_seconds(self, failed_attempts: int) -> float:
        """The pause after the n-th failure: exponential, capped, with half of it random (no thundering herd)."""
        ceiling = min(
            self.max_backoff_seconds, self.initial_backoff_seconds * self.multiplier ** (failed_attempts - 1)
        )
        return ceiling / 2 + random.uniform(0, ceiling / 2)


class HttpClientSettings(BaseModel):
    """The optional `http_client:` block of the global config; every key has a default."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    # NeMo Gym's defaults (its `global_aiohttp_connector_limit` and `..._per_host`, honoured as aliases below).
    max_connections: PositiveInt = 102400
    max_connections_per_host: NonNegativeInt = 1024  # 0: only max_connections bounds one host
    control_max_connections: PositiveInt = 16
    keepalive_timeout_seconds: PositiveFloat = 30.0  # how long an idle pooled connection is kept
    connect_timeout_seconds: PositiveFloat = 10.0
    # Long enough for the slowest model generation, short enough that a server that accepted and went silent
    # fails the call instead of hanging the rollout; null turns the deadline off.
    total_timeout_seconds: PositiveFloat | None = DEFAULT_TOTAL_TIMEOUT_SECONDS
    control_total_timeout_seconds: PositiveFloat = 30.0
    retry: RetryPolicy = RetryPolicy()

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> HttpClientSettings:
        """From the `http_client:` block, and NeMo Gym's top-level pool keys (which must agree with the block)."""
        block = document.get(HTTP_CLIENT_KEY) or {}
        if not isinstance(block, Mapping):
            raise ConfigError(f"{HTTP_CLIENT_KEY} must be a mapping, not {type(block).__name__}")
        settings = dict(block)
        for upstream_key, key in UPSTREAM_POOL_KEYS.items():
            if document.get(upstream_key) is None:
                continue
            if settings.get(key, document[upstream_key]) != document[upstream_key]:
                raise ConfigError(
                    f"{upstream_key} ({document[upstream_key]}) and {HTTP_CLIENT_KEY}.{key} ({settings[key]}) "
                    f"disagree: set one of them"
                )
            settings[key] = document[upstream_key]
        try:
            return cls.model_validate(settings)
        except ValidationError as exc:
            raise ConfigError(validation_error_line(exc, HTTP_CLIENT_KEY)) from None
