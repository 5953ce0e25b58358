"""Rollouts in Ray actors over replicas of a stateful resources server, one of which is killed mid-run.

The driver starts a demo head and model server, then N replicas of a resources server as Ray actors: each serves
on an address of its own and registers itself with the head under the server's one name. Rollout workers (Ray
actors too) each get a ServerClient pickled; each follows the head's instances in its own process and sticks
every rollout to one replica (rendezvous hashing), where `/seed_session` keeps the rollout's state that
`/verify` needs. Halfway, one replica actor is killed: the rollouts it held move to other replicas (only those),
start again there (their state died with it), and every rollout still ends with its reward.

    pip install 'gym-rpc[ray]'
    python examples/ray_rollouts.py                          # 3 replicas, 4 workers, 25 rollouts each
    python examples/ray_rollouts.py --replicas 4 --workers 8

On a Ray cluster, set RAY_ADDRESS (or pass --ray-address) and run the same file on the head node; the replicas
then register the addresses their nodes are reached at.

Without an address, ray.init starts a local Ray from this process, which already serves a head and follows it:
gRPC's fork support is turned off first (docs/multi-host.md says why), before anything imports grpc.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # before the imports below, which load grpc

import argparse
import asyncio
import socket
import threading
import time
from typing import Any

import ray
from aiohttp import web

from gym_rpc.cli.demo import MODEL_SERVER, RESOURCES_SERVER, DemoStats, demo_config, model_app
from gym_rpc.client import ServerClient, rollout_context
from gym_rpc.config import BaseServerConfig, parse_host_port
from gym_rpc.integrations import ServerRegistration, TraceContextPathMiddleware
from gym_rpc.server import HeadOptions, HeadServer

LOOPBACK = "127.0.0.1"
# The replicas keep ServerRegistration's default renewal (every 10 s, on a lease of 30 s). A short lease does not
# take a killed replica out of rotation any sooner: the head's next probe finds it refusing (within one probe
# interval) and each worker's own refused call moves the rollouts pinned to it at once; the lease only clears a
# process gone without deregistering off the head's list. What a short lease does do is drop live replicas: with
# renewals every 0.5 s (a 1.5 s lease), a replica whose renewal came a second late on a busy node (this example
# on a loaded 2-core machine) was dropped dozens of times in two minutes, and each drop moved the rollouts pinned
# to it to another replica, where they started over. Size a lease for the slowest renewal you expect.
MAX_ATTEMPTS = 3  # a rollout whose replica died under it starts again (its state is gone), at most this often


def stateful_resources_app(replica: str, seeded: set[str]) -> web.Application:
    """A resources server that keeps each rollout's state in this process: `/seed_session` starts it, `/verify`
    needs it (409 when the rollout was seeded on another replica, or on one that died)."""

    async def seed_session(request: web.Request) -> web.Response:
        seeded.add(request.get("rollout_id", ""))  # from the /ng-rollout/<id> prefix (TraceContextPathMiddleware)
        return web.json_response({"replica": replica})

    async def verify(request: web.Request) -> web.Response:
        if request.get("rollout_id") not in seeded:
            return web.json_response({"error": "rollout not seeded here", "replica": replica}, status=409)
        body = await request.json()
        reward = 1.0 if str(body.get("response", "")).startswith("echo:") else 0.0
        return web.json_response({"reward": reward, "replica": replica})

    async def alive(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = TraceContextPathMiddleware.install(web.Application())
    app.router.add_get("/", alive)
    app.router.add_post("/seed_session", seed_session)
    app.router.add_post("/verify", verify)
    return app


class ResourcesReplica:
    """One Ray actor: one replica of the resources server, registered with the head while it lives."""

    def __init__(self, head: str, port: int = 0) -> None:
        self.head = head
        self.port = port  # 0: any free port (the config's own address for the first replica)
        self.seeded: set[str] = set()
        self._running: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Serve, register (and keep renewing), and return this replica's address."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, self.port))
        self.port = int(sock.getsockname()[1])
        replica = f"{LOOPBACK}:{self.port}"
        runner = web.AppRunner(stateful_resources_app(replica, self.seeded), access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        host, head_port = parse_host_port(self.head, "head")
        registration = ServerRegistration(
            RESOURCES_SERVER,
            self.port,
            listen_host=LOOPBACK,
            head=BaseServerConfig(host=host, port=head_port),
        )
        registered = asyncio.Event()

        async def registered_while_alive() -> None:
            async with registration:  # registers, renews every 10 s, deregisters on the way out
                registered.set()
                await asyncio.Event().wait()

        self._running = asyncio.create_task(registered_while_alive())
        await registered.wait()
        return replica

    async def rollouts_seeded(self) -> int:
        return len(self.seeded)


class RolloutWorker:
    """One Ray actor: runs rollouts concurrently in its own event loop through the client it was given."""

    def __init__(self, client: ServerClient) -> None:
        self.client = client  # unpickled here: no sessions, channels or follower yet

    async def rollout(self, task_id: str) -> dict[str, Any]:
        """Seed, ask the model, verify; start again if the replica holding the rollout's state died meanwhile."""
        with rollout_context(task_id):  # /ng-rollout/<task_id> on every call, and the key the rollout sticks by
            replicas = []
            for attempt in range(1, MAX_ATTEMPTS + 1):
                seeded = await self.client.post(RESOURCES_SERVER, "/seed_session", json={})
                replicas.append((await seeded.json())["replica"])
                response = await self.client.post(MODEL_SERVER, "/v1/responses", json={"input": task_id})
                answer = (await response.json())["output"][0]["content"]
                verdict = await self.client.post(RESOURCES_SERVER, "/verify", json={"response": answer})
                result = await verdict.json()
                if verdict.status != 409:
                    return {"reward": float(result["reward"]), "replicas": replicas, "attempts": attempt}
            raise RuntimeError(f"{task_id}: no replica kept its state in {MAX_ATTEMPTS} attempts")

    async def run(self, task_ids: list[str], pause_seconds: float = 0.0) -> dict[str, Any]:
        async def paced(index: int, task_id: str) -> dict[str, Any]:
            await asyncio.sleep(index * pause_seconds)  # rollouts spread over the run, so the kill lands mid-run
            return await self.rollout(task_id)

        results = await asyncio.gather(*(paced(i, task_id) for i, task_id in enumerate(task_ids)))
        await self.client.aclose()  # this actor's loop's sessions
        return {"pid": os.getpid(), "results": results}


def start_replicas(head: str, count: int, first_port: int) -> tuple[list[Any], list[str]]:
    """`count` replica actors, the first at the config's own address; Ray must be initialised."""
    actor_class = ray.remote(num_cpus=0)(ResourcesReplica)
    actors = [actor_class.remote(head, first_port if index == 0 else 0) for index in range(count)]
    addresses = list(ray.get([actor.start.remote() for actor in actors]))
    return actors, addresses


def run_rollouts(
    client: ServerClient,
    workers: int,
    rollouts_per_worker: int,
    *,
    replicas: list[Any] | None = None,
    kill_after_seeded: int = 0,
    pause_seconds: float = 0.02,
) -> list[dict[str, Any]]:
    """Start `workers` actors, each with the (pickled) client, and run their rollouts; with `replicas`, the
    second replica actor is killed once it holds `kill_after_seeded` rollouts (mid-run)."""
    actor_class = ray.remote(num_cpus=0)(RolloutWorker)
    actors = [actor_class.remote(client) for _ in range(workers)]
    batches = [[f"worker{w}-task{t}" for t in range(rollouts_per_worker)] for w in range(workers)]
    futures = [actor.run.remote(batch, pause_seconds) for actor, batch in zip(actors, batches, strict=True)]
    if replicas is not None:
        victim = replicas[1]
        while ray.get(victim.rollouts_seeded.remote()) < kill_after_seeded and ray.wait(futures, timeout=0)[1]:
            time.sleep(0.02)
        ray.kill(victim)  # its process ends at once, as with kill -9: no deregistration, no drain
    return list(ray.get(futures))


def start_demo_head(resources_port: int) -> str:
    """A head plus the demo model server on loopback, served by a background thread. The resources server's
    entry points at `resources_port`, where the first replica will serve; the others register addresses of
    their own."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def start() -> str:
        runner = web.AppRunner(model_app(DemoStats()), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, LOOPBACK, 0).start()
        model_port = int(runner.addresses[0][1])
        head = HeadServer(demo_config(model_port, resources_port), HeadOptions(probe_interval_seconds=0.25))
        await head.start()
        return head.address

    return asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def summary(results: list[dict[str, Any]], killed: str) -> dict[str, Any]:
    """What the run shows: every reward, where rollouts ran, which moved."""
    rollouts = [rollout for result in results for rollout in result["results"]]
    moved = [rollout for rollout in rollouts if len(set(rollout["replicas"])) > 1]
    per_replica: dict[str, int] = {}
    for rollout in rollouts:
        per_replica[rollout["replicas"][-1]] = per_replica.get(rollout["replicas"][-1], 0) + 1
    return {
        "rollouts": len(rollouts),
        "rewards": [rollout["reward"] for rollout in rollouts],
        "moved": len(moved),
        "moved_off_the_killed_one": sum(1 for rollout in moved if rollout["replicas"][0] == killed),
        "finished_on": per_replica,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray-address", help="an existing Ray cluster (default: RAY_ADDRESS, else a local one)")
    parser.add_argument("--replicas", type=int, default=3, help="replicas of the resources server (at least 2)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=25, help="rollouts per worker")
    args = parser.parse_args()

    resources_port = free_port()
    head = start_demo_head(resources_port)
    host, port = parse_host_port(head, "head")
    client = ServerClient.load_from_global_config(BaseServerConfig(host=host, port=port))
    ray.init(address=args.ray_address, include_dashboard=False)
    try:
        replicas, addresses = start_replicas(head, max(2, args.replicas), resources_port)
        print(f"replicas of {RESOURCES_SERVER}: {', '.join(addresses)}; killing {addresses[1]} mid-run")
        results = run_rollouts(client, args.workers, args.rollouts, replicas=replicas, kill_after_seeded=3)
    finally:
        ray.shutdown()
    seen = summary(results, addresses[1])
    mean = sum(seen["rewards"]) / len(seen["rewards"])
    print(f"{seen['rollouts']} rollouts in {len(results)} actors, mean reward {mean:.2f}")
    print(f"{seen['moved']} moved ({seen['moved_off_the_killed_one']} off the killed replica); finished on:")
    for replica, count in sorted(seen["finished_on"].items()):
        print(f"  {replica}: {count}")


if __name__ == "__main__":
    main()
