"""NeMo Gym's real HTTP head, as `ng_run` starts it, for tests/nemo_gym/test_ng_run.py: run in the NeMo Gym venv
only.

    python nemo_gym_head.py CONFIG.yaml

The config is handed over as `ng_run` hands it to its servers (NEMO_GYM_CONFIG_DICT), so NeMo Gym's own
`HeadServer.run_webserver()` serves it on its `head_server` port with its own uvicorn settings and log format. The
instances it lists are one row per server, as `ng_run` records them. It prints `ready` once it serves, and stops
when its stdin closes. Every log line uvicorn writes (its access lines go to stdout) lands on stderr, which the
test reads for errors and warnings.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import yaml

START_TIMEOUT_SECONDS = 30.0


def main() -> int:
    ready = os.fdopen(os.dup(1), "w")  # the test reads `ready` here; stdout itself now goes to stderr
    os.dup2(2, 1)
    text = Path(sys.argv[1]).read_text(encoding="utf-8")
    os.environ["NEMO_GYM_CONFIG_DICT"] = text
    from nemo_gym.server_utils import HeadServer  # reads the config injected above

    uvicorn_server, thread, head = HeadServer.run_webserver()
    instances = []
    for name, block in yaml.safe_load(text).items():
        if name == "head_server" or not isinstance(block, dict):
            continue
        ((server_type, impls),) = block.items()
        ((impl_name, entry),) = impls.items()
        url = f"http://{entry['host']}:{entry['port']}"
        instances.append(
            {
                "process_name": name,
                "server_type": server_type,
                "name": impl_name,
                "host": entry["host"],
                "port": entry["port"],
                "url": url,
                "entrypoint": "app.py",
                "pid": os.getpid(),
                "start_time": time.time(),
            }
        )
    head.set_server_instances(instances)
    head.mark_ready()
    started = time.monotonic()
    while not uvicorn_server.started:
        if time.monotonic() - started > START_TIMEOUT_SECONDS or not thread.is_alive():
            print("NeMo Gym's head did not start", file=sys.stderr)
            return 1
        time.sleep(0.01)
    print("ready", file=ready, flush=True)
    sys.stdin.read()  # until the test closes it
    uvicorn_server.should_exit = True
    thread.join(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
