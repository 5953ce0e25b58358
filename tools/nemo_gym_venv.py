"""Build (once) the venv in which tests/nemo_gym/test_nemo_gym_compat.py runs NeMo Gym's own code, and print its
python.

NeMo Gym declares Python >= 3.13 and a heavy dependency list, so it gets a venv of its own, beside the project's:
`nemo-gym` from the package registry without its dependencies, then the few it really imports
(tests/nemo_gym_compat/requirements.txt), then gym_rpc itself with its [head] extra, editable. The venv is rebuilt
only when those requirements or the interpreter change (a stamp holds their digest); a changed pyproject.toml only
reinstalls gym_rpc (a second stamp), so it costs a few seconds after the first build. Without any Python >= 3.13 it
prints `SKIP: <reason>` and exits 0: the test skips with it.

    python tools/nemo_gym_venv.py          # build or reuse; the last line is the venv's python (or SKIP: ...)
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV_DIR = REPO_ROOT / ".venv-nemo-gym"
REQUIREMENTS = REPO_ROOT / "tests" / "nemo_gym_compat" / "requirements.txt"
STAMP = VENV_DIR / ".stamp"
GYM_RPC_STAMP = VENV_DIR / ".stamp-gym-rpc"
LOCK = REPO_ROOT / ".venv-nemo-gym.lock"  # git-ignored
PYPROJECT = REPO_ROOT / "pyproject.toml"
PYTHON_ENV_VAR = "NEMO_GYM_PYTHON"  # an interpreter to use instead of searching for one
MINIMUM = (3, 13)
NEMO_GYM_REQUIREMENT_PREFIX = "nemo-gym=="
_VERSION_PROBE = "import sys; print('%d.%d' % sys.version_info[:2])"


def _version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [python, "-c", _VERSION_PROBE], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    major, minor = out.stdout.strip().split(".")
    return int(major), int(minor)


def find_python() -> str | None:
    """NEMO_GYM_PYTHON, else the newest pyenv 3.13+, else python3.13/3.14/python3 on PATH, if >= 3.13."""
    candidates = [os.environ.get(PYTHON_ENV_VAR, "")]
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += sorted(glob.glob(str(pyenv_root / "versions" / "3.1[3-9]*" / "bin" / "python")), reverse=True)
    candidates += [shutil.which(name) or "" for name in ("python3.14", "python3.13", "python3")]
    for candidate in candidates:
        if candidate and (version := _version(candidate)) is not None and version >= MINIMUM:
            return candidate
    return None


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def _pip(venv_python: Path, *args: str) -> None:
    subprocess.run([str(venv_python), "-m", "pip", "install", "--quiet", "--no-warn-conflicts", *args], check=True)


def build(python: str) -> Path:
    """The venv's python, building the venv first unless its stamp says it is up to date.

    One build at a time: parallel test workers (pytest-xdist) may each ask for the venv, and the second must wait
    for the first's stamp instead of deleting the venv it is building. The lock is a file beside the venv."""
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _build_unlocked(python)


def _build_unlocked(python: str) -> Path:
    venv_python = VENV_DIR / "bin" / "python"
    wanted = _digest(REQUIREMENTS.read_bytes(), python.encode())
    if not (venv_python.exists() and STAMP.exists() and STAMP.read_text() == wanted):
        _build_venv(python, venv_python)
        STAMP.write_text(wanted)
    gym_rpc_wanted = _digest(PYPROJECT.read_bytes(), wanted.encode())
    if not (GYM_RPC_STAMP.exists() and GYM_RPC_STAMP.read_text() == gym_rpc_wanted):
        _pip(venv_python, "-e", f"{REPO_ROOT}[head]")  # the harness runs `gym-rpc head` too
        GYM_RPC_STAMP.write_text(gym_rpc_wanted)
    return venv_python


def _build_venv(python: str, venv_python: Path) -> None:
    """A new venv with nemo-gym (without its declared dependencies) and the requirements beside it."""
    shutil.rmtree(VENV_DIR, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(VENV_DIR)], check=True)
    lines = [line.strip() for line in REQUIREMENTS.read_text().splitlines()]
    requirements = [line for line in lines if line and not line.startswith("#")]
    nemo_gym = [line for line in requirements if line.startswith(NEMO_GYM_REQUIREMENT_PREFIX)]
    others = [line for line in requirements if not line.startswith(NEMO_GYM_REQUIREMENT_PREFIX)]
    print(f"building {VENV_DIR} with {python} ({len(requirements)} requirements)", file=sys.stderr, flush=True)
    _pip(venv_python, "--no-deps", "--ignore-requires-python", *nemo_gym)
    _pip(venv_python, *others)


def main() -> int:
    python = find_python()
    if python is None:
        print(
            f"SKIP: no Python >= {MINIMUM[0]}.{MINIMUM[1]} found (set {PYTHON_ENV_VAR}, or install one with pyenv)"
        )
        return 0
    print(build(python))
    return 0


if __name__ == "__main__":
    sys.exit(main())
