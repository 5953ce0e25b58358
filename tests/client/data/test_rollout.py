"""Rollout ids and trace context in URL paths: the prefix rules, id encoding, the context variable, real spans."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from gym_rpc.client.data import _rollout as rollout_module
from gym_rpc.client.data._rollout import (
    _rollout_id,
    apply_rollout_prefix,
    current_rollout_id,
    rollout_context,
    trace_context_path_segment,
)
from gym_rpc.errors import GymRpcError, InvalidRolloutIdError
from gym_rpc.telemetry import TRACING
from gym_rpc.wire import (
    MAX_ROLLOUT_ID_LENGTH,
    TRACEPARENT_PATTERN,
    encode_rollout_id,
    prefixed_path,
    rollout_path_prefix,
)

MODEL = "responses_api_models"
RESOURCES = "resources_servers"
AGENT = "responses_api_agents"
TRACE_SEGMENT_RE = re.compile(f"/ng-trace/{TRACEPARENT_PATTERN}")

# Ids that are not one plain segment (issue 26, point 7): refused by the client as by the receiving middleware.
HOSTILE_IDS = [
    "r/1",
    "a?b=c",
    "frag#ment",
    "100%",
    "%2F",
    "with space",
    "é☃🙂",
    "../x",
    "a/../../b",
    "~-._",
    "nul\x00",
    "bell\x07",
    "bidi\u202eexe.txt",
    "\u2066isolate",
    "tab\t",
    ".hidden",
    "-dash-first",
]
INVALID_IDS = [".", "..", "x" * (MAX_ROLLOUT_ID_LENGTH + 1), "\ud800"]  # "" means no rollout, as upstream
PLAIN_IDS = ["r1", "rollout-7", "task_3.attempt-2", "0", "A" * MAX_ROLLOUT_ID_LENGTH]


@pytest.fixture
def tracer(monkeypatch: pytest.MonkeyPatch) -> Iterator[Tracer]:
    """A real SDK tracer that is not installed as the global provider (spans still become current), with gym_rpc's
    tracing on: trace segments are only made while gym_rpc traces (tests/nemo_gym/test_nemo_gym_behaviours.py)."""
    monkeypatch.setattr(TRACING, "enabled", True)
    provider = TracerProvider()
    yield provider.get_tracer("gym_rpc.tests")
    provider.shutdown()


# --- rollout_path_prefix and id encoding ----------------------------------------------------------------------


def test_prefix_without_a_rollout_id_is_empty():
    assert rollout_path_prefix(None) == ""
    assert rollout_path_prefix(None, token_capture=True) == ""


def test_prefix_and_token_capture():
    assert rollout_path_prefix("rollout-7") == "/ng-rollout/rollout-7"
    assert rollout_path_prefix("rollout-7", token_capture=True) == "/ng-rollout/rollout-7/training-token-capture"


@pytest.mark.parametrize("rollout_id", PLAIN_IDS)
def test_plain_ids_are_their_own_segment(rollout_id: str):
    prefix = rollout_path_prefix(rollout_id, token_capture=True)
    assert prefix.split("/") == ["", "ng-rollout", rollout_id, "training-token-capture"]
    assert encode_rollout_id(rollout_id) == rollout_id


@pytest.mark.parametrize("rollout_id", HOSTILE_IDS)
def test_ids_that_are_not_one_plain_segment_are_refused(rollout_id: str):
    with pytest.raises(InvalidRolloutIdError, match="letters, digits, dots, dashes or underscores"):
        rollout_path_prefix(rollout_id, token_capture=True)


def test_a_refused_id_is_quoted_in_part_only():
    with pytest.raises(InvalidRolloutIdError) as caught:
        encode_rollout_id("/" * 100_000)
    assert len(str(caught.value)) < 300 and "(and more)" in str(caught.value)


def test_longest_allowed_id_is_accepted():
    rollout_id = "x" * MAX_ROLLOUT_ID_LENGTH
    assert rollout_path_prefix(rollout_id) == f"/ng-rollout/{rollout_id}"


@pytest.mark.parametrize("rollout_id", INVALID_IDS, ids=["dot", "dotdot", "too-long", "lone-surrogate"])
def test_invalid_ids_raise_everywhere(rollout_id: str):
    with pytest.raises(InvalidRolloutIdError):
        rollout_path_prefix(rollout_id)
    with pytest.raises(InvalidRolloutIdError):
        apply_rollout_prefix("http://127.0.0.1:1", rollout_id)
    with pytest.raises(InvalidRolloutIdError):
        prefixed_path("/verify", RESOURCES, rollout_id)
    with pytest.raises(InvalidRolloutIdError), rollout_context(rollout_id):
        pass
    assert current_rollout_id() is None


def test_non_string_id_raises_the_typed_error():
    with pytest.raises(InvalidRolloutIdError):
        rollout_path_prefix(["not", "hashable"])  # type: ignore[arg-type]
    with pytest.raises(InvalidRolloutIdError):
        rollout_path_prefix(7)  # type: ignore[arg-type]
    # prefixed_path takes a str id straight from the prefix cache; anything else still gets the typed error
    with pytest.raises(InvalidRolloutIdError):
        prefixed_path("/v1/responses", MODEL, ["not", "hashable"])  # type: ignore[arg-type]
    assert prefixed_path("/v1/responses", MODEL, _Id("r1")) == "/ng-rollout/r1/v1/responses"


class _Id(str):
    """A str subclass: not `type(...) is str`, still an id."""


def test_invalid_id_error_is_a_value_error_and_a_gym_rpc_error():
    with pytest.raises(InvalidRolloutIdError) as caught:
        encode_rollout_id("..")
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, GymRpcError)
    assert "'..'" in str(caught.value)


# --- prefixed_path: which calls get the prefix ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions", "/v1/messages"])
def test_model_server_api_paths_get_the_prefix(path: str):
    assert prefixed_path(path, MODEL, "r1") == f"/ng-rollout/r1{path}"


def test_model_server_api_path_with_a_query_string_gets_the_prefix():
    assert prefixed_path("/v1/responses?stream=false", MODEL, "r1") == "/ng-rollout/r1/v1/responses?stream=false"


@pytest.mark.parametrize(
    "path", ["/", "/v1/models", "/health", "/v1/responses/extra", "/v1/responsesX", "v1/responses"]
)
def test_other_model_server_paths_do_not(path: str):
    assert prefixed_path(path, MODEL, "r1") == path


@pytest.mark.parametrize("path", ["/verify", "/seed_session", "/", "/v1/responses", "/a/b?c=d"])
def test_resources_servers_get_the_prefix_on_every_path(path: str):
    assert prefixed_path(path, RESOURCES, "r1") == f"/ng-rollout/r1{path}"


@pytest.mark.parametrize("path", ["/run", "/v1/responses", "/verify"])
def test_agents_never_get_the_prefix(path: str):
    assert prefixed_path(path, AGENT, "r1") == path


@pytest.mark.parametrize("server_type", [MODEL, RESOURCES])
def test_no_prefix_without_a_rollout_id(server_type: str):
    assert prefixed_path("/v1/responses", server_type, None) == "/v1/responses"


@pytest.mark.parametrize("server_type", [MODEL, RESOURCES])
def test_prefix_is_never_doubled(server_type: str):
    already = "/ng-rollout/other/v1/responses"
    assert prefixed_path(already, server_type, "r1") == already
    once = prefixed_path("/v1/responses", server_type, "r1")
    assert prefixed_path(once, server_type, "r1") == once
    assert once.count("/ng-rollout/") == 1


# --- apply_rollout_prefix -------------------------------------------------------------------------------------


def test_apply_rollout_prefix_outside_any_span():
    assert apply_rollout_prefix("http://127.0.0.1:8000", "r-1") == "http://127.0.0.1:8000/ng-rollout/r-1"
    assert apply_rollout_prefix("http://127.0.0.1:8000/", "r1") == "http://127.0.0.1:8000/ng-rollout/r1"
    assert (
        apply_rollout_prefix("http://[::1]:8000/", "r1", token_capture=True)
        == "http://[::1]:8000/ng-rollout/r1/training-token-capture"
    )
    assert apply_rollout_prefix("http://127.0.0.1:8000/", None) == "http://127.0.0.1:8000/"  # nothing to add


def test_apply_rollout_prefix_inside_a_span_appends_the_trace_context(tracer: Tracer):
    base = "http://127.0.0.1:8000"
    with tracer.start_as_current_span("rollout") as span:
        url = apply_rollout_prefix(base, "r1", token_capture=True)
        without_trace = apply_rollout_prefix(base, "r1", token_capture=True, trace_context=False)
        trace_only = apply_rollout_prefix(base, None)
    context = span.get_span_context()
    expected_segment = f"/ng-trace/00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    assert url == f"{base}/ng-rollout/r1/training-token-capture{expected_segment}"
    assert without_trace == f"{base}/ng-rollout/r1/training-token-capture"
    assert trace_only == base + expected_segment


# --- trace_context_path_segment -------------------------------------------------------------------------------


def test_trace_segment_is_empty_without_a_current_span():
    assert trace_context_path_segment() == ""


def test_trace_segment_names_the_current_span(tracer: Tracer):
    with tracer.start_as_current_span("outer") as outer:
        outer_segment = trace_context_path_segment()
        with tracer.start_as_current_span("inner") as inner:
            inner_segment = trace_context_path_segment()
    assert TRACE_SEGMENT_RE.fullmatch(outer_segment)
    assert TRACE_SEGMENT_RE.fullmatch(inner_segment)
    outer_context, inner_context = outer.get_span_context(), inner.get_span_context()
    assert outer_context.trace_id == inner_context.trace_id
    assert outer_context.trace_flags & 0x01  # sampled: the SDK's default sampler keeps every span
    for segment, context in ((outer_segment, outer_context), (inner_segment, inner_context)):
        assert segment == f"/ng-trace/00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    assert trace_context_path_segment() == ""


# --- rollout_context ------------------------------------------------------------------------------------------


def test_rollout_context_binds_and_restores_nested():
    assert current_rollout_id() is None
    with rollout_context("outer") as bound:
        assert bound == "outer"
        assert current_rollout_id() == "outer"
        with rollout_context("inner"):
            assert current_rollout_id() == "inner"
        assert current_rollout_id() == "outer"
        with rollout_context(None):
            assert current_rollout_id() is None
        assert current_rollout_id() == "outer"
    assert current_rollout_id() is None


def test_rollout_context_restores_after_an_exception():
    with pytest.raises(RuntimeError), rollout_context("doomed"):
        raise RuntimeError("boom")
    assert current_rollout_id() is None


async def test_rollout_id_is_visible_in_tasks_created_inside_and_does_not_leak_out():
    release = asyncio.Event()

    async def read_after_release() -> str | None:
        await release.wait()
        return current_rollout_id()

    async def read_now() -> str | None:
        await asyncio.sleep(0)
        return current_rollout_id()

    with rollout_context("r1"):
        outliving = asyncio.create_task(read_after_release())
        assert list(await asyncio.gather(read_now(), read_now())) == ["r1", "r1"]
    assert current_rollout_id() is None
    release.set()
    assert await asyncio.wait_for(outliving, 5) == "r1"  # created inside, read after the block closed


async def test_a_binding_made_in_a_task_stays_in_that_task():
    async def bind_and_keep() -> str | None:
        _rollout_id.set("child-only")  # deliberately never reset: the task's context copy must contain it
        await asyncio.sleep(0)
        return current_rollout_id()

    with rollout_context("parent"):
        assert await asyncio.create_task(bind_and_keep()) == "child-only"
        assert current_rollout_id() == "parent"
    assert current_rollout_id() is None


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Tracer, InMemorySpanExporter]]:
    """gym_rpc's tracer for rollout spans made a real SDK tracer exporting into memory, with tracing on."""
    monkeypatch.setattr(TRACING, "enabled", True)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sdk_tracer = provider.get_tracer("gym_rpc.tests")
    monkeypatch.setattr(rollout_module, "tracer", lambda: sdk_tracer)
    yield sdk_tracer, exporter
    provider.shutdown()


@pytest.mark.parametrize(
    "error",
    [None, ValueError("boom"), asyncio.CancelledError()],
    ids=["a block that ends", "an exception", "a cancellation"],
)
def test_a_rollout_span_is_what_start_as_current_span_makes(
    exported: tuple[Tracer, InMemorySpanExporter], error: BaseException | None
) -> None:
    """rollout_context(id, span=True) opens its span as the SDK's start_as_current_span does: current inside and
    not after, the rollout id its attribute; an Exception leaving the block is its exception event and error
    status, a BaseException (a cancellation) is not; ended either way."""
    sdk_tracer, exporter = exported

    def current_inside(block: AbstractContextManager[object]) -> otel_trace.Span | None:
        inside = None
        try:
            with block:
                inside = otel_trace.get_current_span()
                if error is not None:
                    raise error
        except BaseException as caught:
            assert caught is error
        return inside

    before = otel_trace.get_current_span()
    ours_inside = current_inside(rollout_context("r-1", span=True))
    assert otel_trace.get_current_span() is before and current_rollout_id() is None
    current_inside(sdk_tracer.start_as_current_span("gym.rollout", attributes={"gym.rollout_id": "r-1"}))
    ours, sdk = exporter.get_finished_spans()
    assert ours_inside is not None and ours_inside.get_span_context() == ours.context

    def shape(span: ReadableSpan) -> tuple[object, ...]:
        events = [
            (event.name, {k: v for k, v in (event.attributes or {}).items() if k != "exception.stacktrace"})
            for event in span.events
        ]
        return (
            span.name,
            span.kind,
            dict(span.attributes or {}),
            span.status.status_code,
            span.status.description,
            events,
        )

    assert shape(ours) == shape(sdk)
    assert [event.name for event in ours.events] == (["exception"] if isinstance(error, Exception) else [])
