"""How a call picks one instance of a replicated server: rendezvous hashing for a rollout, two random choices by
calls in flight for a call of no rollout. Pure functions over the route's candidates, no I/O.

* **Rendezvous (highest random weight) hashing** (Thaler and Ravishankar, 1996): each instance gets the weight
  hash(rollout, instance) and the rollout goes to the heaviest. Every worker ranks a rollout's instances alike,
  and when an instance leaves, only the rollouts whose heaviest it was move, each to its next heaviest.
* **Power of two choices** (Mitzenmacher, 2001): of two instances drawn at random, the one with fewer calls in
  flight. Nearly as even as asking every instance, and a slow or stuck instance, whose calls pile up, is left
  alone without any latency being measured.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import repeat
from typing import TYPE_CHECKING

from gym_rpc.client._instances import stable_key

if TYPE_CHECKING:
    from gym_rpc.client._instances import Instance

_random = random.random


def rollout_key(rollout_id: str) -> int:
    """The rollout's number in every weight: the same in every process (`stable_key`)."""
    return stable_key(rollout_id)


def heaviest(rollout: int, keys: Sequence[int]) -> int:
    """The index of the heaviest instance for `rollout` among instances with these `keys`.

    The weight is CPython's hash of the pair of integers: for integers it is unsalted and the same on every 64-bit
    CPython since 3.8 (tests/test_picker.py pins values), and computed in C for the whole list at once, a few tens
    of nanoseconds per instance (the `replicas` rows of bench/ measure it among 64)."""
    weights = list(map(hash, zip(repeat(rollout), keys, strict=False)))
    return weights.index(max(weights))


def two_choices(candidates: Sequence[Instance]) -> Instance:
    """Of two distinct candidates drawn at random, the one with fewer calls in flight (the first on a tie)."""
    count = len(candidates)
    if count == 1:
        return candidates[0]
    first = int(_random() * count)
    second = int(_random() * (count - 1))
    if second >= first:
        second += 1
    a, b = candidates[first], candidates[second]
    return a if a.in_flight <= b.in_flight else b
