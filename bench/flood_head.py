"""A hostile head for the scale bench and tests/client/test_follower_bound.py (`python -m bench.flood_head
CONFIG_JSON INSTANCES [quiet]`): a real grpc.aio server that answers GetGlobalConfig with the config document in
the file CONFIG_JSON and, on every status watch, a snapshot and then changes as fast as it can write them, each
relabelling INSTANCES instances of the server `flooded` (which the config names, and which no worker calls);
`quiet` sends the snapshot alone (the same head without the flood, to compare with). It prints `READY {"port": N}`
once it serves, and runs until its stdin closes."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import grpc

from gym_rpc.config import GlobalConfig
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import InstanceReport, StatusReport, convert

FLOODED = "flooded"
SERVICE = "gym_rpc.v1.ControlPlaneService"


def flood_message(
    revision: int, instances: int, kind: pb.WatchEventType.ValueType = pb.WATCH_EVENT_TYPE_CHANGE
) -> bytes:
    report = StatusReport(
        server_name=FLOODED,
        status="success",
        url="http://127.0.0.1:9/",
        instances=tuple(
            InstanceReport(
                instance_id=f"127.0.0.1:{10000 + i}",
                url=f"http://127.0.0.1:{10000 + i}/",
                status="success",
                registration="registered",
                labels={"revision": str(revision), "slot": str(i)},
                origin="registered",
            )
            for i in range(instances)
        ),
    )
    message = pb.WatchServerStatusesResponse(type=kind, revision=revision, reports=[convert.report_to_pb(report)])
    return message.SerializeToString()


async def serve(document: dict[str, Any], instances: int, flood: bool = True) -> None:
    config_answer = convert.global_config_to_pb(
        GlobalConfig.from_document(document), include_secrets=False
    ).SerializeToString()
    # Two messages, alternated: what each costs the follower is converting it, not the head building it.
    changes = [flood_message(2 + i, instances) for i in range(2)]

    async def global_config(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return config_answer

    async def watch(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        yield flood_message(1, instances, pb.WATCH_EVENT_TYPE_SNAPSHOT)
        index = 0
        if not flood:
            await asyncio.Event().wait()  # the quiet head: nothing more, ever
        while True:
            yield changes[index % 2]
            index += 1

    handlers = {
        "GetGlobalConfig": grpc.unary_unary_rpc_method_handler(global_config),
        "WatchServerStatuses": grpc.unary_stream_rpc_method_handler(watch),
    }
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print("READY " + json.dumps({"port": port}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(None)


if __name__ == "__main__":
    document = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    asyncio.run(serve(document, int(sys.argv[2]), flood=sys.argv[3:] != ["quiet"]))
