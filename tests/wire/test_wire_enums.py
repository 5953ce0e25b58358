"""The three enums a status report carries: every value of each Literal (ServerStatus, RegistrationState,
InstanceOrigin) goes on the wire as the proto value of its name and comes back, the proto has no value the Literal
lacks, and a number a newer head may add reads as None. wire/_convert.py writes these tables out by hand, so a
value added on one side only fails here, not in a converter at run time."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, get_args

import pytest

from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import InstanceOrigin, InstanceReport, RegistrationState, ServerStatus, StatusReport, convert


@dataclass(frozen=True)
class WireEnum:
    values: tuple[str, ...]  # the Literal's
    proto: Mapping[str, int]  # every value of the proto enum: name -> number
    prefix: str  # what buf's STANDARD lint makes every value of the proto enum start with
    to_pb: Callable[[Any], int]  # a value (None too) through the converter, as a number on the wire
    from_pb: Callable[[int], str | None]  # a number on the wire through the converter


STATUS = WireEnum(
    get_args(ServerStatus),
    dict(pb.ServerStatus.items()),
    "SERVER_STATUS_",
    convert.status_to_pb,
    convert.status_from_pb,
)
REGISTRATION = WireEnum(
    get_args(RegistrationState),
    dict(pb.RegistrationState.items()),
    "REGISTRATION_STATE_",
    lambda value: convert.report_to_pb(StatusReport("s", None, "http://h:1", registration=value)).registration,
    lambda number: convert.report_from_pb(pb.ServerStatusReport(registration=number)).registration,  # type: ignore[arg-type]
)
ORIGIN = WireEnum(
    get_args(InstanceOrigin),
    dict(pb.InstanceOrigin.items()),
    "INSTANCE_ORIGIN_",
    lambda value: convert.instance_report_to_pb(InstanceReport("h:1", "http://h:1", origin=value)).origin,
    lambda number: convert.instance_report_from_pb(pb.InstanceReport(origin=number)).origin,  # type: ignore[arg-type]
)
ENUMS = pytest.mark.parametrize("enum", [STATUS, REGISTRATION, ORIGIN], ids=["status", "registration", "origin"])


@ENUMS
def test_every_value_goes_on_the_wire_as_the_proto_value_of_its_name(enum: WireEnum) -> None:
    names = {number: name for name, number in enum.proto.items()}
    sent = {value: names[enum.to_pb(value)] for value in enum.values}
    assert sent == {value: enum.prefix + value.upper() for value in enum.values}
    assert names[enum.to_pb(None)] == enum.prefix + "UNSPECIFIED"
    assert len(enum.proto) == 1 + len(enum.values)  # no proto value the Literal lacks


@ENUMS
def test_every_value_comes_back_from_the_wire(enum: WireEnum) -> None:
    assert [enum.from_pb(enum.to_pb(value)) for value in (None, *enum.values)] == [None, *enum.values]


@ENUMS
def test_a_number_a_newer_head_adds_reads_as_none(enum: WireEnum) -> None:
    assert enum.from_pb(max(map(enum.to_pb, enum.values)) + 1) is None
