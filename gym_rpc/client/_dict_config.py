"""`ServerClient.global_config_dict`, an OmegaConf DictConfig, made only when something reads it.

Building a DictConfig costs over 100 ms for 200 server entries (a node per value) and no flag skips that path,
while the client itself only needs the typed GlobalConfig. So a client made from a config it already has keeps
the GlobalConfig in a stand-in (`PendingDictConfig`) and builds the DictConfig on first read of the field, and
pydantic checks the field's type without importing OmegaConf (about 85 ms) until a process holds one.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

from gym_rpc.config import GlobalConfig

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from gym_rpc.client.data import HttpClientSettings

__all__ = [
    "GLOBAL_CONFIG_DICT_FIELD",
    "DictConfig",
    "LazyDictConfigField",
    "PendingDictConfig",
    "built_dict_config",
    "typed_config",
]

GLOBAL_CONFIG_DICT_FIELD = "global_config_dict"

if not TYPE_CHECKING:

    class DictConfig:
        """`global_config_dict`'s type for pydantic: an OmegaConf DictConfig, checked without importing OmegaConf
        until a process holds one. Type checkers see omegaconf.DictConfig itself."""

        @classmethod
        def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> Any:
            return core_schema.no_info_plain_validator_function(_dict_config)


def _dict_config(value: Any) -> DictConfig:
    if "omegaconf" in sys.modules:  # a DictConfig exists only once OmegaConf is imported
        from omegaconf import DictConfig

        if isinstance(value, DictConfig):
            return value
    raise ValueError(f"global_config_dict must be an OmegaConf DictConfig, not {type(value).__name__}")


class PendingDictConfig:
    """Stands in the instance's `__dict__` for a `global_config_dict` not built yet: the typed config it will be
    built from, and the data-plane settings the client takes (None: read from the config's document)."""

    __slots__ = ("config", "settings")

    def __init__(self, config: GlobalConfig, settings: HttpClientSettings | None = None) -> None:
        self.config = config
        self.settings = settings

    def __repr__(self) -> str:
        return f"<DictConfig of {len(self.config.document)} keys, built on first access>"


class LazyDictConfigField:
    """Data descriptor for the `global_config_dict` field: builds the DictConfig on first access, then caches it
    in the instance's `__dict__` (where pydantic keeps field values), so later reads cost a dict lookup."""

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:  # as for pydantic's own fields; a default here would be a default to subclasses
            raise AttributeError(GLOBAL_CONFIG_DICT_FIELD)
        value = instance.__dict__.get(GLOBAL_CONFIG_DICT_FIELD)
        if isinstance(value, PendingDictConfig):
            from omegaconf import OmegaConf

            value = instance.__dict__[GLOBAL_CONFIG_DICT_FIELD] = OmegaConf.create(value.config.document)
        return value

    def __set__(self, instance: Any, value: Any) -> None:
        instance.__dict__[GLOBAL_CONFIG_DICT_FIELD] = value


def built_dict_config(instance: Any) -> DictConfig | None:
    """The instance's DictConfig when it was given or built already; None while it is still pending."""
    value = instance.__dict__.get(GLOBAL_CONFIG_DICT_FIELD)
    return None if isinstance(value, PendingDictConfig) else value


def typed_config(value: Any) -> GlobalConfig:
    """The typed view of a `global_config_dict` value: the stand-in's own, or made from the caller's DictConfig
    (unresolved: interpolations are resolved leniently, so an unused `${oc.env:UNSET}` cannot fail)."""
    if isinstance(value, PendingDictConfig):
        return value.config
    from omegaconf import OmegaConf  # loaded already: the caller passed a DictConfig

    document = OmegaConf.to_container(value, resolve=False)
    if not isinstance(document, dict):
        from gym_rpc.errors import ConfigError

        raise ConfigError("global_config_dict must be a mapping")
    return GlobalConfig.from_document({str(k): v for k, v in document.items()}, lenient=True)
