"""Replicas on the wire: a server's instances travel in its status report and in ListServerInstances rows, every
field kept, and a report from a head older than replicas (no instances) reads as one with none."""

from __future__ import annotations

import dataclasses

import pytest

from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import InstanceReport, StatusReport, convert


def test_a_report_with_instances_round_trips_every_field() -> None:
    instances = (
        InstanceReport(instance_id="127.0.0.1:8000", url="http://127.0.0.1:8000", origin="config"),
        InstanceReport(
            instance_id="[::1]:8001",
            url="http://[::1]:8001",
            status="success",
            http_status=404,
            latency_seconds=0.25,
            checked_at=1_700_000_000.5,
            registration="registered",
            draining=True,
            labels={"weights_version": "42"},
            origin="registered",
            pid=4242,
            start_time=1_699_999_000.0,
        ),
        InstanceReport(
            instance_id="10.0.0.2:8000",
            url="http://10.0.0.2:8000",
            status="connection_error",
            detail="refused",
            origin="static_replica",
        ),
    )
    report = StatusReport(server_name="policy_model", status="success", url=instances[0].url, instances=instances)
    assert convert.report_from_pb(convert.report_to_pb(report)) == report


def test_a_report_of_a_head_older_than_replicas_has_no_instances() -> None:
    message = pb.ServerStatusReport(server_name="s", url="http://127.0.0.1:1", status=pb.SERVER_STATUS_SUCCESS)
    assert convert.report_from_pb(message).instances == ()


def test_an_origin_a_newer_head_adds_reads_as_unknown() -> None:
    message = pb.InstanceReport(instance_id="h:1", url="http://h:1", origin=99)  # type: ignore[arg-type]
    assert convert.instance_report_from_pb(message).origin is None


def test_a_list_row_carries_its_instance() -> None:
    row = pb.ServerInstance(
        name="s",
        url="http://127.0.0.1:1",
        instance_id="127.0.0.1:1",
        labels={"zone": "a"},
        draining=True,
        origin=pb.INSTANCE_ORIGIN_REGISTERED,
    )
    instance = convert.instance_from_pb(row)
    assert (instance.instance_id, dict(instance.labels), instance.draining, instance.origin) == (
        "127.0.0.1:1",
        {"zone": "a"},
        True,
        "registered",
    )


def test_a_converted_report_has_every_field_of_its_type() -> None:
    """The converters build reports without their __init__ (convert._made_without_init), so no default is filled
    in for them: a field the converter forgets would be missing, not defaulted."""
    message = pb.ServerStatusReport(
        server_name="s",
        url="http://127.0.0.1:1",
        instances=[pb.InstanceReport(instance_id="127.0.0.1:1", url="http://127.0.0.1:1")],
    )
    report = convert.report_from_pb(message)
    assert set(vars(report)) == {field.name for field in dataclasses.fields(StatusReport)}
    assert set(vars(report.instances[0])) == {field.name for field in dataclasses.fields(InstanceReport)}
    assert report == StatusReport(
        server_name="s",
        status=None,
        url="http://127.0.0.1:1",
        instances=(InstanceReport(instance_id="127.0.0.1:1", url="http://127.0.0.1:1"),),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.url = "http://elsewhere:1"  # type: ignore[misc]


def test_times_read_as_protobuf_reads_them() -> None:
    """Durations (negative ones too) and timestamps become the seconds `ToNanoseconds() / 1e9` gives."""
    message = pb.InstanceReport(instance_id="h:1", url="http://h:1")
    message.latency.FromNanoseconds(-1_500_000_001)
    message.checked_at.FromNanoseconds(1_700_000_000_123_456_789)
    message.start_time.FromNanoseconds(1_699_999_999_999_999_999)
    instance = convert.instance_report_from_pb(message)
    assert instance.latency_seconds == message.latency.ToNanoseconds() / 1e9
    assert instance.checked_at == message.checked_at.ToNanoseconds() / 1e9
    assert instance.start_time == message.start_time.ToNanoseconds() / 1e9


def test_the_fast_constructor_takes_fields_by_keyword_only() -> None:
    make = convert._made_without_init(InstanceReport)
    with pytest.raises(TypeError, match="InstanceReport fields go by keyword"):
        make("h:1", "http://h:1")
