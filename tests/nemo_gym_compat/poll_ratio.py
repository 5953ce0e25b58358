"""`poll_for_status` against NeMo Gym's real HTTP head: NeMo Gym's own client against gym_rpc's, in one process,
interleaved (tests/nemo_gym/test_ng_run.py): run in the NeMo Gym venv only.

    python poll_ratio.py HEAD_HOST HEAD_PORT SERVER_NAME

Both clients load the config from the head (NeMo Gym's with its `requests.get`, gym_rpc's after finding out once
that the head speaks HTTP), then poll the same server in alternating blocks. Prints one JSON object: each client's
median milliseconds per poll over the blocks, their ratio, and the statuses each saw.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from nemo_gym.config_types import BaseServerConfig as NemoGymServerConfig
from nemo_gym.server_utils import ServerClient as NemoGymServerClient

from gym_rpc.client.server_client import ServerClient

BLOCKS = 30
POLLS_PER_BLOCK = 10


def _block(poll: object, server: str) -> tuple[float, set[str]]:
    statuses = set()
    started = time.perf_counter()
    for _ in range(POLLS_PER_BLOCK):
        statuses.add(poll(server))  # type: ignore[operator]
    return (time.perf_counter() - started) / POLLS_PER_BLOCK * 1e3, statuses


def main() -> int:
    host, port, server = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    nemo_gym = NemoGymServerClient.load_from_global_config(NemoGymServerConfig(host=host, port=port))
    ours = ServerClient.load_from_global_config({"host": host, "port": port})
    clients = {"nemo_gym": nemo_gym.poll_for_status, "gym_rpc": ours.poll_for_status}
    times: dict[str, list[float]] = {name: [] for name in clients}
    seen: dict[str, set[str]] = {name: set() for name in clients}
    for poll in clients.values():  # warm up both: connections, imports
        _block(poll, server)
    for block in range(BLOCKS):
        order = list(clients) if block % 2 == 0 else list(reversed(clients))
        for name in order:
            elapsed, statuses = _block(clients[name], server)
            times[name].append(elapsed)
            seen[name] |= statuses
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(
        json.dumps(
            {
                "median_ms": medians,
                "ratio": medians["gym_rpc"] / medians["nemo_gym"],
                "statuses": {name: sorted(values) for name, values in seen.items()},
                "servers": sorted(ours._global_config.servers),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
