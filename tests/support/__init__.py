"""What the test modules share (fixtures stay in tests/conftest.py or are registered there as plugins): the suite's
tiers, and the helpers many modules use. No test module imports another test module; what two of them need lives
here (tests/project/test_tiers.py checks it)."""

from __future__ import annotations

import pkgutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent

if "pytest" in sys.modules:  # not in the scenario scripts' fresh interpreters, which import helpers from here
    import pytest

    # Helpers here assert as tests do: pytest's assertion rewriting shows the values, as in the test modules.
    pytest.register_assert_rewrite(*(f"{__name__}.{module.name}" for module in pkgutil.iter_modules(__path__)))
