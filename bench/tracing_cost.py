"""What tracing costs a rollout worker (`bench.flag_cost`): `ServerClient.post` traced over untraced.

"On" is what a worker that records every call runs: the SDK's TracerProvider (its default sampler,
`ParentBased(ALWAYS_ON)`) with a batching processor (its exporter drops the spans, so the network cost of
exporting is left out), each call a CLIENT span on the public API, child of the rollout's span
(`rollout_context(id, span=True)`), whose context goes out in the `traceparent` header. "Off" is the untraced
path. Reported with no goal: the way to trace a large run is to sample rollouts (`bench.tracing_sampled_cost`,
whose row has the goal).

`python -m bench.tracing_cost [--quick] [--port PORT]` prints the table (it starts a data server when no
port is given).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from opentelemetry import trace

from bench import flag_cost
from bench.data_plane import Block, Post, run_block
from gym_rpc.client._rollout import rollout_context
from gym_rpc.telemetry import TRACING, setup_tracing

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.sampling import Sampler


def install_sdk_provider(sampler: Sampler | None = None) -> None:
    """The SDK's provider (its default sampler unless given), batching into an exporter that drops what it gets;
    then tracing decided on."""
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class DroppingExporter(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(DroppingExporter()))
    trace.set_tracer_provider(provider)
    setup_tracing(observability_enabled=True)


async def timed_block(post: Post, requests: int, concurrency: int, on: bool) -> Block:
    """One block inside a rollout (its id bound and, when traced, its span current), as a worker runs it."""
    with flag_cost.switched(TRACING, on), rollout_context("bench-rollout", span=True):
        return await run_block(post, requests, concurrency)


COST = flag_cost.FlagCost(
    module="bench.tracing_cost",
    name="tracing",
    measure="ServerClient.post traced / untraced, every call recorded",
    on_label="traced",
    install=install_sdk_provider,
    timed_block=timed_block,
)


if __name__ == "__main__":
    sys.exit(flag_cost.main(COST, "python -m bench.tracing_cost", __doc__))
