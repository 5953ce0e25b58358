"""How a call picks one instance of a replicated server: rendezvous hashing for a rollout, two random choices by
calls in flight for a call of no rollout. Pure functions over the route's candidates, no I/O.

* **Rendezvous (highest random weight) hashing** (Thaler and Ravishankar, 1996): each instance gets a weight
  from hashing it with the rollout, and the rollout goes to the heaviest. Every worker ranks a rollout's
  instances alike, and when an instance leaves only the rollouts whose heaviest it was move, each to its next
  heaviest. Rollouts hash into `SLOTS` slots and the weights are computed per slot (the slot's heaviest is then
  remembered until the instance set changes), so a rollout's first call costs one hash and one lookup whatever the
  number of instances; with 16,384 slots, each of 64 instances holds its share to within about a tenth.
* **Power of two choices** (Mitzenmacher, 2001): of two instances drawn at random, the one with fewer calls in
  flight. Nearly as even as asking every instance, and a slow or stuck instance, whose calls pile up, is left
  alone without any latency being measured.

Names hash with blake2b, never with Python's salted `hash()` of a string, and weights with CPython's (unsalted)
hash of integers, so every process agrees.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from itertools import repeat
from operator import xor
from typing import Protocol, TypeVar

SLOTS = 16384
_MASK64 = (1 << 64) - 1
_random = random.random


class Candidate(Protocol):
    """What picking reads of an instance (gym_rpc.client._instances.Instance)."""

    @property
    def key(self) -> int: ...

    @property
    def in_flight(self) -> int: ...


C = TypeVar("C", bound=Candidate)


def stable_key(text: str) -> int:
    """A 64-bit number for `text`, the same in every process (blake2b)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def slot_of(rollout: str) -> int:
    """The rollout's slot: rollouts in one slot share their instance."""
    return stable_key(rollout) % SLOTS


def _slot_key(slot: int) -> int:
    return (slot * 0x9E3779B97F4A7C15) & _MASK64  # a Weyl sequence: slots spread over all 64 bits


def weight(slot: int, instance_key: int) -> int:
    """The slot's weight for an instance: CPython's hash of a tuple of three integers built from both. For
    integers it is unsalted (the same in every process), and xxHash's rounds mix them well (tests/
    test_replicas_client.py pins values and checks the spread); `heaviest` computes it for every candidate in C."""
    base = _slot_key(slot)
    return hash((base ^ instance_key, instance_key, base))


def heaviest(slot: int, candidates: Sequence[C]) -> C:
    """The candidate with the highest weight for `slot` (candidates must not be empty)."""
    base = _slot_key(slot)
    keys = [candidate.key for candidate in candidates]
    weights = list(map(hash, zip(map(xor, repeat(base), keys), keys, repeat(base), strict=False)))
    return candidates[weights.index(max(weights))]


def two_choices(candidates: Sequence[C]) -> C:
    """Of two distinct candidates drawn at random, the one with fewer calls in flight (the first on a tie).

    One random draw makes both: its integer part (times the count) the first index, its fraction the second, both
    uniform (a double's 53 bits leave far more than enough for the fraction)."""
    count = len(candidates)
    if count == 1:
        return candidates[0]
    scaled = _random() * count
    first = int(scaled)
    second = int((scaled - first) * (count - 1))
    if second >= first:
        second += 1
    a, b = candidates[first], candidates[second]
    return a if a.in_flight <= b.in_flight else b
