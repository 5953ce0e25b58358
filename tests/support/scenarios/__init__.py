"""Scripts the tests run in fresh interpreters (`python PATH`, the repository on PYTHONPATH), where what a test
checks is decided once per process (tracing, metrics, allocations); `script("telemetry")` is the path to run."""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).resolve().parent


def script(name: str) -> Path:
    """The path of the scenario script `name` (`tests/support/scenarios/NAME.py`)."""
    path = FOLDER / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(path)
    return path
