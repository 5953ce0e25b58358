"""Lazy package exports (PEP 562): a package names its public API up front and imports each module on first use.

`import gym_rpc` or `gym_rpc.client.rollout_context` must not pay for aiohttp, grpc, OmegaConf and OpenTelemetry's
instrumentation that `ServerClient` needs; type checkers see the real imports under TYPE_CHECKING.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The `__getattr__` of `package`: `exports` maps each public name to the module defining it."""

    def __getattr__(name: str) -> Any:
        module_name = exports.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_name), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    return __getattr__


def lazy_modules(package: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """`lazy_exports` for a package whose exports are all its own: `modules` maps each private module's name (as
    `_module`) to the public names it defines, separated by spaces."""
    return lazy_exports(
        package, {name: f"{package}.{module}" for module, names in modules.items() for name in names.split()}
    )
