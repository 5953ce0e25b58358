"""What worker metrics cost (`bench.flag_cost`): `ServerClient.post` with metrics on over the same with them off.

"On" is the SDK's MeterProvider with a reader that collects only when asked (as Prometheus scrapes), each call
recording its duration, in-flight count and outcome. "Off" is the plain path, whose only cost is the boolean
check in `ServerClient.request` (the data-plane rows of `make bench` measure that path against raw aiohttp).

`python -m bench.metrics_cost [--quick] [--port PORT]`.
"""

from __future__ import annotations

import sys

from bench import flag_cost
from bench.data_plane import Block, Post, run_block
from gym_rpc.client.data._rollout import rollout_context
from gym_rpc.metrics import METRICS, enable_client_metrics


def install_sdk_provider() -> None:
    """The SDK's provider as gym_rpc installs it (no exemplars), with a reader that collects when asked."""
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    provider = MeterProvider(metric_readers=[InMemoryMetricReader()], exemplar_filter=AlwaysOffExemplarFilter())
    metrics.set_meter_provider(provider)
    enable_client_metrics()


async def timed_block(post: Post, requests: int, concurrency: int, on: bool) -> Block:
    with flag_cost.switched(METRICS, on), rollout_context("bench-rollout"):
        return await run_block(post, requests, concurrency)


COST = flag_cost.FlagCost(
    module="bench.metrics_cost",
    name="metrics",
    measure="ServerClient.post with worker metrics / without",
    on_label="measured",
    install=install_sdk_provider,
    timed_block=timed_block,
)


if __name__ == "__main__":
    sys.exit(flag_cost.main(COST, "python -m bench.metrics_cost", __doc__))
