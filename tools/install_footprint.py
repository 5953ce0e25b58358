"""What the base install of gym_rpc costs: packages and megabytes, and the time and memory of importing the client.

Builds the wheel from this checkout, installs it into a fresh venv outside the repository (pip may use its local
cache), and measures there:

* the packages `pip install gym-rpc` brings (gym-rpc itself included; pip and setuptools, which every venv has,
  not) and the megabytes their installed files take;
* `import gym_rpc.client.server_client` in fresh interpreters: the median wall time of the import and the median
  resident memory after it (VmRSS), over `--runs` processes.

The README's figures come from this command. tests/project/test_packaging.py uses its functions for the fresh-venv
checks.

    python tools/install_footprint.py [--runs 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
IMPORTED = "gym_rpc.client.server_client"
VENV_TOOLS = {"pip", "setuptools", "wheel", "distribute"}  # in every venv: not part of what gym-rpc brings
_PIP_TIMEOUT_SECONDS = 900

_SIZES = """
import importlib.metadata as metadata, json, os
sizes = {}
for dist in metadata.distributions():
    total = 0
    for file in dist.files or ():
        try:
            total += os.path.getsize(file.locate())
        except OSError:
            pass
    sizes[dist.metadata["Name"].lower().replace("_", "-")] = total
print(json.dumps(sizes))
"""

_IMPORT = f"""
import json, time
started = time.perf_counter()
import {IMPORTED}
seconds = time.perf_counter() - started
rss_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
print(json.dumps({{"seconds": seconds, "rss_mb": rss_kb / 1024}}))
"""


def build_wheel(out_dir: Path) -> Path:
    """The wheel of this checkout, built without its dependencies."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out_dir), str(REPO_ROOT)],
        check=True,
        timeout=_PIP_TIMEOUT_SECONDS,
        capture_output=True,
    )
    return next(out_dir.glob("gym_rpc-*.whl"))


def fresh_venv(path: Path) -> Path:
    """A new venv at `path` (from the interpreter running this), and its python."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    return path / "bin" / "python"


def install(python: Path, *requirements: str) -> None:
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-warn-conflicts", *requirements],
        check=True,
        timeout=_PIP_TIMEOUT_SECONDS,
        capture_output=True,
    )


def installed_sizes(python: Path) -> dict[str, int]:
    """Package name -> bytes of its installed files, for everything but the venv's own tools."""
    listed = subprocess.run([str(python), "-c", _SIZES], capture_output=True, text=True, check=True, timeout=120)
    sizes: dict[str, int] = json.loads(listed.stdout)
    return {name: size for name, size in sizes.items() if name not in VENV_TOOLS}


def import_cost(python: Path, runs: int) -> tuple[float, float]:
    """Median seconds and median MB of resident memory of importing the client, over `runs` fresh processes."""
    seconds, rss = [], []
    for _ in range(runs):
        measured = subprocess.run(
            [str(python), "-c", _IMPORT], capture_output=True, text=True, check=True, timeout=120
        )
        figures = json.loads(measured.stdout)
        seconds.append(figures["seconds"])
        rss.append(figures["rss_mb"])
    return statistics.median(seconds), statistics.median(rss)


def _biggest_first(item: tuple[str, int]) -> int:
    return -item[1]


def measure(runs: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="gym-rpc-footprint-") as scratch:
        folder = Path(scratch)
        wheel = build_wheel(folder / "dist")
        python = fresh_venv(folder / "venv")
        install(python, str(wheel))
        sizes = installed_sizes(python)
        seconds, rss_mb = import_cost(python, runs)
    return {
        "packages": len(sizes),
        "megabytes": round(sum(sizes.values()) / 1e6, 1),
        "import_seconds": round(seconds, 3),
        "import_rss_mb": round(rss_mb, 1),
        "by_package_mb": {name: round(size / 1e6, 1) for name, size in sorted(sizes.items(), key=_biggest_first)},
        "load": Path("/proc/loadavg").read_text().split()[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="fresh interpreters to time the import in")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args()
    figures = measure(args.runs)
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"base install: {figures['packages']} packages, {figures['megabytes']} MB")
    print(
        f"import {IMPORTED}: {figures['import_seconds']} s, {figures['import_rss_mb']} MB RSS "
        f"(medians of {args.runs} fresh processes; load average {figures['load']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
