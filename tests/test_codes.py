"""The shared ErrorCode / FinishReason (minisgl_core.codes) against the proto enums they mirror, and
every service using that one declaration."""

from __future__ import annotations

import minisgl_scheduler
import minisgl_tokenizer
from minisgl_core.codes import FINISH_FROM_PROTO, FINISH_TO_PROTO, ErrorCode, FinishReason, finish_name
from minisgl_core.proto.minisgl.v1 import common_pb2


def test_error_codes_equal_the_proto_enum() -> None:
    wire = {n.removeprefix("ERROR_CODE_"): v for n, v in common_pb2.ErrorCode.items()}
    assert wire.pop("UNSPECIFIED") == 0
    assert {c.name: int(c) for c in ErrorCode} == wire


def test_finish_reasons_round_trip_through_the_proto_enum() -> None:
    wire = {n.removeprefix("FINISH_REASON_"): v for n, v in common_pb2.FinishReason.items()}
    assert FINISH_TO_PROTO[None] == wire.pop("UNSPECIFIED")
    assert {r.name: FINISH_TO_PROTO[r] for r in FinishReason} == wire
    assert all(FINISH_FROM_PROTO[FINISH_TO_PROTO[r]] is r for r in FinishReason)
    assert [finish_name(v) for v in sorted(wire.values())] == ["stop", "length", "abort", "error"]
    assert finish_name(common_pb2.FINISH_REASON_UNSPECIFIED) is None and finish_name(99) is None


def test_services_reexport_the_shared_declaration() -> None:
    assert minisgl_scheduler.ErrorCode is ErrorCode
    assert minisgl_scheduler.FinishReason is FinishReason
    assert minisgl_tokenizer.ErrorCode is ErrorCode
