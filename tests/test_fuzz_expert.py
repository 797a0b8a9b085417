"""Fuzz tier: ExpertService requests against the real servicer (worker._service) behind a real
in-process gRPC server on 127.0.0.1, with the experts of a tiny checkpoint.

Random and mutated-valid DispatchRequests (any tensor header, dtype, shape, byte count,
segment, row index, layer; NaN and Inf) get partials of the right shape or one of the status
codes the spec names: INVALID_ARGUMENT (malformed) or FAILED_PRECONDITION (an expert not
held); never UNKNOWN or INTERNAL. Afterwards no call is left computing and repeating bad
calls does not grow memory. Budget: the ``fuzz`` profile (tests/conftest.py).
"""

from __future__ import annotations

import gc
import pathlib
import tracemalloc
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch
from hypothesis import event as note_case
from hypothesis import given, settings
from hypothesis import strategies as st

from kvasir.tiny import make_tiny_checkpoint
from kvasir_rpc import decode_tensor, encode_tensor, expert_pb2, expert_pb2_grpc
from worker._load import load_experts
from worker._service import ExpertServicer, add_to_server

pytestmark = [pytest.mark.fuzz, pytest.mark.integration]  # a gRPC server on 127.0.0.1
FUZZ = settings.get_profile("fuzz")

ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
CALL_TIMEOUT_S = 30.0
HELD = [(0, 0), (0, 1), (1, 2)]  # (layer, expert) the fuzzed worker serves


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ExpertServicer, expert_pb2_grpc.ExpertServiceStub]]:
    model: pathlib.Path = make_tiny_checkpoint(tmp_path_factory.mktemp("fuzz-model"), seed=0)
    experts = load_experts(model, "0:0-1,1:2", "cpu")
    assert sorted(experts.weights) == HELD
    servicer = ExpertServicer(experts, "0" * 64)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, expert_pb2_grpc.ExpertServiceStub(channel)
    finally:
        channel.close()
        server.stop(None)


def hidden_size(servicer: ExpertServicer) -> int:
    return servicer.experts.hidden_size


def valid_request(h: int, rows: int, layer: int, experts: list[int], fill: float) -> expert_pb2.DispatchRequest:
    """A well-formed call: ``rows`` rows spread over ``experts`` (one segment each)."""
    counts = [rows // len(experts) + (i < rows % len(experts)) for i in range(len(experts))]
    segments = [expert_pb2.ExpertSegment(expert=e, rows=n) for e, n in zip(experts, counts) if n]
    covered = sum(s.rows for s in segments)
    return expert_pb2.DispatchRequest(
        call_id=7, layer=layer, segments=segments,
        hidden=encode_tensor(torch.full((covered, h), fill, dtype=torch.float32)),
        weights=encode_tensor(torch.full((covered,), 0.5, dtype=torch.float32)))


def mutate(req: expert_pb2.DispatchRequest, field: str, value: object) -> expert_pb2.DispatchRequest:
    out = expert_pb2.DispatchRequest()
    out.CopyFrom(req)
    if field == "hidden.dtype":
        out.hidden.dtype = value  # type: ignore[assignment]
    elif field == "hidden.shape":
        del out.hidden.shape[:]
        out.hidden.shape.extend(value)  # type: ignore[arg-type]
    elif field == "hidden.data":
        out.hidden.data = out.hidden.data[: value]  # type: ignore[misc]
    elif field == "weights.dtype":
        out.weights.dtype = value  # type: ignore[assignment]
    elif field == "weights.shape":
        del out.weights.shape[:]
        out.weights.shape.extend(value)  # type: ignore[arg-type]
    elif field == "segment.rows" and out.segments:
        out.segments[0].rows = value  # type: ignore[assignment]
    elif field == "segment.expert" and out.segments:
        out.segments[0].expert = value  # type: ignore[assignment]
    elif field == "segments.clear":
        del out.segments[:]
    elif field == "row_index":
        out.row_index.extend(value)  # type: ignore[arg-type]
    elif field == "layer":
        out.layer = value  # type: ignore[assignment]
    elif field == "nan":
        data = bytearray(out.hidden.data)
        data[: 4] = b"\x00\x00\xc0\x7f"  # a float32 NaN
        out.hidden.data = bytes(data)
    elif field == "bytes":
        raw = bytearray(out.SerializeToString())
        for pos, val in value:  # type: ignore[attr-defined]
            if raw:
                raw[pos % len(raw)] = val
        try:
            out.ParseFromString(bytes(raw))
        except Exception:  # what protobuf cannot parse never reaches the worker
            pass
    return out


FIELD_VALUES = st.one_of(
    st.tuples(st.just("hidden.dtype"), st.integers(0, 12)),
    st.tuples(st.just("weights.dtype"), st.integers(0, 12)),
    st.tuples(st.just("hidden.shape"), st.lists(st.sampled_from([0, 1, 2, 3, 16, 32, 64, 1 << 20, (1 << 63) - 1]),
                                                max_size=4)),
    st.tuples(st.just("weights.shape"), st.lists(st.sampled_from([0, 1, 2, 3, 1 << 40]), max_size=3)),
    st.tuples(st.just("hidden.data"), st.integers(0, 600)),
    st.tuples(st.just("segment.rows"), st.sampled_from([0, 1, 2, 5, 1 << 16, (1 << 32) - 1])),
    st.tuples(st.just("segment.expert"), st.sampled_from([0, 1, 2, 3, 7, (1 << 32) - 1])),
    st.tuples(st.just("segments.clear"), st.none()),
    st.tuples(st.just("row_index"), st.lists(st.sampled_from([0, 1, 2, 5, (1 << 32) - 1]), max_size=6)),
    st.tuples(st.just("layer"), st.sampled_from([0, 1, 2, 99, (1 << 32) - 1])),
    st.tuples(st.just("nan"), st.none()),
    st.tuples(st.just("bytes"), st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1,
                                         max_size=4)),
)
REQUESTS = st.builds(lambda rows, layer, experts, fill, edits: (rows, layer, experts, fill, edits),
                     st.integers(0, 6), st.sampled_from([0, 1]), st.lists(st.sampled_from([0, 1, 2]), min_size=1,
                                                                                 max_size=3),
                     st.sampled_from([0.0, 1.0, -2.5, 3e38]),
                     st.one_of(st.just([]), st.lists(FIELD_VALUES, min_size=1, max_size=3)))


def call(stub: expert_pb2_grpc.ExpertServiceStub, reqs: list[expert_pb2.DispatchRequest]):  # type: ignore[no-untyped-def]
    """The responses of one Dispatch stream, or the RpcError that ended it."""
    try:
        return list(stub.Dispatch(iter(reqs), timeout=CALL_TIMEOUT_S)), None
    except grpc.RpcError as exc:
        return [], exc


@FUZZ
@given(st.lists(REQUESTS, min_size=1, max_size=3), st.none() | st.binary(max_size=200))
def test_any_dispatch_gets_partials_or_a_status_the_spec_names(served, specs, raw: bytes | None) -> None:  # type: ignore[no-untyped-def]
    servicer, stub = served
    h = hidden_size(servicer)
    reqs = []
    for rows, layer, experts, fill, edits in specs:
        req = valid_request(h, rows, layer, experts, fill)
        for field, value in edits:
            req = mutate(req, field, value)
        reqs.append(req)
    if raw is not None:
        try:  # and any bytes protobuf accepts as a DispatchRequest
            reqs.append(expert_pb2.DispatchRequest.FromString(raw))
        except Exception:
            pass
    responses, error = call(stub, reqs)
    if error is not None:
        assert error.code() in ALLOWED, (error.code(), error.details())
        assert error.details()
        note_case(error.code().name)
    else:
        note_case("answered")
    for req, resp in zip(reqs, responses):
        partials = decode_tensor(resp.partials.partials)
        assert resp.partials.call_id == req.call_id
        assert list(partials.shape) == [sum(s.rows for s in req.segments), h]
        assert bool(torch.isfinite(partials).all()) or any(e for e in specs if e[3] == 3e38)
    assert servicer._computing == 0


def test_the_servicer_answers_a_well_formed_call_and_bad_calls_do_not_grow_memory(served) -> None:  # type: ignore[no-untyped-def]
    servicer, stub = served
    h = hidden_size(servicer)
    good = valid_request(h, 4, 0, [0, 1], 1.0)
    responses, error = call(stub, [good])
    assert error is None and list(decode_tensor(responses[0].partials.partials).shape) == [4, h]
    # A call with no assignments is valid (validate_dispatch accepts it): empty partials, not
    # an IndexError turned into UNKNOWN, as the fuzzer first found.
    empty = valid_request(h, 0, 0, [0], 1.0)
    assert not empty.segments
    responses, error = call(stub, [empty, good])
    assert error is None and [list(decode_tensor(r.partials.partials).shape) for r in responses] == [[0, h], [4, h]]
    bad = [mutate(good, "hidden.data", 5), mutate(good, "segment.expert", 3), mutate(good, "row_index", [9]),
           mutate(good, "nan", None), mutate(good, "segments.clear", None)]

    def round_() -> None:
        for req in bad:
            _, err = call(stub, [req])
            assert err is not None and err.code() in ALLOWED

    for _ in range(20):  # warm up: grpc's and torch's caches fill once
        round_()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(60):
            round_()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 256 << 10, f"{grown} bytes kept after 300 refused calls"
    assert servicer._computing == 0
