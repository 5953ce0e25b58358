"""The rollout and trace-context URL path format, `/ng-rollout/<id>[/training-token-capture][/ng-trace/<tp>]`:
the builder clients use and the parser receiving servers use, in one place so the two cannot disagree.

A rollout id is one plain path segment, by NeMo Gym's rule for `_ng_rollout_id` (ids also name files there):
letters, digits, dots, dashes and underscores, starting with a letter or digit. So an id never adds a segment, a
query or a fragment, never climbs (`..`), and carries no control, NUL or bidi character to a handler or a file
name. The client refuses another id when it builds a prefix, the receiving middleware answers 400 for one: one
rule, both sides.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple
from urllib.parse import unquote

from gym_rpc.errors import InvalidRolloutIdError, MalformedGymPrefixError

ROLLOUT_SEGMENT = "ng-rollout"
TOKEN_CAPTURE_SEGMENT = "training-token-capture"
TRACE_SEGMENT = "ng-trace"
MODEL_SERVER_TYPE = "responses_api_models"
RESOURCES_SERVER_TYPE = "resources_servers"
MODEL_SERVER_PATHS = frozenset({"/v1/responses", "/v1/chat/completions", "/v1/messages"})
MAX_ROLLOUT_ID_LENGTH = 256
_ROLLOUT_PATH_HEAD = f"/{ROLLOUT_SEGMENT}/"

# The W3C trace-context header (and gRPC metadata key) that `/ng-trace/<tp>` stands for.
TRACEPARENT_HEADER = "traceparent"
TRACEPARENT_PATTERN = "00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}"
TRACEPARENT_RE = re.compile(TRACEPARENT_PATTERN)
# Every Gym prefix starts with this: one startswith() decides the common case (no prefix) at near-zero cost.
GYM_PREFIX_HEAD = "/ng-"
_ZERO_TRACE_ID = "0" * 32
_ZERO_SPAN_ID = "0" * 16
_PERCENT_ENCODED_SEGMENT = re.compile(r"(?:[^%/]|%[0-9A-Fa-f]{2})+")
ROLLOUT_ID_RULE = "letters, digits, dots, dashes or underscores, starting with a letter or digit"
_PLAIN_ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SHOWN_CHARACTERS = 80  # of a refused id in an error: enough to recognise it, never the whole of a huge one


def is_plain_rollout_id(rollout_id: object) -> bool:
    """Whether `rollout_id` is a rollout id by the one rule (see the module docstring), at most
    MAX_ROLLOUT_ID_LENGTH characters."""
    return (
        isinstance(rollout_id, str)
        and len(rollout_id) <= MAX_ROLLOUT_ID_LENGTH
        and _PLAIN_ROLLOUT_ID.fullmatch(rollout_id) is not None
    )


def encode_rollout_id(rollout_id: str) -> str:
    """The id as its path segment (a plain id needs no encoding); any other id is an InvalidRolloutIdError."""
    if not is_plain_rollout_id(rollout_id):
        shown = rollout_id[:_SHOWN_CHARACTERS] if isinstance(rollout_id, str) else rollout_id
        more = " (and more)" if isinstance(rollout_id, str) and len(rollout_id) > _SHOWN_CHARACTERS else ""
        raise InvalidRolloutIdError(
            f"invalid rollout id {shown!r}{more}: at most {MAX_ROLLOUT_ID_LENGTH} {ROLLOUT_ID_RULE}"
        )
    return rollout_id


def rollout_path_prefix(rollout_id: str | None, token_capture: bool = False) -> str:
    """Return the leading model-server path prefix for a rollout, if available ("" without a rollout id: None or
    "", as in NeMo Gym)."""
    if rollout_id is None or rollout_id == "":
        return ""
    if not isinstance(rollout_id, str):
        encode_rollout_id(rollout_id)  # raises the typed error before the cache would raise "unhashable"
    prefix = _cached_prefix(rollout_id)
    return f"{prefix}/{TOKEN_CAPTURE_SEGMENT}" if token_capture else prefix


@functools.lru_cache(maxsize=4096)
def _cached_prefix(rollout_id: str) -> str:
    """Hot path: every call of a rollout builds the same prefix; encode it once (errors are not cached). One
    argument: the cache's key is the id itself, no tuple made per call (bench/cpu_count.py)."""
    return f"/{ROLLOUT_SEGMENT}/{encode_rollout_id(rollout_id)}"


def trace_path_segment(trace_id: int, span_id: int, trace_flags: int) -> str:
    """`/ng-trace/<traceparent>` for a span context (W3C traceparent, version 00)."""
    return f"/{TRACE_SEGMENT}/00-{trace_id:032x}-{span_id:016x}-{trace_flags:02x}"


def prefixed_path(url_path: str, server_type: str, rollout_id: str | None) -> str:
    """The data-plane path rule: model-server API paths and every resources-server path get the rollout prefix;
    a path that already carries one is left alone. A query string does not hide a model-server API path."""
    if not rollout_id or url_path.startswith(_ROLLOUT_PATH_HEAD):
        return url_path
    # The usual model call's path is one of MODEL_SERVER_PATHS as it is: no query string to split off first.
    is_model_call = server_type == MODEL_SERVER_TYPE and (
        url_path in MODEL_SERVER_PATHS or url_path.partition("?")[0] in MODEL_SERVER_PATHS
    )
    if is_model_call or server_type == RESOURCES_SERVER_TYPE:
        # A str id (every call of a rollout) straight from the cache, one Python call fewer on each observed call
        # (bench/cpu_count.py); anything else through rollout_path_prefix, which raises its typed error.
        prefix = _cached_prefix(rollout_id) if type(rollout_id) is str else rollout_path_prefix(rollout_id)
        return prefix + url_path
    return url_path


class GymPrefixes(NamedTuple):
    """What `split_gym_prefixes` found: the path left for routing (still percent-encoded) and the prefix values."""

    rest: str
    rollout_id: str | None
    token_capture: bool
    traceparent: str | None

    @property
    def stripped(self) -> bool:
        """Whether the path carried any Gym prefix (a rollout prefix always has an id)."""
        return self.rollout_id is not None or self.traceparent is not None


def split_gym_prefixes(path: str) -> GymPrefixes:
    """Split the leading Gym segments off a percent-encoded path (no query string).

    Accepted: optional `/ng-rollout/<percent-encoded id>` optionally followed by `/training-token-capture`, then
    optional `/ng-trace/<traceparent>`. The rest ("/" when nothing is left) is returned still encoded; the rollout
    id is returned decoded. Raises MalformedGymPrefixError for an empty or malformed rollout id, or a traceparent
    that does not match `TRACEPARENT_PATTERN` fully or has an all-zero trace or span id.
    """
    if not path.startswith(GYM_PREFIX_HEAD):
        return GymPrefixes(path, None, False, None)
    rollout_id: str | None = None
    token_capture = False
    traceparent: str | None = None
    rest = path  # what is not consumed yet; `after` is what follows its first segment
    head, after = _first_segment(rest)
    if head == ROLLOUT_SEGMENT:
        encoded_id, rest = _first_segment(after)
        rollout_id = _decode_rollout_id(encoded_id)
        head, after = _first_segment(rest)
        if head == TOKEN_CAPTURE_SEGMENT:
            token_capture = True
            rest = after
            head, after = _first_segment(rest)
    if head == TRACE_SEGMENT:
        candidate, rest = _first_segment(after)
        traceparent = _checked_traceparent(candidate)
    return GymPrefixes(rest or "/", rollout_id, token_capture, traceparent)


def _first_segment(path: str) -> tuple[str, str]:
    """("seg", "/rest...") for "/seg/rest..."; ("", "") for "" — the remainder keeps its leading slash."""
    if not path:
        return "", ""
    end = path.find("/", 1)
    if end == -1:
        return path[1:], ""
    return path[1:end], path[end:]


def _decode_rollout_id(encoded_id: str) -> str:
    """The id of a received `/ng-rollout/<segment>`: decoded (a client may escape what needs no escaping), then
    held to the rule the client applies; a hostile id (`%2F`, `..`, `%00`, a bidi control) is refused."""
    shown = encoded_id[:_SHOWN_CHARACTERS]
    if not encoded_id:
        raise MalformedGymPrefixError(f"empty rollout id after /{ROLLOUT_SEGMENT}/")
    if not _PERCENT_ENCODED_SEGMENT.fullmatch(encoded_id):
        raise MalformedGymPrefixError(f"malformed percent-encoding in rollout id segment {shown!r}")
    try:
        rollout_id = unquote(encoded_id, errors="strict")
    except UnicodeDecodeError:
        raise MalformedGymPrefixError(f"rollout id segment {shown!r} is not UTF-8") from None
    if not is_plain_rollout_id(rollout_id):
        raise MalformedGymPrefixError(
            f"rollout id segment {shown!r} is not a rollout id: at most {MAX_ROLLOUT_ID_LENGTH} {ROLLOUT_ID_RULE}"
        )
    return rollout_id


def _checked_traceparent(candidate: str) -> str:
    if not TRACEPARENT_RE.fullmatch(candidate):
        raise MalformedGymPrefixError(
            f"malformed traceparent segment {candidate[:80]!r}: expected 00-<32 hex>-<16 hex>-<2 hex>"
        )
    _, trace_id, span_id, _ = candidate.split("-")
    if trace_id == _ZERO_TRACE_ID or span_id == _ZERO_SPAN_ID:
        raise MalformedGymPrefixError(f"traceparent {candidate!r} has an all-zero trace id or span id")
    return candidate
