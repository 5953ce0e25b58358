"""`session_affinity_header:` on a server entry: the entry is an OpenAI-compatible engine or router (vLLM, SGLang,
vllm-router, SMG, Dynamo), which takes a rollout's session key in a header rather than in the URL path.

```yaml
policy_model:
  responses_api_models:
    vllm_router:
      host: 10.0.0.1
      port: 30000
      session_affinity_header: true                 # X-Session-ID, as vllm-router's consistent_hash reads it
      # session_affinity_header: X-SMG-Routing-Key  # or the header another router reads
```
Calls to such an entry carry no `/ng-rollout/` or `/ng-trace/` path segment (an engine answers 404 to them): the
rollout id travels in the named header, the trace context in `traceparent`. The key's name is the one proposed
upstream (NeMo Gym #2570); it sits among a server's own settings, where NeMo Gym's entry models allow extra keys.
"""

from __future__ import annotations

import re
from typing import Any

from gym_rpc.errors import ConfigError

SESSION_AFFINITY_HEADER_KEY = "session_affinity_header"
# `engine_metrics: false` on such an entry: the head does not read its /metrics (a router: vllm-router passes
# `GET /metrics` on to one of its engines, whose figures are not the router's).
ENGINE_METRICS_KEY = "engine_metrics"
# vllm-router's `consistent_hash` policy keys on this header.
DEFAULT_SESSION_AFFINITY_HEADER = "X-Session-ID"
# RFC 9110 5.1: a field name is a token (letters, digits and `!#$%&'*+-.^_`|~`).
_FIELD_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Headers the HTTP client, the trace context or the call itself writes: a session key there would replace them.
_RESERVED = frozenset(
    {
        "authorization",
        "baggage",
        "connection",
        "content-length",
        "content-type",
        "cookie",
        "host",
        "te",
        "traceparent",
        "tracestate",
        "transfer-encoding",
        "upgrade",
    }
)
_MAX_NAME_LENGTH = 128


def session_affinity_header(server_name: str, value: Any) -> str | None:
    """The header an entry takes its session key in, from its `session_affinity_header` value: None (absent,
    null or false: the path form, as before), `true` (X-Session-ID) or a header name. Anything else is a
    ConfigError of one line naming the server, the value and what the key takes."""
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_SESSION_AFFINITY_HEADER
    where = f"server {server_name!r}: {SESSION_AFFINITY_HEADER_KEY}"
    if not isinstance(value, str):
        raise ConfigError(
            f"{where} must be true (the {DEFAULT_SESSION_AFFINITY_HEADER} header), a header name such as "
            f"X-SMG-Routing-Key, or false, not {type(value).__name__} {value!r}"
        )
    if not _FIELD_NAME.fullmatch(value) or len(value) > _MAX_NAME_LENGTH:
        raise ConfigError(
            f"{where} {value[:_MAX_NAME_LENGTH]!r} is not an HTTP header name: letters, digits and "
            f"!#$%&'*+-.^_`|~ only, at most {_MAX_NAME_LENGTH} (true means {DEFAULT_SESSION_AFFINITY_HEADER})"
        )
    if value.lower() in _RESERVED:
        raise ConfigError(
            f"{where} {value!r} is a header the call itself sends; name another, such as "
            f"{DEFAULT_SESSION_AFFINITY_HEADER} (true)"
        )
    return value


def engine_metrics(server_name: str, value: Any) -> bool:
    """Whether the head reads the entry's `/metrics` (its `engine_metrics` value; absent or null: yes, for an entry
    with a session affinity header). Anything but a boolean is a ConfigError naming the server."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ConfigError(
            f"server {server_name!r}: {ENGINE_METRICS_KEY} must be true or false, not {type(value).__name__} "
            f"{value!r}"
        )
    return value
