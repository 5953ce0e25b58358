"""gym_rpc's ServerClient as a drop-in for NeMo Gym's, proven with NeMo Gym's own code.

tests/nemo_gym_compat/harness.py runs in a venv of its own (Python >= 3.13, `nemo-gym` from the package registry;
built once by tools/nemo_gym_venv.py): NeMo Gym's real SimpleAgent and example_session_state_mgmt resources server,
a stub Responses API model server and a gym_rpc head. The same rollouts go through `/run` with NeMo Gym's own
ServerClient and with gym_rpc's injected (given NeMo Gym's own BaseServerConfig for the head), observability off
and on. Every server must see the same paths, with the session cookie on the same calls, and the same rewards.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests.support import REPO_ROOT
from tests.support.nemo_gym import BUILD_TIMEOUT_SECONDS

HARNESS = REPO_ROOT / "tests" / "nemo_gym_compat" / "harness.py"
RESTART_HARNESS = REPO_ROOT / "tests" / "nemo_gym_compat" / "restart.py"
STICKY_HARNESS = REPO_ROOT / "tests" / "nemo_gym_compat" / "sticky.py"
STICKY_TIMEOUT_SECONDS = 240  # six modes of 96 rollouts: 16-60 s on a 2-core machine, idle to loaded
RESTART_TIMEOUT_SECONDS = 600  # three modes, each starting NeMo Gym's servers afresh, on a loaded 2-core machine
HARNESS_TIMEOUT_SECONDS = 240

# What NeMo Gym's own client makes every server see for rollouts (task 0, rollout 0), (0, 1), (1, 0): each rollout
# is /run on the agent, /seed_session on the resources server, the agent's call to itself, two model turns, one
# tool call and /verify. [path, whether the resources server's session cookie came with the request].
AGENT_PATHS = {
    "off": ["/run", "/v1/responses"],
    "on": ["/run", "/ng-rollout/{id}/v1/responses"],
}
MODEL_PATHS = {"off": ["/v1/responses"] * 2, "on": ["/ng-rollout/{id}/v1/responses"] * 2}
RESOURCES_PATHS = {
    "off": ["/seed_session", "/increment_counter", "/verify"],
    # The tool call is made by the agent's self-called /v1/responses, where no rollout is bound: unprefixed.
    "on": ["/ng-rollout/{id}/seed_session", "/increment_counter", "/ng-rollout/{id}/verify"],
}
ROLLOUT_IDS = ("0-0", "0-1", "1-0")


def expected_seen(observability: str) -> dict[str, list[list[Any]]]:
    def paths(templates: list[str], cookies: list[bool]) -> list[list[Any]]:
        return [
            [template.format(id=rollout_id), cookie]
            for rollout_id in ROLLOUT_IDS
            for template, cookie in zip(templates, cookies, strict=True)
        ]

    return {
        "policy_model": paths(MODEL_PATHS[observability], [False, False]),
        "counter": paths(RESOURCES_PATHS[observability], [False, True, True]),
        "agent": paths(AGENT_PATHS[observability], [False, True]),
    }


def run_harness(command: list[str], timeout_seconds: float) -> dict[str, Any]:
    """Run a harness in the NeMo Gym venv: the JSON object on its last line."""
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout_seconds, cwd=REPO_ROOT)
    assert run.returncode == 0, f"the NeMo Gym harness {command[1:]} failed:\n{run.stderr[-6000:]}"
    results: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return results


@pytest.fixture(scope="module")
def harness_results(nemo_gym_python: str) -> dict[str, Any]:
    return run_harness([nemo_gym_python, str(HARNESS)], HARNESS_TIMEOUT_SECONDS)


@pytest.mark.timeout(BUILD_TIMEOUT_SECONDS + HARNESS_TIMEOUT_SECONDS)
@pytest.mark.parametrize("observability", ["off", "on"])
def test_nemo_gym_client_baseline(harness_results: dict[str, Any], observability: str) -> None:
    """NeMo Gym's own client: the reference the comparison below rests on (and a check of the harness itself)."""
    mode = harness_results[f"nemo_gym/{observability}"]
    assert mode["rewards"] == [1.0, 1.0, 0.0]
    assert mode["seen"] == expected_seen(observability)


@pytest.mark.timeout(BUILD_TIMEOUT_SECONDS + HARNESS_TIMEOUT_SECONDS)
@pytest.mark.parametrize("observability", ["off", "on"])
def test_gym_rpc_client_is_a_drop_in(harness_results: dict[str, Any], observability: str) -> None:
    """gym_rpc's client injected into NeMo Gym's servers: the same rewards, paths and cookies, hop for hop."""
    ours, theirs = harness_results[f"gym_rpc/{observability}"], harness_results[f"nemo_gym/{observability}"]
    assert ours["rewards"] == theirs["rewards"] == [1.0, 1.0, 0.0]
    for server in ("policy_model", "counter", "agent"):
        assert ours["seen"][server] == theirs["seen"][server], server
    assert ours["seen"] == expected_seen(observability)


@pytest.fixture(scope="module")
def restart_results(nemo_gym_python: str) -> dict[str, Any]:
    return run_harness([nemo_gym_python, str(RESTART_HARNESS), "run"], RESTART_TIMEOUT_SECONDS)


@pytest.mark.timeout(BUILD_TIMEOUT_SECONDS + RESTART_TIMEOUT_SECONDS)
def test_a_resources_server_killed_and_back_a_second_later_costs_no_rollout(
    restart_results: dict[str, Any],
) -> None:
    """NeMo Gym's SimpleAgent and weather server, gym_rpc's client with its default settings, 64 rollouts at a
    time: `kill -9` of the resources server halfway and the server back on its port 1 s later cost no rollout.
    Budgets of 0.2 s, shorter than the restart (as gym_rpc's 3 attempts from 0.05 s were), lose rollouts to it."""
    restart, short = restart_results["restart"], restart_results["restart-short"]
    assert restart["killed"] and 0.9 < restart["back_after_seconds"] < 30
    assert (restart["answered"], restart["failed"], restart["hung"]) == (restart["rollouts"], [], 0)
    summary = {key: value for key, value in short.items() if key != "failed"}
    assert short["killed"] and short["failed"] and short["hung"] == 0, summary  # the restart is felt: can fail


@pytest.mark.timeout(BUILD_TIMEOUT_SECONDS + RESTART_TIMEOUT_SECONDS)
def test_a_resources_server_that_never_returns_fails_every_rollout_within_its_budget(
    restart_results: dict[str, Any],
) -> None:
    """Killed for good, with a 2 s budget for every kind from the config: each rollout that needs the server fails
    (its /run answers 500) within its budget, none hangs, and the rollouts done before the kill kept their
    rewards."""
    gone = restart_results["gone"]
    assert gone["killed"] and gone["hung"] == 0
    assert gone["rollouts"] // 4 <= gone["answered"] < gone["rollouts"]
    assert len(gone["failed"]) == gone["rollouts"] - gone["answered"]
    assert gone["failed_started_after_kill"] == gone["started_after_kill"] > 0  # nothing after the kill answered
    for failed in gone["failed"]:
        assert failed.get("status") == 500, failed
        # The call that failed had 2 s; the rollout's other calls and a loaded machine take the rest.
        assert failed["seconds"] < 2 * gone["budget_seconds"] + 20, failed


STICKY_MODES = (
    "static/off",
    "static/on",
    "registered/off",
    "registered/on",
    "registered-relisted/off",
    "registered-relisted/on",
)
STICKY_ROLLOUTS = 96


@pytest.fixture(scope="module")
def sticky_results(nemo_gym_python: str) -> dict[str, Any]:
    command = [nemo_gym_python, str(STICKY_HARNESS), "--modes", ",".join(STICKY_MODES)]
    command += ["--rollouts", str(STICKY_ROLLOUTS), "--concurrency", "48"]
    return run_harness(command, STICKY_TIMEOUT_SECONDS)


@pytest.mark.timeout(BUILD_TIMEOUT_SECONDS + STICKY_TIMEOUT_SECONDS)
@pytest.mark.parametrize("mode", STICKY_MODES)
def test_every_call_of_a_rollout_reaches_one_instance_of_the_resources_server(
    sticky_results: dict[str, Any], mode: str
) -> None:
    """Issue 39, point 0: NeMo Gym's SimpleAgent with gym_rpc's client, the weather server as three instances
    (static `replicas:`, or three registrations followed from a head), observability off and on, 96 rollouts at
    48 at once. Counted on the servers' side: each rollout's /seed_session (known by its body, or NeMo Gym's
    context), /get_weather (by the session cookie alone) and /verify (by its body, or the context, and the cookie)
    reached one instance, and the rollouts spread over all three. The old client split 57-66 of 96 rollouts.

    Relisted: while the first 48 rollouts wait between their /seed_session and their /get_weather, a registered
    instance holding 14-23 of their sessions deregisters and registers again at its address (a lapsed lease
    renewed), and the client follows it off the list and back. Its sessions stay with it: before the client took
    such an instance back as the one it was, 11-16 of 96 rollouts split (their later calls moved)."""
    result = sticky_results[mode]
    if mode.startswith("registered-relisted/"):
        assert result["relisted"]["sessions"] > 0, result["relisted"]
    assert result["route_instances"] == 3
    assert (result["incomplete"], result["unexpected"]) == ([], [])
    assert result["rewarded"] == result["rollouts"] == STICKY_ROLLOUTS
    assert result["split"] == [], f"{len(result['split'])} rollouts split; relisted: {result['relisted']}"
    assert len(result["per_instance"]) == 3 and sum(result["per_instance"].values()) == 3 * STICKY_ROLLOUTS
