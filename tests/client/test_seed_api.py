"""Every name of the seed API page (nemo_gym.client.server_client) exists in gym_rpc.client.server_client with the
seed's signature, defaults, async-ness and classmethod/staticmethod-ness.

The seed page lives beside the repository and is absent in CI, so its content is encoded here.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, get_args

import pytest

import gym_rpc
from gym_rpc.client import server_client
from gym_rpc.client.server_client import ServerClient

# name -> (kind, parameters without annotations, async, return annotation as written)
SEED_METHODS: dict[str, tuple[str, str, bool, str]] = {
    "_build_server_base_url": ("method", "(self, server_config_dict)", False, "str"),
    "_client_host": ("staticmethod", "(host)", False, "str"),
    "_resolve_base_url": ("method", "(self, server_name)", False, "str"),
    "assistant_message_header": ("method", "(self, model_server_name)", False, "bytes | None"),
    "checkpoint_enabled": ("method", "(self)", False, "bool"),
    "get": ("method", "(self, server_name, url_path, **kwargs)", True, "aiohttp.ClientResponse"),
    "load_from_global_config": ("classmethod", "(cls, head_server_config=None)", False, "ServerClient"),
    "load_head_server_config": ("classmethod", "(cls)", False, "BaseServerConfig"),
    "model_post_init": ("method", "(self, context)", False, "None"),
    "poll_for_status": ("method", "(self, server_name, timeout_seconds=5)", False, "ServerStatus"),
    "post": ("method", "(self, server_name, url_path, **kwargs)", True, "aiohttp.ClientResponse"),
    "request": (
        "method",
        "(self, server_name, url_path, method, _control=False, _resend_after_disconnect=True, **kwargs)",
        True,
        "aiohttp.ClientResponse",
    ),
}

SEED_FUNCTIONS: dict[str, tuple[str, str]] = {
    "_connectable_client_host": ("(host)", "str"),
    "apply_rollout_prefix": ("(base_url, rollout_id, token_capture=False, trace_context=True)", "str"),
    "get_server_url": ("(server_name)", "str"),
    "rollout_path_prefix": ("(rollout_id, token_capture=False)", "str"),
    "setup_server_client": ("(head_server_config=None)", "ServerClient"),
    "trace_context_path_segment": ("()", "str"),
}

SEED_CONSTANTS: dict[str, Any] = {
    "NEMO_GYM_MODEL_SERVER_BASE_URL_ENV_VAR_NAME": "NEMO_GYM_MODEL_SERVER_BASE_URL",
    "NEMO_GYM_MODEL_SERVER_NAME_ENV_VAR_NAME": "NEMO_GYM_MODEL_SERVER_NAME",
    "SESSION_ID_KEY": "session_id",
    "_TRACEPARENT_PATTERN": "00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}",
}


def bare(function: Any) -> str:
    """The signature as the seed page lists it: parameter names, kinds and defaults, no annotations."""
    signature = inspect.signature(function)
    parameters = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))


def kind_of(attribute: Any) -> str:
    if isinstance(attribute, classmethod):
        return "classmethod"
    if isinstance(attribute, staticmethod):
        return "staticmethod"
    return "method"


@pytest.mark.parametrize("name", sorted(SEED_METHODS))
def test_method_matches_seed(name: str) -> None:
    kind, parameters, is_async, returns = SEED_METHODS[name]
    attribute = inspect.getattr_static(ServerClient, name)
    assert kind_of(attribute) == kind
    function = attribute.__func__ if kind != "method" else attribute
    assert bare(function) == parameters
    assert inspect.iscoroutinefunction(function) is is_async
    assert inspect.signature(function).return_annotation == returns


@pytest.mark.parametrize("name", sorted(SEED_FUNCTIONS))
def test_function_matches_seed(name: str) -> None:
    parameters, returns = SEED_FUNCTIONS[name]
    function = getattr(server_client, name)
    assert inspect.isfunction(function)
    assert not inspect.iscoroutinefunction(function)
    assert bare(function) == parameters
    assert inspect.signature(function).return_annotation == returns


@pytest.mark.parametrize("name", sorted(SEED_CONSTANTS))
def test_constant_matches_seed(name: str) -> None:
    assert getattr(server_client, name) == SEED_CONSTANTS[name]


def test_model_shape_matches_seed() -> None:
    assert ServerClient.model_config.get("arbitrary_types_allowed") is True
    assert list(ServerClient.model_fields) == ["head_server_config", "global_config_dict"]
    fields = ServerClient.model_fields
    assert fields["head_server_config"].annotation is gym_rpc.config.BaseServerConfig
    assert getattr(fields["global_config_dict"].annotation, "__name__", None) == "DictConfig"
    private = ServerClient.__private_attributes__
    assert private["_checkpoint_enabled"].default is None
    assert private["_server_base_urls"].default_factory is dict


def test_server_status_and_logger_match_seed() -> None:
    assert get_args(server_client.ServerStatus) == ("success", "connection_error", "timeout", "unknown_error")
    assert isinstance(server_client.logger, logging.Logger)
    assert server_client.logger.name == "gym_rpc.client.server_client"


def test_rollout_context_is_exported_from_both_places() -> None:
    assert server_client.rollout_context is gym_rpc.rollout_context
    assert server_client.current_rollout_id is gym_rpc.current_rollout_id
    with gym_rpc.rollout_context("r-1"):
        assert server_client.current_rollout_id() == "r-1"
    assert server_client.current_rollout_id() is None
