"""What tracing costs a worker that samples rollouts (`bench.flag_cost`): `ServerClient.post` traced over
untraced, with the SDK's `ParentBased(TraceIdRatioBased(0.1))` sampler (`OTEL_TRACES_SAMPLER=
parentbased_traceidratio`, `OTEL_TRACES_SAMPLER_ARG=0.1`) and the calls grouped in rollouts of 8, each in
`rollout_context(id, span=True)`: one rollout in ten is recorded whole, the others' calls make no span at all.
The goal at concurrency 64 is 0.85: tracing a large run, as it should be traced, cheap enough to leave on.

Otherwise as `tracing_cost` (SDK provider, batching processor, dropping exporter). `python -m
bench.tracing_sampled_cost [--quick] [--port PORT]`.
"""

from __future__ import annotations

import itertools
import sys

from bench import flag_cost
from bench.data_plane import Block, Post, run_block
from bench.tracing_cost import install_sdk_provider
from gym_rpc.client._rollout import rollout_context
from gym_rpc.telemetry import TRACING

SAMPLED_FRACTION = 0.1
TRACED_OVER_UNTRACED_GOAL_AT_64 = 0.85
CALLS_PER_ROLLOUT = 8
_rollout_numbers = itertools.count()


def install_sampling_provider() -> None:
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    install_sdk_provider(ParentBased(TraceIdRatioBased(SAMPLED_FRACTION)))


async def timed_block(post: Post, requests: int, concurrency: int, on: bool) -> Block:
    """`requests` calls in rollouts of CALLS_PER_ROLLOUT; figures per call, as the other rows'."""

    async def rollout() -> None:
        with rollout_context(f"rollout-{next(_rollout_numbers)}", span=True):
            for _ in range(CALLS_PER_ROLLOUT):
                await post()

    with flag_cost.switched(TRACING, on):
        block = await run_block(rollout, max(requests // CALLS_PER_ROLLOUT, 1), concurrency)
    return Block(
        block.requests_per_second * CALLS_PER_ROLLOUT,
        block.cpu_us_per_request / CALLS_PER_ROLLOUT,
        tuple(count / CALLS_PER_ROLLOUT for count in block.collections_per_10k),
    )


COST = flag_cost.FlagCost(
    module="bench.tracing_sampled_cost",
    name="tracing",
    measure=f"ServerClient.post traced / untraced, 1 rollout in {round(1 / SAMPLED_FRACTION)} sampled "
    f"(rollouts of {CALLS_PER_ROLLOUT} calls)",
    on_label="traced",
    install=install_sampling_provider,
    timed_block=timed_block,
    goals={64: TRACED_OVER_UNTRACED_GOAL_AT_64},
)


if __name__ == "__main__":
    sys.exit(flag_cost.main(COST, "python -m bench.tracing_sampled_cost", __doc__))
