"""How a call picks one instance of a replicated server: rendezvous hashing for a rollout, two random choices by
calls in flight for a call of no rollout, and for a model call its prompt's slot's order of preference
(`top_choices`, the same rendezvous weights) taken under a bound on load. Pure functions over the route's
candidates, no I/O.

* **Rendezvous (highest random weight) hashing** (Thaler and Ravishankar, 1996): each instance gets a weight
  from hashing it with the rollout, and the rollout goes to the heaviest. Every worker ranks a rollout's
  instances alike, and when an instance leaves only the rollouts whose heaviest it was move, each to its next
  heaviest. Rollouts hash into `SLOTS` slots and the weights are computed per slot, so that the route can remember
  each slot's heaviest instance (gym_rpc.client.replicas._server_route: `bench/replicas.py`'s `replicas-pick` rows
  show what that saves); with 16,384 slots, each of 8 instances holds its share to within 5 %, each of 64 to within
  about a sixth (256 slots each: one standard deviation is 6 %).
* **Power of two choices** (Mitzenmacher, 2001): of two instances drawn at random, the one with fewer calls in
  flight. Nearly as even as asking every instance, and a slow or stuck instance, whose calls pile up, is left
  alone without any latency being measured.

Every number here is defined in plain 64-bit integer arithmetic, never by Python's `hash()`, so workers on any
interpreter (or a harness in another language) pin a rollout to the same instance:

    key(text)              = the 8 bytes of blake2b(text as UTF-8, digest_size=8), read as a big-endian integer
    slot(rollout)          = key(rollout) mod 16384
    weight(slot, instance) = mix64(key(instance id) XOR (slot * 0x9E3779B97F4A7C15 mod 2**64))
    mix64(z)               = splitmix64's finalizer: z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27;
                             z *= 0x94D049BB133111EB; z ^= z >> 31 (each product mod 2**64)

The heaviest instance wins. `mix64` is a bijection, so instances of different keys never tie.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Protocol, TypeVar

SLOTS = 16384
_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio, odd: slot * it spreads slots over all 64 bits
_getrandbits = random.getrandbits


class Candidate(Protocol):
    """What picking reads of an instance (gym_rpc.client.replicas._instance_state.Instance)."""

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


def mix64(value: int) -> int:
    """splitmix64's finalizer (Steele, Lea and Flood, 2014): each input bit flips about half of the output's."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def weight(slot: int, instance_key: int) -> int:
    """The slot's weight for an instance (the module's docstring defines it exactly)."""
    return mix64(instance_key ^ ((slot * _GOLDEN_GAMMA) & _MASK64))


def heaviest(slot: int, candidates: Sequence[C]) -> C:
    """The candidate with the highest weight for `slot` (candidates must not be empty)."""
    best = candidates[0]
    best_weight = weight(slot, best.key)
    for candidate in candidates[1:]:
        candidate_weight = weight(slot, candidate.key)
        if candidate_weight > best_weight:
            best, best_weight = candidate, candidate_weight
    return best


def top_choices(slot: int, candidates: Sequence[C], count: int) -> tuple[C, ...]:
    """The `count` heaviest candidates for `slot`, heaviest first: the slot's order of preference (its first is
    `heaviest`'s)."""
    ranked = sorted(candidates, key=lambda candidate: weight(slot, candidate.key), reverse=True)
    return tuple(ranked[:count])


def two_choices(candidates: Sequence[C]) -> C:
    """Of two distinct candidates drawn at random, the one with fewer calls in flight (the first on a tie).

    Both draws come from one 32-bit random number, 16 bits each (a third of the cost of two `int(random() * n)`
    on CPython 3.11: bench/replicas.py, replicas-pick): uniform to within n / 65536 of each instance's share."""
    count = len(candidates)
    if count == 1:
        return candidates[0]
    bits = _getrandbits(32)
    first = (bits & 0xFFFF) * count >> 16
    second = (bits >> 16) * (count - 1) >> 16  # among the others: skip over the first
    if second >= first:
        second += 1
    a, b = candidates[first], candidates[second]
    return a if a.in_flight <= b.in_flight else b
