"""Rollout ids and trace context carried in URL paths: `/ng-rollout/<id>[/training-token-capture]/ng-trace/<tp>`.

The rollout id lives in a context variable so every call made for a rollout (in any task spawned under it) carries
it without threading it through arguments. Ids are percent-encoded as one path segment: an id can never add a
segment, a query or a fragment.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
from collections.abc import Iterator
from urllib.parse import quote

from opentelemetry import trace

from gym_rpc.errors import GymRpcError
from gym_rpc.telemetry import TRACING

ROLLOUT_SEGMENT = "ng-rollout"
TOKEN_CAPTURE_SEGMENT = "training-token-capture"
TRACE_SEGMENT = "ng-trace"
MODEL_SERVER_TYPE = "responses_api_models"
RESOURCES_SERVER_TYPE = "resources_servers"
MODEL_SERVER_PATHS = frozenset({"/v1/responses", "/v1/chat/completions", "/v1/messages"})
MAX_ROLLOUT_ID_LENGTH = 256
_ROLLOUT_PATH_HEAD = f"/{ROLLOUT_SEGMENT}/"

_TRACEPARENT_PATTERN = "00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}"
TRACEPARENT_RE = re.compile(_TRACEPARENT_PATTERN)

_rollout_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("gym_rpc_rollout_id", default=None)


class InvalidRolloutIdError(GymRpcError, ValueError):
    """A rollout id that cannot stand as one URL path segment."""


def current_rollout_id() -> str | None:
    """The rollout id bound in this context, if any."""
    return _rollout_id.get()


@contextlib.contextmanager
def rollout_context(rollout_id: str | None) -> Iterator[str | None]:
    """Bind a rollout id for the calls made inside the block (and the tasks it starts); "" means no rollout."""
    if rollout_id:
        encode_rollout_id(rollout_id)  # fail where the id is bound, not at the first call
    token = _rollout_id.set(rollout_id)
    try:
        yield rollout_id
    finally:
        _rollout_id.reset(token)


def encode_rollout_id(rollout_id: str) -> str:
    """The id as one percent-encoded path segment; empty, dot-segment and over-long ids are rejected."""
    if not isinstance(rollout_id, str) or rollout_id in ("", ".", ".."):
        raise InvalidRolloutIdError(f"invalid rollout id {rollout_id!r}: must be a non-empty string, not . or ..")
    if len(rollout_id) > MAX_ROLLOUT_ID_LENGTH:
        raise InvalidRolloutIdError(f"rollout id is {len(rollout_id)} characters; at most {MAX_ROLLOUT_ID_LENGTH}")
    try:
        return quote(rollout_id, safe="")
    except UnicodeEncodeError:  # a lone surrogate: not text that UTF-8 (or a URL) can carry
        raise InvalidRolloutIdError(f"invalid rollout id {rollout_id!r}: not encodable as UTF-8") from None


def rollout_path_prefix(rollout_id: str | None, token_capture: bool = False) -> str:
    """Return the leading model-server path prefix for a rollout, if available ("" without a rollout id: None or
    "", as in NeMo Gym)."""
    if rollout_id is None or rollout_id == "":
        return ""
    if not isinstance(rollout_id, str):
        encode_rollout_id(rollout_id)  # raises the typed error before the cache would raise "unhashable"
    return _cached_prefix(rollout_id, bool(token_capture))


@functools.lru_cache(maxsize=4096)
def _cached_prefix(rollout_id: str, token_capture: bool) -> str:
    """Hot path: every call of a rollout builds the same prefix; encode it once (errors are not cached)."""
    prefix = f"/{ROLLOUT_SEGMENT}/{encode_rollout_id(rollout_id)}"
    return f"{prefix}/{TOKEN_CAPTURE_SEGMENT}" if token_capture else prefix


def trace_context_path_segment() -> str:
    """Return `/ng-trace/<traceparent>` for the current span, or "" while traces are off or no span is current.

    "Off" is gym_rpc's tracing decision (gym_rpc.telemetry): an application's own span does not turn it on."""
    if not TRACING.enabled:
        return ""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return ""
    return f"/{TRACE_SEGMENT}/00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def apply_rollout_prefix(
    base_url: str, rollout_id: str | None, token_capture: bool = False, trace_context: bool = True
) -> str:
    """Append the rollout prefix and, while traces export, the current span's trace context to a root URL.

    For URLs handed to clients Gym does not instrument. Pass trace_context=False for a URL built once and reused
    across rollouts, or every later rollout would be parented to the first one's span.
    """
    prefix = rollout_path_prefix(rollout_id, token_capture)
    if trace_context:
        prefix += trace_context_path_segment()
    return base_url.rstrip("/") + prefix if prefix else base_url  # nothing to add: the URL as given


def prefixed_path(url_path: str, server_type: str, rollout_id: str | None) -> str:
    """The data-plane path rule: model-server API paths and every resources-server path get the rollout prefix;
    a path that already carries one is left alone. A query string does not hide a model-server API path."""
    if not rollout_id or url_path.startswith(_ROLLOUT_PATH_HEAD):
        return url_path
    is_model_call = server_type == MODEL_SERVER_TYPE and url_path.partition("?")[0] in MODEL_SERVER_PATHS
    if is_model_call or server_type == RESOURCES_SERVER_TYPE:
        return rollout_path_prefix(rollout_id) + url_path
    return url_path
