"""What tracing costs a worker that samples rollouts (`bench.flag_cost`): `ServerClient.post` traced over
untraced, with the SDK's `ParentBased(TraceIdRatioBased(0.1))` sampler (`OTEL_TRACES_SAMPLER=
parentbased_traceidratio`, `OTEL_TRACES_SAMPLER_ARG=0.1`) and the calls grouped in rollouts of 8, each in
`rollout_context(id, span=True)`: one rollout in ten is recorded whole, the others' calls make no span at all.
Beside it, in the same rounds, its peer: raw aiohttp with `opentelemetry-instrumentation-aiohttp-client` under
the same provider and sampler, each rollout of 8 calls in a span of the application's (bench.tracing_peer). The
goal (DESIGN): gym_rpc's traced/untraced ratio at least the instrumentation's (the median of the per-round
quotients ≥ 1).

Otherwise as `tracing_cost` (SDK provider, batching processor, dropping exporter). `python -m
bench.tracing_sampled_cost [--quick] [--port PORT]`.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable

from bench import flag_cost, tracing_peer
from bench.data_plane import Block, Post, run_block
from bench.tracing_cost import NO_WORSE_THAN_THE_PEER, install_sdk_provider
from gym_rpc.client.data._rollout import rollout_context
from gym_rpc.telemetry import TRACING

SAMPLED_FRACTION = 0.1
CALLS_PER_ROLLOUT = 8
_rollout_numbers = itertools.count()

RolloutScope = Callable[[bool], contextlib.AbstractContextManager[object]]


def install_sampling_provider() -> None:
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    install_sdk_provider(ParentBased(TraceIdRatioBased(SAMPLED_FRACTION)))


def install_peer_sampling_provider() -> None:
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    tracing_peer.install_provider(ParentBased(TraceIdRatioBased(SAMPLED_FRACTION)))


def in_rollouts(block_scope: RolloutScope, rollout_scope: RolloutScope) -> flag_cost.TimedBlock:
    """A block of `requests` calls in rollouts of CALLS_PER_ROLLOUT, each rollout in `rollout_scope(on)`, the
    whole block in `block_scope(on)`; figures per call, as the other rows'."""

    async def timed_block(post: Post, requests: int, concurrency: int, on: bool) -> Block:
        async def rollout() -> None:
            with rollout_scope(on):
                for _ in range(CALLS_PER_ROLLOUT):
                    await post()

        with block_scope(on):
            block = await run_block(rollout, max(requests // CALLS_PER_ROLLOUT, 1), concurrency)
        return Block(
            block.requests_per_second * CALLS_PER_ROLLOUT,
            block.cpu_us_per_request / CALLS_PER_ROLLOUT,
            tuple(count / CALLS_PER_ROLLOUT for count in block.collections_per_10k),
        )

    return timed_block


def _gym_rollout(on: bool) -> contextlib.AbstractContextManager[object]:
    return rollout_context(f"rollout-{next(_rollout_numbers)}", span=True)


def _no_scope(on: bool) -> contextlib.AbstractContextManager[object]:
    return contextlib.nullcontext()


SAMPLED = f"1 rollout in {round(1 / SAMPLED_FRACTION)} sampled (rollouts of {CALLS_PER_ROLLOUT} calls)"
PEER = flag_cost.FlagCost(
    module="bench.tracing_sampled_cost:PEER",
    name="tracing",
    measure=f"raw aiohttp instrumented / not (opentelemetry-instrumentation-aiohttp-client), {SAMPLED}",
    on_label="instrumented",
    install=install_peer_sampling_provider,
    timed_block=in_rollouts(_no_scope, tracing_peer.rollout_span),
    make_post=tracing_peer.instrumented_post,
    close=tracing_peer.close,
)
COST = flag_cost.FlagCost(
    module="bench.tracing_sampled_cost",
    name="tracing",
    measure=f"ServerClient.post traced / untraced, {SAMPLED}",
    on_label="traced",
    install=install_sampling_provider,
    timed_block=in_rollouts(lambda on: flag_cost.switched(TRACING, on), _gym_rollout),
    goals=NO_WORSE_THAN_THE_PEER,
    peer=PEER,
)


if __name__ == "__main__":
    sys.exit(flag_cost.main(COST, "python -m bench.tracing_sampled_cost", __doc__))
