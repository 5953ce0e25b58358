"""`gym-rpc demo`, the README's first command, as a user runs it: a real subprocess that must exit 0 by itself."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys

from tests.support.cli import CliProcess, run_cli


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


def test_demo_serve_keeps_the_head_and_servers_up_until_ctrl_c():
    """`gym-rpc demo --serve`: after the rollouts the head and servers stay up for the CLI and ServerClient to
    call, until Ctrl-C (exit 130, everything stopped: the head's port refuses afterwards)."""
    demo = CliProcess(["demo", "--rollouts", "5", "--concurrency", "2", "--serve"])
    try:
        match = demo.wait_for_line(re.compile(r"export GYM_RPC_HEAD=(\S+)"), 60)
        address = match.group(1)
        status = run_cli(["status", "--head", address, "-o", "json"])
        assert status.returncode == 0, status.stderr
        assert sorted(row["name"] for row in json.loads(status.stdout)) == ["example_resources", "policy_model"]
        script = (
            "import asyncio\nfrom gym_rpc.client.server_client import ServerClient\n"
            "async def main():\n"
            "    client = ServerClient.load_from_global_config()\n"
            "    response = await client.post('policy_model', '/v1/responses', json={'input': 'hi'})\n"
            "    print(response.status)\n"
            "    await client.aclose()\n"
            "asyncio.run(main())\n"
        )
        call = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "GYM_RPC_HEAD": address},
        )
        assert call.returncode == 0 and call.stdout.strip() == "200", call.stderr
        demo.process.send_signal(signal.SIGINT)
        assert demo.wait(30) == 130
    finally:
        demo.close()
    host, port = address.rsplit(":", 1)
    with socket.socket() as probe:
        assert probe.connect_ex((host, int(port))) != 0  # stopped
