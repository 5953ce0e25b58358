"""Exact answers that mutation testing (`make mutate`, bench/MUTATION.md) found no other test pinned down.

Each test names the mutant class it kills: a change to the code that left the rest of the suite green.
"""

from __future__ import annotations

import pytest

from gym_rpc.client import ClientSecurity, ClientTls
from gym_rpc.client._rollout import apply_rollout_prefix
from gym_rpc.config import BaseServerConfig, get_first_server_config_dict
from gym_rpc.errors import ConfigError, InvalidRolloutIdError, MalformedGymPrefixError
from gym_rpc.wire._paths import encode_rollout_id, rollout_path_prefix, split_gym_prefixes


def test_server_config_repr_redacts_only_secret_keys() -> None:
    """`__repr_args__` redacts a value when its key is secret *and* the value may be a secret: not every text."""
    config = BaseServerConfig.model_validate(
        {"host": "127.0.0.1", "port": 8000, "api_key": "sk-1", "note": "hello", "n": 5}
    )
    assert repr(config) == "BaseServerConfig(host='127.0.0.1', port=8000, api_key='<redacted>', note='hello', n=5)"


def test_client_security_repr_says_whether_a_token_and_tls_are_set() -> None:
    assert repr(ClientSecurity(token="t0ken", tls=ClientTls())) == "ClientSecurity(token=<set>, tls=True)"
    assert repr(ClientSecurity()) == "ClientSecurity(token=None, tls=False)"


def test_apply_rollout_prefix_strips_only_trailing_slashes() -> None:
    """The base URL loses its trailing '/' and nothing else, whatever characters come before it."""
    assert apply_rollout_prefix("http://gw/api/X/", "r1") == "http://gw/api/X/ng-rollout/r1"
    assert apply_rollout_prefix("http://gw/api/X//", "r1") == "http://gw/api/X/ng-rollout/r1"


@pytest.mark.parametrize("entry", [{"x": 1}, {"x": {"impl": 1}}], ids=["type-not-a-mapping", "impl-not-a-mapping"])
def test_a_misshapen_entry_is_named_in_one_exact_line(entry: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as caught:
        get_first_server_config_dict({"bad": entry}, "bad")
    assert str(caught.value) == "config entry 'bad' is not of the form {server_type: {impl: {...}}}"


@pytest.mark.parametrize(
    ("rollout_id", "message"),
    [
        ("", "invalid rollout id '': must be a non-empty string, not . or .."),
        (".", "invalid rollout id '.': must be a non-empty string, not . or .."),
        ("..", "invalid rollout id '..': must be a non-empty string, not . or .."),
        (5, "invalid rollout id 5: must be a non-empty string, not . or .."),
        ("x" * 257, "rollout id is 257 characters; at most 256"),
        ("\ud800", "invalid rollout id '\\ud800': not encodable as UTF-8"),
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
