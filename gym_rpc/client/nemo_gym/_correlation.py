"""What gym_rpc's client honours of NeMo Gym's rollout correlation, without ever importing NeMo Gym.

NeMo Gym's agents bind the rollout a request belongs to in their own context variable
(`nemo_gym.rollout_correlation`), and NeMo Gym's client derives the rollout of a `/verify` call from its body
(`_ng_rollout_id`, else `_ng_task_index` and `_ng_rollout_index`, plus `_ng_attempt_index`). With gym_rpc's client
injected into NeMo Gym's servers, both must still put `/ng-rollout/<id>` on the same calls. NeMo Gym's module is
read only when the process has already imported it (NeMo Gym code binding an id has), so a process without NeMo Gym
pays one dictionary lookup, and only on calls made with observability on and no gym_rpc rollout bound.

A call to a replicated server sticks by its rollout (the contexts, else its body by the same rule) and by the NeMo
Gym session its cookies carry (`session_key_from_cookies`): the route keeps both as keys of one pin, so a session's
calls stay with the instance that holds its state (gym_rpc.client.replicas._server_route).
"""

from __future__ import annotations

import base64
import binascii
import json
import sys
from collections.abc import Mapping
from typing import Any

from gym_rpc.wire import ROLLOUT_ID_RULE, is_plain_rollout_id

NEMO_GYM_ROLLOUT_MODULE = "nemo_gym.rollout_correlation"
ROLLOUT_ID_KEY = "_ng_rollout_id"
TASK_INDEX_KEY = "_ng_task_index"
ROLLOUT_INDEX_KEY = "_ng_rollout_index"
ATTEMPT_INDEX_KEY = "_ng_attempt_index"


def nemo_gym_rollout_id() -> str | None:
    """The rollout id NeMo Gym's own context binds here, when NeMo Gym is loaded in this process."""
    module = sys.modules.get(NEMO_GYM_ROLLOUT_MODULE)
    if module is None:
        return None
    rollout_id: str | None = module.current_rollout_id()
    return rollout_id


def rollout_id_from_run_body(body: Any) -> str | None:
    """The rollout id a run or verify body names, by NeMo Gym's rule; None when it names none.

    An explicit `_ng_rollout_id` wins (and must be a plain path segment: a malformed one is refused with a
    ValueError naming the key rather than rewritten); else `<task>-<rollout>` from the two indices. A retried
    attempt (`_ng_attempt_index` > 0) appends `-a<n>`.
    """
    if not isinstance(body, Mapping):
        return None
    explicit = body.get(ROLLOUT_ID_KEY)
    if explicit is not None:
        if not is_plain_rollout_id(explicit):  # the rule every rollout id follows (gym_rpc.wire)
            shown = explicit[:80] if isinstance(explicit, str) else explicit
            raise ValueError(f"{ROLLOUT_ID_KEY} must be at most 256 {ROLLOUT_ID_RULE}, not {shown!r}")
        rollout_id = str(explicit)
    else:
        task, rollout = body.get(TASK_INDEX_KEY), body.get(ROLLOUT_INDEX_KEY)
        if task is None or rollout is None:
            return None
        rollout_id = f"{task}-{rollout}"
    attempt = body.get(ATTEMPT_INDEX_KEY)
    if attempt is not None and int(attempt) > 0:
        rollout_id = f"{rollout_id}-a{int(attempt)}"
    return rollout_id


# NeMo Gym servers name their session cookie `<ServerClass>___<server name>` (`get_session_middleware_key`), and
# Starlette's SessionMiddleware writes `<base64 of the session's JSON>.<timestamp>.<signature>`: the JSON holds the
# `session_id` NeMo Gym assigns, while the timestamp and signature change with every answer.
SESSION_COOKIE_SEPARATOR = "___"
SESSION_ID_KEY = "session_id"  # NeMo Gym's key of the id in its session (server_client exports it, as NeMo Gym's)


def session_key_from_cookies(cookies: Any, server_name: str) -> str | None:
    """The NeMo Gym session of `server_name` that a call's `cookies=` (a mapping of names to values or Morsels, or
    pairs) carries: its `session_id`, else the cookie's signed payload; None when it carries none."""
    if not cookies:
        return None
    items = cookies.items() if isinstance(cookies, Mapping) else cookies
    suffix = SESSION_COOKIE_SEPARATOR + server_name
    for item in items:
        try:
            name, value = item
        except (TypeError, ValueError):
            continue
        if isinstance(name, str) and name.endswith(suffix):
            text = getattr(value, "value", value)
            if isinstance(text, str) and text:
                return _session_id(text)
    return None


def _session_id(cookie_value: str) -> str:
    payload = cookie_value.split(".", 1)[0]
    try:
        session = json.loads(base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True))
    except (ValueError, binascii.Error):
        return payload
    if isinstance(session, Mapping):
        session_id = session.get(SESSION_ID_KEY)
        if isinstance(session_id, str) and session_id:
            return session_id
    return payload
