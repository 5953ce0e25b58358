"""Rollouts in Ray actors, each holding a ServerClient it received pickled.

The driver builds one ServerClient (the config comes from the head once) and hands it to every actor. It pickles
without its live state: each actor opens its own aiohttp sessions and control channel on first use, and finds
servers bound to 0.0.0.0 on other nodes at the address they registered with the head.

    pip install 'gym-rpc[ray]'
    python examples/ray_rollouts.py                          # starts a demo head and servers on loopback first
    python examples/ray_rollouts.py --head 10.0.0.5:11000    # a head whose config has the two servers below

On a Ray cluster, set RAY_ADDRESS (or pass --ray-address) and run the same file on the head node.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
from typing import Any

import ray
from aiohttp import web

from gym_rpc.client import ServerClient, rollout_context
from gym_rpc.config import BaseServerConfig, parse_host_port
from gym_rpc.demo import MODEL_SERVER, RESOURCES_SERVER, DemoStats, demo_config, model_app, resources_app
from gym_rpc.server import HeadOptions, HeadServer


class RolloutWorker:
    """One Ray actor: runs rollouts concurrently in its own event loop through the client it was given."""

    def __init__(self, client: ServerClient) -> None:
        self.client = client  # unpickled here: no sessions or channels yet

    async def rollout(self, task_id: str) -> float:
        with rollout_context(task_id):  # /ng-rollout/<task_id> on the model and resources calls
            response = await self.client.post(MODEL_SERVER, "/v1/responses", json={"input": task_id})
            answer = (await response.json())["output"][0]["content"]
            verdict = await self.client.post(RESOURCES_SERVER, "/verify", json={"response": answer})
            return float((await verdict.json())["reward"])

    async def run(self, task_ids: list[str]) -> dict[str, Any]:
        rewards = await asyncio.gather(*(self.rollout(task_id) for task_id in task_ids))
        await self.client.aclose()  # this actor's loop's sessions
        return {"pid": os.getpid(), "rewards": rewards}


def run_rollouts(client: ServerClient, workers: int, rollouts_per_worker: int) -> list[dict[str, Any]]:
    """Start `workers` actors, each with the (pickled) client, and run their rollouts; Ray must be initialised."""
    actor_class = ray.remote(num_cpus=0)(RolloutWorker)
    actors = [actor_class.remote(client) for _ in range(workers)]
    batches = [[f"worker{w}-task{t}" for t in range(rollouts_per_worker)] for w in range(workers)]
    return list(ray.get([actor.run.remote(batch) for actor, batch in zip(actors, batches, strict=True)]))


def start_demo_servers() -> str:
    """A head plus the demo model and resources servers on loopback, served by a background thread."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def start() -> str:
        ports = []
        for app in (model_app(DemoStats()), resources_app(DemoStats())):
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            ports.append(int(runner.addresses[0][1]))
        head = HeadServer(demo_config(*ports), HeadOptions(probe_interval_seconds=0.5))
        await head.start()
        return head.address

    return asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", metavar="HOST:PORT", help="a running head (default: start a demo one)")
    parser.add_argument("--ray-address", help="an existing Ray cluster (default: RAY_ADDRESS, else a local one)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=25, help="rollouts per worker")
    args = parser.parse_args()

    host, port = parse_host_port(args.head or start_demo_servers(), "--head")
    client = ServerClient.load_from_global_config(BaseServerConfig(host=host, port=port))
    ray.init(address=args.ray_address, include_dashboard=False)
    try:
        results = run_rollouts(client, args.workers, args.rollouts)
    finally:
        ray.shutdown()
    rewards = [reward for result in results for reward in result["rewards"]]
    print(f"{len(rewards)} rollouts in {len(results)} actors (pids {sorted(r['pid'] for r in results)})")
    print(f"mean reward {sum(rewards) / len(rewards):.2f}")


if __name__ == "__main__":
    main()
