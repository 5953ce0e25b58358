"""`python -m bench.registration_cost`: what a registration and a probe round cost a head holding 1,500 registered
instances (issue 43, point 1), as one server of 1,500 and as 15 servers of 100 (the caps raised for the bench).

* registration: the median time of a RegisterServerInstance that changes one instance (a label), which the head
  hands to the prober and the watches: the work that grew with every instance of the server.
* probe round: the head's CPU per background round (process CPU over rounds, nothing else running), every instance
  at a closed loopback port (refused at once, so the round is the head's own work).

Prints markdown rows; run it on two commits to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.config import GlobalConfig
from gym_rpc.server import HeadOptions, HeadServer

LOOPBACK = "127.0.0.1"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _document(names: int, total: int) -> dict[str, Any]:
    doc: dict[str, Any] = {"head_server": {"host": LOOPBACK, "port": 0}}
    try:
        from gym_rpc.config import RegistrationSettings

        if "max_instances" in RegistrationSettings.model_fields:  # a head with caps: raised for the bench
            doc["head_server"]["registration"] = {
                "max_instances_per_server": total,
                "max_instances": total,
                "max_instances_per_client": total,
                "registrations_per_second": 1e6,
                "registration_burst": 10 * total,
            }
    except ImportError:
        pass
    for n in range(names):
        doc[f"s{n}"] = {"responses_api_models": {"impl": {"host": LOOPBACK, "port": _closed_port()}}}
    return doc


async def measure(names: int, total: int, calls: int, rounds: int) -> tuple[float, float]:
    """(registration median ms, head CPU ms per probe round)."""
    doc = _document(names, total)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "gym.yaml"
        path.write_text(yaml.safe_dump(doc))
        head = HeadServer(
            GlobalConfig.from_document(doc),
            HeadOptions(port=0, probe_interval_seconds=3600, probe_timeout_seconds=1.0),
            config_path=path,
        )
        await head.start()
        try:
            client = ControlClient(f"{LOOPBACK}:{head.port}")
            per = total // names

            async def register(i: int, labels: dict[str, str] | None = None) -> None:
                await client.register_server_instance(
                    f"s{i // per}",
                    listen_port=20000 + i,
                    listen_host=LOOPBACK,
                    pid=10 + i,
                    labels=labels,
                    timeout=120,
                )

            for start in range(0, total, 100):
                await asyncio.gather(*(register(i) for i in range(start, min(total, start + 100))))
            await head.prober.probe_all()  # every instance probed once
            times = []
            for k in range(calls):
                started = time.perf_counter()
                await register(total - 1, {"turn": str(k)})
                times.append(time.perf_counter() - started)
            cpu = []
            for _ in range(rounds):
                started = time.process_time()
                await _round(head)
                cpu.append(time.process_time() - started)
            return statistics.median(times) * 1e3, statistics.median(cpu) * 1e3
        finally:
            await head.stop()


async def _round(head: HeadServer) -> None:
    """One whole background round: every instance due (its result older than the window)."""
    prober = head.prober
    prober.default_max_age_seconds = 0.0
    await prober.probe_all()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print("| layout | registration p50 | head CPU per probe round |")
    print("| --- | --- | --- |")
    for names in (1, 15):
        registration, cpu = asyncio.run(measure(names, 1500, args.calls, args.rounds))
        print(
            f"| 1,500 instances as {names} server(s) of {1500 // names} | {registration:.1f} ms | {cpu:.0f} ms |"
        )


if __name__ == "__main__":
    main()
