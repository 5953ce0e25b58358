"""What tracing costs a rollout worker (`bench.flag_cost`): `ServerClient.post` traced over untraced, beside the
same for its peer, raw aiohttp with `opentelemetry-instrumentation-aiohttp-client` (bench.tracing_peer), in the
same rounds.

"On" is what a worker that records every call runs: the SDK's TracerProvider (its default sampler,
`ParentBased(ALWAYS_ON)`) with a batching processor (its exporter drops the spans, so the network cost of
exporting is left out), each call a CLIENT span on the public API, child of the rollout's span
(`rollout_context(id, span=True)`), whose context goes out in the `traceparent` header. "Off" is the untraced
path. The peer's "on" is the instrumentation under the same provider, each call its CLIENT span, child of one
span of the application's around the block. The goal (DESIGN): gym_rpc's traced/untraced ratio at least the
instrumentation's, the median of the per-round quotients of the two ≥ 1.

`python -m bench.tracing_cost [--quick] [--port PORT]` prints the table (it starts a data server when no
port is given).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from bench import flag_cost, tracing_peer
from bench.data_plane import Block, Post, run_block
from gym_rpc.client.data._rollout import rollout_context
from gym_rpc.telemetry import TRACING, setup_tracing

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.sampling import Sampler

# Ours over the peer's traced/untraced ratio, per concurrency (DESIGN: tracing costs no more than the peer).
NO_WORSE_THAN_THE_PEER = {1: 1.0, 64: 1.0}


def install_sdk_provider(sampler: Sampler | None = None) -> None:
    """The SDK's provider (bench.tracing_peer.install_provider), then gym_rpc's tracing decided on."""
    tracing_peer.install_provider(sampler)
    setup_tracing(observability_enabled=True)


async def timed_block(post: Post, requests: int, concurrency: int, on: bool) -> Block:
    """One block inside a rollout (its id bound and, when traced, its span current), as a worker runs it."""
    with flag_cost.switched(TRACING, on), rollout_context("bench-rollout", span=True):
        return await run_block(post, requests, concurrency)


async def peer_timed_block(post: Post, requests: int, concurrency: int, on: bool) -> Block:
    """One block inside one span of the application's (on), as `timed_block`'s rollout."""
    with tracing_peer.rollout_span(on):
        return await run_block(post, requests, concurrency)


PEER = flag_cost.FlagCost(
    module="bench.tracing_cost:PEER",
    name="tracing",
    measure="raw aiohttp instrumented / not (opentelemetry-instrumentation-aiohttp-client), every call recorded",
    on_label="instrumented",
    install=tracing_peer.install_provider,
    timed_block=peer_timed_block,
    make_post=tracing_peer.instrumented_post,
    close=tracing_peer.close,
)
COST = flag_cost.FlagCost(
    module="bench.tracing_cost",
    name="tracing",
    measure="ServerClient.post traced / untraced, every call recorded",
    on_label="traced",
    install=install_sdk_provider,
    timed_block=timed_block,
    goals=NO_WORSE_THAN_THE_PEER,
    peer=PEER,
)


if __name__ == "__main__":
    sys.exit(flag_cost.main(COST, "python -m bench.tracing_cost", __doc__))
