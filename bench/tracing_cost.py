"""What tracing costs a rollout worker (`bench.flag_cost`): `ServerClient.post` traced over untraced.

"On" is what a traced worker runs: the SDK's TracerProvider with a batching processor (its exporter drops the
spans, so the network cost of exporting is left out), each call a CLIENT span, child of the rollout's span
(`rollout_context(id, span=True)`), whose context goes out in the `traceparent` header. "Off" is the untraced
path. The goal at concurrency 64 is 0.85: tracing cheap enough to leave on.

`python -m bench.tracing_cost [--quick] [--port PORT] [--json]` prints the table (it starts a data server when no
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

TRACED_OVER_UNTRACED_GOAL_AT_64 = 0.85


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
    name="tracing",
    measure="ServerClient.post traced / untraced",
    on_label="traced",
    install=install_sdk_provider,
    timed_block=timed_block,
    goals={64: TRACED_OVER_UNTRACED_GOAL_AT_64},
)


if __name__ == "__main__":
    sys.exit(flag_cost.main(COST, "python -m bench.tracing_cost", __doc__))
