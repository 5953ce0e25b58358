"""Exact answers that mutation testing (`make mutate`, bench/MUTATION.md) found no other test pinned down.

Each test names the mutant class it kills: a change to the code that left the rest of the suite green.
"""

from __future__ import annotations

import pytest

from gym_rpc.client import ClientSecurity, ClientTls
from gym_rpc.client._rollout import apply_rollout_prefix
from gym_rpc.config import BaseServerConfig, get_first_server_config_dict
from gym_rpc.errors import ConfigError


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
