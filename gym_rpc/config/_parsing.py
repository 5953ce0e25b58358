"""Reading config text: bounded YAML, and OmegaConf interpolations resolved strictly or tolerantly.

Bounded because a config file can be hostile (YAML aliases expand 550 bytes to a billion values); tolerant
because a client handed a config must not fail on an interpolation nothing it reads, as NeMo Gym's DictConfig
does not. The bounds are here; gym_rpc.config._yaml applies them while PyYAML composes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gym_rpc.errors import ConfigError

# Bounds on a config document, far above any real one (a config of 1,000 servers is ~200 KiB, ~20,000 values,
# nested ~6 deep) and far below what hangs or exhausts the head: YAML aliases let 550 bytes expand to a billion
# values ("billion laughs"), and deep nesting overflows the parser's recursion.
MAX_CONFIG_BYTES = 16 * 1024 * 1024
MAX_CONFIG_DEPTH = 100
MAX_CONFIG_VALUES = 1_000_000  # counted with every alias expanded, as JSON or a DictConfig would expand them


def parse_config_text(text: str, source: str = "<config>") -> dict[str, Any]:
    """Parse YAML (or JSON, a subset) into a document (a text without one is an empty document)."""
    document = parse_config_document(text, source)
    return {} if document is None else document


def parse_config_document(text: str, source: str = "<config>") -> dict[str, Any] | None:
    """Parse YAML (or JSON, a subset) into a document; None when the text holds none (empty, only whitespace,
    comments or a null); errors name the source and the line.

    Bounded: a document larger, deeper or (aliases expanded) bigger than the MAX_CONFIG_* limits is refused with
    a ConfigError in time linear in its text, never expanded.
    """
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: refusing a config larger than {MAX_CONFIG_BYTES // (1024 * 1024)} MiB")
    from gym_rpc.config._yaml import load_bounded_yaml  # PyYAML loads with the first text parsed

    document = load_bounded_yaml(text, source, max_values=MAX_CONFIG_VALUES, max_depth=MAX_CONFIG_DEPTH)
    if document is None:
        return None
    if not isinstance(document, dict):
        raise ConfigError(f"{source}: a global config must be a mapping, not {type(document).__name__}")
    return {str(k): v for k, v in document.items()}


def resolved(document: Mapping[str, Any]) -> dict[str, Any]:
    """A plain-dict copy of the document with OmegaConf interpolations (`${...}`) resolved."""
    if not isinstance(document, Mapping):
        raise ConfigError(f"a global config must be a mapping, not {type(document).__name__}")
    try:
        text = json.dumps(document, default=str)
    except (TypeError, ValueError) as exc:  # a self-referencing YAML anchor, a key JSON cannot carry
        raise ConfigError(f"config is not representable as JSON: {exc}") from exc
    except RecursionError:  # a document built in code, nested past Python's recursion limit
        raise ConfigError(f"config nested more than {MAX_CONFIG_DEPTH} levels deep") from None
    if "${" not in text:
        return dict(document)
    from omegaconf import OmegaConf  # only documents with interpolations pay for OmegaConf

    try:
        resolved = OmegaConf.to_container(OmegaConf.create(dict(document)), resolve=True)
    except Exception as exc:  # omegaconf raises many unrelated types
        raise ConfigError(f"cannot resolve config interpolations: {exc}") from exc
    assert isinstance(resolved, dict)
    return {str(k): v for k, v in resolved.items()}


def resolved_leniently(document: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Like `resolved`, but an interpolation that cannot be resolved stays as written: the document, and the
    dotted path of each unresolved value -> the reason. Subtrees that resolve at once are never walked."""
    if not isinstance(document, Mapping):
        raise ConfigError(f"a global config must be a mapping, not {type(document).__name__}")
    try:
        text = json.dumps(document, default=str)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config is not representable as JSON: {exc}") from exc
    if "${" not in text:
        return dict(document), {}
    from omegaconf import DictConfig, ListConfig, OmegaConf

    unresolved: dict[str, str] = {}

    def resolve(node: Any, path: str) -> Any:
        try:
            return OmegaConf.to_container(node, resolve=True)
        except Exception:  # omegaconf raises many unrelated types; walk down to the values that fail
            raw: Any = OmegaConf.to_container(node, resolve=False)
        keys = list(raw) if isinstance(raw, dict) else range(len(raw))
        resolved: dict[Any, Any] = {}
        for key in keys:
            child_path = f"{path}.{key}" if path else str(key)
            try:
                child = node[key]
            except Exception as exc:
                unresolved[child_path] = f"{raw[key]!r} ({str(exc).splitlines()[0]})"
                resolved[key] = raw[key]
                continue
            is_container = isinstance(child, DictConfig | ListConfig)
            resolved[key] = resolve(child, child_path) if is_container else child
        return resolved if isinstance(raw, dict) else [resolved[index] for index in keys]

    try:
        root = OmegaConf.create(dict(document))
    except Exception as exc:
        raise ConfigError(f"cannot read config interpolations: {exc}") from exc
    result = resolve(root, "")
    return {str(k): v for k, v in result.items()}, unresolved
