"""`gym-rpc demo`, the README's first command, as a user runs it: a real subprocess that must exit 0 by itself."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_runs_rollouts_end_to_end_and_exits_cleanly():
    result = subprocess.run(
        [sys.executable, "-m", "gym_rpc", "demo", "--rollouts", "60", "--concurrency", "8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"^policy_model\s+responses_api_models\s+http://127\.0\.0\.1:\d+\s+success", out, re.M)
    assert re.search(r"^example_resources\s+resources_servers\s+http://127\.0\.0\.1:\d+\s+success", out, re.M)
    assert "60 rollouts in" in out
    assert "model calls 60, verify calls 60, distinct rollout ids seen by the model server 60" in out
    assert "60/60" in result.stderr  # the progress bar reached the end
    assert "Traceback" not in result.stderr and "Unclosed" not in result.stderr


def test_demo_rejects_a_non_positive_rollout_count():
    result = subprocess.run(
        [sys.executable, "-m", "gym_rpc", "demo", "--rollouts", "0"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "must be at least 1" in result.stderr
