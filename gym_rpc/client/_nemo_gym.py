"""What gym_rpc's client honours of NeMo Gym's rollout correlation, without ever importing NeMo Gym.

NeMo Gym's agents bind the rollout a request belongs to in their own context variable
(`nemo_gym.rollout_correlation`), and NeMo Gym's client derives the rollout of a `/verify` call from its body
(`_ng_rollout_id`, else `_ng_task_index` and `_ng_rollout_index`, plus `_ng_attempt_index`). With gym_rpc's client
injected into NeMo Gym's servers, both must still put `/ng-rollout/<id>` on the same calls. NeMo Gym's module is
read only when the process has already imported it (NeMo Gym code binding an id has), so a process without NeMo Gym
pays one dictionary lookup, and only on calls made with observability on and no gym_rpc rollout bound.
"""

from __future__ import annotations

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
