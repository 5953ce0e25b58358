"""Rollout ids and trace context in URL paths, exactly: the prefixes, the refused ids and traceparents and how
they are quoted.

Found by mutation testing (`make mutate`, bench/MUTATION.md; these tests were tests/test_exact_behaviour.py):
exact answers no other test pinned down. Each test names the mutant class it kills: a change to the code
that left the rest of the suite green.
"""

from __future__ import annotations

import pytest

from gym_rpc.client.data._rollout import apply_rollout_prefix
from gym_rpc.errors import (
    InvalidRolloutIdError,
    MalformedGymPrefixError,
)
from gym_rpc.wire._paths import _first_segment, encode_rollout_id, rollout_path_prefix, split_gym_prefixes


def test_apply_rollout_prefix_strips_only_trailing_slashes() -> None:
    """The base URL loses its trailing '/' and nothing else, whatever characters come before it."""
    assert apply_rollout_prefix("http://gw/api/X/", "r1") == "http://gw/api/X/ng-rollout/r1"
    assert apply_rollout_prefix("http://gw/api/X//", "r1") == "http://gw/api/X/ng-rollout/r1"


RULE = "at most 256 letters, digits, dots, dashes or underscores, starting with a letter or digit"


@pytest.mark.parametrize(
    ("rollout_id", "message"),
    [
        ("", f"invalid rollout id '': {RULE}"),
        (".", f"invalid rollout id '.': {RULE}"),
        ("..", f"invalid rollout id '..': {RULE}"),
        (5, f"invalid rollout id 5: {RULE}"),
        ("x" * 257, f"invalid rollout id {'x' * 80!r} (and more): {RULE}"),
        ("\ud800", f"invalid rollout id '\\ud800': {RULE}"),
        ("r/1", f"invalid rollout id 'r/1': {RULE}"),
    ],
)
def test_a_refused_rollout_id_gets_one_exact_line(rollout_id: object, message: str) -> None:
    with pytest.raises(InvalidRolloutIdError) as caught:
        encode_rollout_id(rollout_id)  # type: ignore[arg-type]
    assert str(caught.value) == message


def test_the_longest_rollout_id_is_256_characters() -> None:
    assert encode_rollout_id("x" * 256) == "x" * 256


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/ng-trace/zz/v1", "malformed traceparent segment 'zz': expected 00-<32 hex>-<16 hex>-<2 hex>"),
        (
            f"/ng-trace/00-{'0' * 32}-{'1' * 16}-01/v1",
            f"traceparent '00-{'0' * 32}-{'1' * 16}-01' has an all-zero trace id or span id",
        ),
        (
            f"/ng-trace/00-{'1' * 32}-{'0' * 16}-01/v1",
            f"traceparent '00-{'1' * 32}-{'0' * 16}-01' has an all-zero trace id or span id",
        ),
    ],
)
def test_a_refused_traceparent_segment_gets_one_exact_line(path: str, message: str) -> None:
    with pytest.raises(MalformedGymPrefixError) as caught:
        split_gym_prefixes(path)
    assert str(caught.value) == message


def test_token_capture_is_any_truthy_flag_and_an_empty_id_has_no_prefix() -> None:
    assert rollout_path_prefix("r", 1) == "/ng-rollout/r/training-token-capture"  # type: ignore[arg-type]
    assert rollout_path_prefix("r", 0) == "/ng-rollout/r"  # type: ignore[arg-type]
    assert rollout_path_prefix("", True) == ""
    assert rollout_path_prefix(None, True) == ""


def test_an_unhashable_rollout_id_is_named_in_the_typed_error() -> None:
    with pytest.raises(InvalidRolloutIdError) as caught:
        rollout_path_prefix(["r"])  # type: ignore[arg-type]
    assert str(caught.value) == f"invalid rollout id ['r']: {RULE}"


@pytest.mark.parametrize(
    ("path", "split"),
    [("", ("", "")), ("/a", ("a", "")), ("/a/b/c", ("a", "/b/c")), ("//x", ("", "/x")), ("/ab/", ("ab", "/"))],
)
def test_the_first_segment_and_the_rest_keep_the_rests_slash(path: str, split: tuple[str, str]) -> None:
    assert _first_segment(path) == split


def test_a_long_malformed_traceparent_is_quoted_to_80_characters() -> None:
    segment = "z" * 100
    with pytest.raises(MalformedGymPrefixError) as caught:
        split_gym_prefixes(f"/ng-trace/{segment}/v1")
    assert (
        str(caught.value) == f"malformed traceparent segment {'z' * 80!r}: expected 00-<32 hex>-<16 hex>-<2 hex>"
    )
