"""What the NeMo Gym harnesses (harness.py, restart.py, sticky.py) share: loopback sockets held from the start,
uvicorn serving ASGI apps on them as NeMo Gym does, a gym_rpc head in its own process, a stub Responses API turn
and NeMo Gym's SimpleAgent. Runs in the NeMo Gym venv with them, never by pytest: no harness imports another.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import uvicorn
import yaml
from nemo_gym.config_types import ModelServerRef, ResourcesServerRef
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from starlette.responses import JSONResponse

LOOPBACK = "127.0.0.1"
MODEL, AGENT = "policy_model", "agent"  # the server names every harness's config gives the model and the agent
HEAD_START_TIMEOUT_SECONDS = 30.0
KEEP_ALIVE_SECONDS = 30  # what NeMo Gym gives uvicorn (timeout_keep_alive): longer than the clients' 15 s pool

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


def stub_turn(body: dict[str, Any], tool: str, arguments: Callable[[], str], text: str) -> JSONResponse:
    """A Responses API model's turn: a call of `tool` with `arguments()`, then, once the input holds the tool's
    output, the message `text`."""
    output: dict[str, Any]
    if any(item.get("type") == "function_call_output" for item in body["input"]):
        content = [{"type": "output_text", "text": text, "annotations": []}]
        output = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "content": content}
    else:
        output = {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": tool,
            "arguments": arguments(),
            "status": "completed",
        }
    response = {"id": "resp_1", "object": "response", "created_at": 0, "model": "stub", "output": [output]}
    return JSONResponse({**response, "parallel_tool_calls": False, "tool_choice": "auto", "tools": []})


def held_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    return sock


@contextlib.contextmanager
def gym_rpc_head(doc: dict[str, Any]) -> Any:
    """A gym_rpc head in its own process; yields its port."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "config.yaml"
        path.write_text(yaml.safe_dump(doc), encoding="utf-8")
        command = [sys.executable, "-m", "gym_rpc", "head", "--config", str(path), "--port", "0"]
        with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
            try:
                assert process.stdout is not None
                line = process.stdout.readline()  # the banner; the head exits (EOF) when it cannot start
                if "listening on" not in line:
                    raise RuntimeError(f"the gym_rpc head did not start: {line!r}")
                address = line.split("listening on", 1)[1].split()[0]
                yield int(address.rsplit(":", 1)[1])
            finally:
                process.terminate()
                process.wait(timeout=HEAD_START_TIMEOUT_SECONDS)


@contextlib.asynccontextmanager
async def serving(apps: dict[str, tuple[Asgi, socket.socket]]) -> AsyncIterator[None]:
    """uvicorn on the held sockets, one server per app, until the block ends. Idle connections are kept 30 s, as
    NeMo Gym runs its servers ("server keepalive > client keepalive"): with uvicorn's default 5 s, under the
    clients' 15 s pool, a pooled connection could be reused just as the server closed it, and the call dropped
    after its request was written (a restart run saw one such drop of a call to the agent)."""
    servers = [
        uvicorn.Server(
            uvicorn.Config(
                app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=KEEP_ALIVE_SECONDS
            )
        )
        for app, _ in apps.values()
    ]
    tasks = [
        asyncio.create_task(server.serve(sockets=[sock]))
        for server, (_, sock) in zip(servers, apps.values(), strict=True)
    ]
    try:
        while not all(server.started for server in servers):
            if any(task.done() for task in tasks):
                raise RuntimeError("a server failed to start")
            await asyncio.sleep(0.02)
        yield
    finally:
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


def simple_agent(port: int, client: Any, resources: str) -> SimpleAgent:
    """NeMo Gym's SimpleAgent on `port`, calling `resources` and the model through `client`."""
    return SimpleAgent.model_construct(
        config=SimpleAgentConfig(
            host=LOOPBACK,
            port=port,
            entrypoint="app.py",
            name=AGENT,
            resources_server=ResourcesServerRef(type="resources_servers", name=resources),
            model_server=ModelServerRef(type="responses_api_models", name=MODEL),
        ),
        server_client=client,
    )
