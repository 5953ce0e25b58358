"""pytest plugin for `make mutate` (`[tool.mutmut]` in pyproject.toml): keep only the tests of these files.

mutmut maps each mutated function to the tests of its selection that ran it, and resets every cached result when
the selection's arguments change. The selection is therefore `tests/` with this plugin, and the list lives here:
a file added to it (a new module's tests) is picked up as new tests, without re-testing every mutant.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SELECTED_FILES = frozenset(
    {
        "test_config.py",
        "test_config_limits.py",
        "test_security.py",
        "test_head_hardening.py",
        "test_rollout.py",
        "test_middleware.py",
        "test_watch.py",
        "test_watch_fanout.py",
        "test_watch_limits.py",
        "test_watch_client.py",
        "test_leases.py",
        "test_scale.py",
        "test_data_plane.py",
        "test_data_plane_deadline.py",
        "test_server_client.py",
        "test_nemo_gym_behaviours.py",
        "test_registration_hosts.py",
        "test_exact_behaviour.py",
    }
)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Other test files are not even imported (some load tools/, which mutmut does not copy)."""
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return collection_path.name not in SELECTED_FILES or None
    return None
