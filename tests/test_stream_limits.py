"""The hub's stream allowances and their statistics() record, without a server: the
interceptor's admission is fed what a gRPC handler context offers (metadata, abort)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from kvasir_rpc import AUTHORIZATION_METADATA
from relay.hub._stream_limits import WATCH_METHOD, StreamLimits, StreamLimitsInterceptor, StreamStats


class Aborted(Exception):
    pass


class Context:
    """The two things admission reads of a grpc.ServicerContext."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def test_allowances_are_counted_refused_and_given_back() -> None:
    gate = StreamLimitsInterceptor(StreamLimits(watch=1, backbone=1, other=1), backbone_token="t" * 32)
    backbone = Context(((AUTHORIZATION_METADATA, "Bearer " + "t" * 32),))
    release_watch = gate._admit(WATCH_METHOD, Context())
    release_backbone = gate._admit(WATCH_METHOD, backbone)
    with pytest.raises(Aborted) as info:
        gate._admit(WATCH_METHOD, Context())
    assert info.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "backbone token" in info.value.args[1]
    with pytest.raises(Aborted):
        gate._admit(WATCH_METHOD, backbone)
    assert gate.statistics() == StreamStats(watch=1, backbone=1, other=0, refused_watch=1, refused_backbone=1,
                                            refused_other=0)
    release_watch()
    release_watch()  # giving a slot back twice frees it once
    release_backbone()
    stats = gate.statistics()
    assert (stats.watch, stats.backbone, stats.refused_watch) == (0, 0, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.watch = 5  # type: ignore[misc]
