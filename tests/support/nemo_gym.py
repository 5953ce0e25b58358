"""NeMo Gym's own code for tests: its venv (`make nemo-gym-venv`, the `nemo_gym_python` fixture) and a stand-in
of its rollout correlation module (`nemo_gym_path`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

BUILD_TIMEOUT_SECONDS = 900  # a first build on a fresh machine downloads a few hundred MB


@pytest.fixture(scope="module")
def nemo_gym_python() -> str:
    """The NeMo Gym venv's python, built on first use (`make test` builds it before pytest runs)."""
    built = subprocess.run(
        [sys.executable, str(VENV_BUILDER)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECONDS
    )
    assert built.returncode == 0, f"building the NeMo Gym venv failed:\n{built.stderr[-4000:]}"
    last = built.stdout.strip().splitlines()[-1]
    if last.startswith("SKIP:"):
        print(last)
        pytest.skip(last)
    return last


@pytest.fixture
def nemo_gym_path(tmp_path: Path) -> Path:
    package = tmp_path / "nemo_gym"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rollout_correlation.py").write_text(textwrap.dedent(STAND_IN))
    return tmp_path


STAND_IN = """
    # A stand-in for NeMo Gym's module (the real one runs in tests/nemo_gym/test_nemo_gym_compat.py): the same
    # public API.
    from contextlib import contextmanager
    from contextvars import ContextVar

    _ROLLOUT_ID = ContextVar("nemo_gym_rollout_id", default=None)

    def current_rollout_id():
        return _ROLLOUT_ID.get()

    @contextmanager
    def rollout_context(rollout_id):
        token = _ROLLOUT_ID.set(rollout_id)
        try:
            yield
        finally:
            _ROLLOUT_ID.reset(token)
"""


VENV_BUILDER = REPO_ROOT / "tools" / "nemo_gym_venv.py"
