"""A real server process that registers with a head (tests of the status page): an aiohttp app on a port,
registered through gym_rpc.integrations with labels, renewing every 0.5 s.

    python tests/support/scenarios/registering_server.py NAME HEAD_ADDRESS PORT LABELS_JSON [RELABEL_JSON]

On SIGUSR1 it takes RELABEL_JSON as its labels and registers again at once (a relabel, as a refit would).
Prints `serving PORT` once registered.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

from aiohttp import web

from gym_rpc.integrations import register_aiohttp_app


async def main(name: str, head: str, port: int, labels: dict[str, str], relabel: dict[str, str]) -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", ok)
    registration = register_aiohttp_app(
        app, name, port, head=head, listen_host="127.0.0.1", labels=labels, refresh_seconds=0.5
    )
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    loop = asyncio.get_running_loop()

    tasks: set[asyncio.Task[bool]] = set()

    def relabelled() -> None:
        registration.labels = relabel
        task = loop.create_task(asyncio.to_thread(registration.register))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    loop.add_signal_handler(signal.SIGUSR1, relabelled)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print(f"serving {port}", flush=True)
    await stop.wait()
    await runner.cleanup()


if __name__ == "__main__":
    name, head, port, labels = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    relabel = json.loads(sys.argv[5]) if len(sys.argv) > 5 else labels
    asyncio.run(main(name, head, port, labels, relabel))
