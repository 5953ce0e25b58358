"""What a data-plane call keeps alive: `ServerClient.post(json=)` against raw aiohttp + orjson, counted, not timed.

A call's objects that live while it waits for its answer are what the garbage collector pays for: they count
towards its next young collection, and with thousands of calls in flight they outlive young collections, are
promoted, and make full collections come sooner (each one scanning the whole live heap). So `calls` calls are
started at once against the data server's `/slow`, which holds each answer for a few seconds, on connections
already pooled; once all of them wait for their answers, two counts are taken against the same counts before:
the objects the collector tracks (`gc.get_objects()`) and the memory blocks in use (`sys.getallocatedblocks()`:
strings, bytes and buffers too). The collector is off while counting (a collection would move the counts) and on
again after. The counts are deterministic to a fraction of an object per call, where the timed rows scatter by
percents: the figure that tells a real gain from noise on a loaded machine.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson

from bench.data_plane import JSON_HEADERS, PAYLOAD, POOL, SERVER_NAME, make_client, raw_session
from bench.stats import Row, median
from gym_rpc.client.data._http import Call as OneCall
from gym_rpc.client.data._http import close_http_sessions, json_payload, send
from gym_rpc.client.resend import BACKPRESSURE_STATUSES

Call = Callable[[], Awaitable[None]]
# The goal (DESIGN's performance targets): what ServerClient.post keeps alive beyond raw aiohttp's.
MAX_EXTRA_OBJECTS = 10


@dataclass(frozen=True)
class AllocationPlan:
    calls: int = 256  # in flight at once (each on its own pooled connection)
    hold_seconds: float = 4.0  # how long the server holds each answer: the time to count in
    repeats: int = 3  # counts per side, interleaved; the median is the figure


QUICK_ALLOCATIONS = AllocationPlan(calls=32, hold_seconds=2.0, repeats=1)


@dataclass(frozen=True)
class Held:
    """Per call in flight: objects the collector tracks, and memory blocks in use."""

    objects: float
    blocks: float


def _counts() -> tuple[int, int]:
    return len(gc.get_objects()), sys.getallocatedblocks()


async def held_per_call(call: Call, calls: int, hold_seconds: float) -> Held:
    """`calls` calls started at once, counted once every one waits for its answer (the counts stop moving)."""
    await asyncio.gather(*(call() for _ in range(calls)))  # warm: `calls` pooled connections, caches filled
    gc.collect()
    gc.disable()
    try:
        objects_before, blocks_before = _counts()
        tasks = [asyncio.ensure_future(call()) for _ in range(calls)]
        counts, settled = _counts(), 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hold_seconds * 0.75
        while settled < 3 and loop.time() < deadline:
            await asyncio.sleep(0.05)
            now = _counts()
            settled = settled + 1 if now == counts else 0
            counts = now
    finally:
        gc.enable()
    await asyncio.gather(*tasks)
    if settled < 3:
        raise RuntimeError(f"the counts of {calls} calls in flight did not settle within {hold_seconds * 0.75} s")
    return Held((counts[0] - objects_before) / calls, (counts[1] - blocks_before) / calls)


async def run(port: int, plan: AllocationPlan) -> list[Row]:
    client = make_client(port)
    session = raw_session()
    path = f"/slow?seconds={plan.hold_seconds:g}"
    url = f"http://127.0.0.1:{port}{path}"

    async def ours() -> None:
        async with await client.post(SERVER_NAME, path, json=PAYLOAD) as response:
            orjson.loads(await response.read())

    async def raw() -> None:
        async with session.post(url, data=orjson.dumps(PAYLOAD), headers=JSON_HEADERS) as response:
            orjson.loads(await response.read())

    ours_held: list[Held] = []
    raw_held: list[Held] = []
    try:
        for index in range(plan.repeats):
            for side in (ours, raw) if index % 2 == 0 else (raw, ours):
                held = await held_per_call(side, plan.calls, plan.hold_seconds)
                (ours_held if side is ours else raw_held).append(held)
    finally:
        await session.close()
        await close_http_sessions()
    mine = Held(median([h.objects for h in ours_held]), median([h.blocks for h in ours_held]))
    theirs = Held(median([h.objects for h in raw_held]), median([h.blocks for h in raw_held]))
    extra = mine.objects - theirs.objects
    print(f"  allocations: ours {ours_held}, raw {raw_held}", file=sys.stderr)
    return [
        Row(
            "data plane",
            f"objects a call keeps alive while it waits for its answer, POST with json= (baseline: "
            f"data=orjson.dumps(body)), {plan.calls} in flight, counted (median of {plan.repeats}; ratio: raw / "
            f"ours; {extra:+.1f} objects per call)",
            f"{mine.objects:.1f} objects tracked by the GC, {mine.blocks:.1f} memory blocks per call",
            f"raw aiohttp + orjson: {theirs.objects:.1f} objects, {theirs.blocks:.1f} blocks per call",
            theirs.objects / mine.objects,
            f"≤ raw + {MAX_EXTRA_OBJECTS} objects",
            extra <= MAX_EXTRA_OBJECTS,
        )
    ]


async def inline_first_attempt_row(port: int, plan: AllocationPlan) -> Row:
    """Does the pipeline's one trick pay? A call nobody observes, to a server of one instance, makes its first
    attempt inline in `DataPlane.call` (gym_rpc.client.data._pipeline): no `Call` and no coroutine of `send`'s
    until a failure. Here the two shapes on one raw session, counted alike: that first attempt as the pipeline
    writes it, against the same call as one `Call` through the shipped `send`."""
    session = raw_session()
    url = f"http://127.0.0.1:{port}/slow?seconds={plan.hold_seconds:g}"
    retry = POOL.retry

    async def inline() -> None:
        kwargs = {"data": json_payload(PAYLOAD)}
        response = await session.request("POST", url, **kwargs)  # type: ignore[arg-type]
        if response.status >= 429 and response.status in BACKPRESSURE_STATUSES:
            raise RuntimeError("the data server was busy")
        async with response:
            orjson.loads(await response.read())

    async def through_send() -> None:
        kwargs = {"data": json_payload(PAYLOAD)}
        call = OneCall(session, "POST", url, kwargs, retry, server=SERVER_NAME)  # type: ignore[arg-type]
        async with await send(call) as response:
            orjson.loads(await response.read())

    inline_held: list[Held] = []
    send_held: list[Held] = []
    try:
        for index in range(plan.repeats):
            for side in (inline, through_send) if index % 2 == 0 else (through_send, inline):
                held = await held_per_call(side, plan.calls, plan.hold_seconds)
                (inline_held if side is inline else send_held).append(held)
    finally:
        await session.close()
    mine = median([h.objects for h in inline_held])
    theirs = median([h.objects for h in send_held])
    return Row(
        "data plane",
        f"objects a call keeps alive while it waits, the pipeline's first attempt inline (DataPlane.call) vs one "
        f"Call through send, {plan.calls} in flight, counted (median of {plan.repeats}; ratio: through send / "
        f"inline; {theirs - mine:+.1f} objects per call saved)",
        f"inline: {mine:.1f} objects tracked by the GC per call",
        f"through send(Call): {theirs:.1f} objects per call",
        theirs / mine,
    )
