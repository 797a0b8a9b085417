"""Tensor codec: torch.Tensor <-> kvasir.v1.Tensor.

The decoder is a parser of bytes from the network, so besides round trips it is fed
truncated, padded and arbitrary input: it returns a tensor whose byte size is exactly
len(data) or raises TensorCodecError, never anything else.
"""

import ctypes
import gc
import math
import resource

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvasir_rpc._codec import (
    DTYPE_TO_WIRE,
    MAX_ELEMENTS,
    WIRE_TO_DTYPE,
    TensorCodecError,
    decode_tensor,
    encode_tensor,
    encode_tensor_into,
    serialize_dispatch_request,
    serialize_dispatch_response,
)
from kvasir_rpc._gen.kvasir.v1 import tensor_pb2

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64]
ITEMSIZE = {d: torch.empty((), dtype=d).element_size() for d in DTYPES}

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes in C order; compares floats bitwise (NaN payloads, -0.0 included)."""
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _random_tensor(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def _bytes_address(b: bytes) -> int:
    # c_char_p built from a bytes object points at that object's own buffer (no copy).
    return ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value


def _over_the_wire(msg: tensor_pb2.Tensor) -> tensor_pb2.Tensor:
    """Serialize and parse again, as the receiving side sees the message."""
    out = tensor_pb2.Tensor()
    out.ParseFromString(msg.SerializeToString())
    return out


class _Msg:
    """Stands in for a wire Tensor whose ``data`` is one bytes object the test holds (the
    upb message hands out a fresh bytes object on every ``.data`` read, see below)."""

    def __init__(self, dtype, shape, data):
        self.dtype = dtype
        self.shape = list(shape)
        self.data = data


shapes = st.one_of(
    st.just(()),  # scalar
    st.lists(st.integers(0, 5), min_size=1, max_size=4).map(tuple),
)


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0, 2), (7,), (2, 3), (2, 3, 4), (1, 1, 1, 1, 5)])
def test_round_trip_examples(dtype, shape):
    t = _random_tensor(shape, dtype, seed=1)
    msg = encode_tensor(t)
    assert msg.dtype == DTYPE_TO_WIRE[dtype]
    assert tuple(msg.shape) == shape
    assert len(msg.data) == math.prod(shape) * ITEMSIZE[dtype]
    out = decode_tensor(_over_the_wire(msg))
    assert out.dtype == dtype
    assert out.shape == t.shape
    assert _raw(out) == _raw(t)


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), shape=shapes, seed=st.integers(0, 2**32 - 1))
def test_round_trip_property(dtype, shape, seed):
    t = _random_tensor(shape, dtype, seed)
    out = decode_tensor(_over_the_wire(encode_tensor(t)))
    assert out.dtype == dtype and out.shape == t.shape
    assert _raw(out) == _raw(t)


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), shape=shapes, data=st.data())
def test_decode_then_encode_keeps_every_byte(dtype, shape, data):
    # Any payload of the right length is a valid tensor, NaN payloads and -0.0 included;
    # the codec must not canonicalise anything.
    payload = data.draw(st.binary(min_size=math.prod(shape) * ITEMSIZE[dtype], max_size=math.prod(shape) * ITEMSIZE[dtype]))
    msg = tensor_pb2.Tensor(dtype=DTYPE_TO_WIRE[dtype], shape=list(shape), data=payload)
    again = encode_tensor(decode_tensor(msg))
    assert again.data == payload
    assert list(again.shape) == list(shape) and again.dtype == msg.dtype


def test_special_float_values_round_trip_bitwise():
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, 3.4e38])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = t.to(dtype)
        assert _raw(decode_tensor(encode_tensor(x))) == _raw(x)


def test_wire_tables_are_inverse_and_cover_the_proto_enum():
    assert {WIRE_TO_DTYPE[w]: w for w in WIRE_TO_DTYPE} == DTYPE_TO_WIRE
    named = {v.number for v in tensor_pb2.DType.DESCRIPTOR.values} - {tensor_pb2.D_TYPE_UNSPECIFIED}
    assert set(WIRE_TO_DTYPE) == named


# --- encode --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),  # transposed
        lambda: torch.arange(24, dtype=torch.int64).reshape(4, 6)[:, ::2],  # strided
        lambda: torch.arange(3, dtype=torch.float16).reshape(3, 1).expand(3, 4),  # stride 0
        lambda: torch.arange(10, dtype=torch.int32)[3:7],  # storage offset
        lambda: torch.randn(3, 4, requires_grad=True),
    ],
    ids=["transposed", "strided", "expanded", "offset", "requires_grad"],
)
def test_encode_non_contiguous_and_views(make):
    t = make()
    msg = encode_tensor(t)
    assert len(msg.data) == t.numel() * t.element_size()
    out = decode_tensor(_over_the_wire(msg))
    assert torch.equal(out, t.detach())


@pytest.mark.parametrize(
    "dtype", [torch.bool, torch.float64, torch.uint8, torch.int8, torch.int16, torch.complex64], ids=str
)
def test_encode_dtype_without_wire_form_raises(dtype):
    t = torch.zeros(3, dtype=dtype)
    with pytest.raises(TensorCodecError, match=str(dtype).replace(".", r"\.")):
        encode_tensor(t)


# --- decode: zero copy ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_shares_memory_with_the_data_bytes(dtype):
    data = _raw(_random_tensor((64, 33), dtype, seed=2))
    t = decode_tensor(_Msg(DTYPE_TO_WIRE[dtype], (64, 33), data))
    assert t.data_ptr() == _bytes_address(data)
    assert t.untyped_storage().data_ptr() == _bytes_address(data)
    assert t.untyped_storage().nbytes() == len(data)


def test_decode_large_tensor_is_one_view_over_one_buffer():
    src = torch.randn(1024, 2048)  # 8 MiB
    msg = _over_the_wire(encode_tensor(src))
    t = decode_tensor(msg)
    # A view at offset 0 over a buffer of exactly the payload: no padded or second copy.
    assert t.untyped_storage().nbytes() == len(msg.data) == src.numel() * 4
    assert t.untyped_storage().data_ptr() == t.data_ptr()
    assert t.is_contiguous()
    assert torch.equal(t, src)


def test_decoded_tensor_outlives_the_message():
    src = torch.randn(256, 64)
    msg = _over_the_wire(encode_tensor(src))
    t = decode_tensor(msg)
    del msg
    gc.collect()
    torch.randn(256, 64) + 1  # churn the allocator
    assert torch.equal(t, src)


class _CountingMsg:
    def __init__(self, msg):
        self._msg = msg
        self.dtype = msg.dtype
        self.shape = msg.shape
        self.reads = 0

    @property
    def data(self):
        self.reads += 1
        return self._msg.data


def test_decode_reads_the_payload_once():
    wire = _over_the_wire(encode_tensor(torch.randn(16, 16)))
    assert wire.data is not wire.data  # the upb behaviour that makes each read a copy
    counting = _CountingMsg(wire)
    decode_tensor(counting)
    assert counting.reads == 1


# --- decode: malformed input ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 4), (2, 0)])
@pytest.mark.parametrize("delta", [-1, +1, +7])
def test_byte_length_mismatch_names_the_expected_count(dtype, shape, delta):
    expected = math.prod(shape) * ITEMSIZE[dtype]
    n = expected + delta
    if n < 0:
        n = expected + 1
    msg = tensor_pb2.Tensor(dtype=DTYPE_TO_WIRE[dtype], shape=list(shape), data=bytes(n))
    with pytest.raises(TensorCodecError) as exc:
        decode_tensor(_over_the_wire(msg))
    assert f"needs {expected} bytes" in str(exc.value)
    assert f"got {n}" in str(exc.value)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_truncated_payload_at_every_length_raises(dtype):
    full = _raw(_random_tensor((3, 5), dtype, seed=3))
    for n in range(len(full)):
        msg = tensor_pb2.Tensor(dtype=DTYPE_TO_WIRE[dtype], shape=[3, 5], data=full[:n])
        with pytest.raises(TensorCodecError, match=f"needs {len(full)} bytes, got {n}"):
            decode_tensor(msg)


@pytest.mark.parametrize("wire", [tensor_pb2.D_TYPE_UNSPECIFIED, 6, 99, 2**31 - 1, -1])
def test_unknown_dtype_raises(wire):
    msg = tensor_pb2.Tensor(shape=[2], data=bytes(8))
    msg.dtype = wire  # proto3 enums are open: unknown numbers parse and must be refused here
    with pytest.raises(TensorCodecError, match=f"unknown tensor dtype {wire}"):
        decode_tensor(_over_the_wire(msg))


@pytest.mark.parametrize(
    "shape",
    [
        [MAX_ELEMENTS + 1],
        [2**16, 2**16, 2],
        [2**32, 2**32],
        [2**64 - 1],
        [2**64 - 1, 2**64 - 1, 2**64 - 1],
        [3] * 40,
    ],
    ids=["2^31+1", "2^33", "2^64", "u64max", "u64max^3", "3^40"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_huge_shape_raises_before_allocating(shape, dtype):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    msg = tensor_pb2.Tensor(dtype=DTYPE_TO_WIRE[dtype], shape=shape, data=bytes(16))
    with pytest.raises(TensorCodecError, match="elements, more than"):
        decode_tensor(_over_the_wire(msg))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024


def test_exactly_max_elements_is_a_length_error_not_an_allocation():
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.D_TYPE_FLOAT32, shape=[MAX_ELEMENTS], data=b"")
    with pytest.raises(TensorCodecError, match=f"needs {MAX_ELEMENTS * 4} bytes, got 0"):
        decode_tensor(msg)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_sized_with_large_dims_decodes(dtype):
    msg = tensor_pb2.Tensor(dtype=DTYPE_TO_WIRE[dtype], shape=[0, 2**20, 7], data=b"")
    t = decode_tensor(msg)
    assert t.shape == (0, 2**20, 7) and t.dtype == dtype and t.numel() == 0


@pytest.mark.parametrize(
    "shape", [[0, 2**63], [0, 2**64 - 1], [2**64 - 1, 0], [0, 2**40, 2**40, 2**40]], ids=str
)
def test_zero_sized_with_overflowing_dims_raises_codec_error(shape):
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.D_TYPE_FLOAT32, shape=shape, data=b"")
    try:
        decode_tensor(_over_the_wire(msg))
    except TensorCodecError:
        pass


def _decode_or_codec_error(msg):
    try:
        t = decode_tensor(msg)
    except TensorCodecError:
        return
    assert t.untyped_storage().nbytes() >= t.numel() * t.element_size()
    assert t.numel() * t.element_size() == len(msg.data)
    assert t.dtype == WIRE_TO_DTYPE[msg.dtype]
    assert list(t.shape) == list(msg.shape)


def _varint(n):
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


# Wire fragments that often make a parseable Tensor (dtype, packed or unpacked shape,
# data) mixed with arbitrary bytes, so the decoder sees many parsed messages and the
# parser sees junk.
_u64 = st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1))
_fragment = st.one_of(
    _u64.map(lambda v: b"\x08" + _varint(v)),  # dtype
    _u64.map(lambda v: b"\x10" + _varint(v)),  # one shape entry
    st.lists(_u64, max_size=4).map(lambda vs: b"\x12" + _varint(len(b"".join(map(_varint, vs)))) + b"".join(map(_varint, vs))),
    st.binary(max_size=40).map(lambda d: b"\x1a" + _varint(len(d)) + d),  # data
    st.binary(max_size=6),  # junk
)
wire_bytes = st.one_of(st.binary(max_size=96), st.lists(_fragment, max_size=6).map(b"".join))


@settings(max_examples=500, deadline=None)
@given(wire_bytes)
def test_any_bytes_parse_and_decode_or_raise_codec_error(raw):
    msg = tensor_pb2.Tensor()
    try:
        msg.ParseFromString(raw)
    except DecodeError:
        return  # the protobuf layer's own error; the codec never sees these bytes
    _decode_or_codec_error(msg)


def _exact_or_random_data(draw_dtype_shape):
    wire, shape = draw_dtype_shape
    dtype = WIRE_TO_DTYPE.get(wire)
    options = [st.binary(max_size=64)]
    if dtype is not None and math.prod(shape) * ITEMSIZE[dtype] <= 4096:
        n = math.prod(shape) * ITEMSIZE[dtype]
        options.append(st.binary(min_size=n, max_size=n))
    return st.one_of(*options).map(lambda data: tensor_pb2.Tensor(dtype=wire, shape=shape, data=data))


# Dimensions below 2**15 with at most 4 of them keep every product inside int64; the
# overflowing cases have their own test above.
structured = st.tuples(
    st.one_of(st.sampled_from(sorted(WIRE_TO_DTYPE)), st.integers(-(2**31), 2**31 - 1)),
    st.lists(st.one_of(st.integers(0, 4), st.integers(0, 2**15)), max_size=4),
).flatmap(_exact_or_random_data)


@settings(max_examples=400, deadline=None)
@given(structured)
def test_structured_messages_decode_or_raise_codec_error(msg):
    _decode_or_codec_error(_over_the_wire(msg))


def test_trailing_bytes_after_a_valid_tensor_message():
    # Appending an unknown field leaves the tensor as it was; appending a second `data`
    # field replaces it (last one wins) and the length check catches the mismatch;
    # appending a broken tag is a parse error before the codec sees anything.
    src = torch.arange(6, dtype=torch.int32)
    wire = encode_tensor(src).SerializeToString()

    unknown = tensor_pb2.Tensor()
    unknown.ParseFromString(wire + b"\x78\x01")  # field 15, varint 1
    assert torch.equal(decode_tensor(unknown), src)

    replaced = tensor_pb2.Tensor()
    replaced.ParseFromString(wire + b"\x1a\x03abc")  # field 3 (data) again
    with pytest.raises(TensorCodecError, match="needs 24 bytes, got 3"):
        decode_tensor(replaced)

    with pytest.raises(DecodeError):
        tensor_pb2.Tensor().ParseFromString(wire + b"\xff")


# --- a worker's serialized answer ----------------------------------------------------------


def _through_protobuf(call_id: int, t: torch.Tensor, micros: int, projections: torch.Tensor | None = None) -> bytes:
    from kvasir_rpc import expert_pb2

    resp = expert_pb2.DispatchResponse()
    encode_tensor_into(t, resp.partials.partials)
    resp.partials.call_id = call_id
    resp.partials.compute_micros = micros
    if projections is not None:
        encode_tensor_into(projections, resp.partials.projections)
    return resp.SerializeToString()


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), shape=shapes, seed=st.integers(0, 2**32 - 1),
       call_id=st.one_of(st.just(0), st.integers(0, 2**64 - 1)), micros=st.one_of(st.just(0), st.integers(0, 2**64 - 1)),
       projections=st.one_of(st.none(), shapes))
def test_serialized_answer_is_what_protobuf_serializes(dtype, shape, seed, call_id, micros, projections):
    t = _random_tensor(shape, dtype, seed)
    p = _random_tensor(projections, dtype, seed + 1) if projections is not None else None
    assert serialize_dispatch_response(call_id, t, micros, p) == _through_protobuf(call_id, t, micros, p)


@pytest.mark.parametrize("shape", [(512, 2048), (3, 128 * 1024)])  # payload lengths of 3 and 4 varint bytes
def test_serialized_answer_of_a_large_payload(shape):
    t = torch.randn(shape)[:, 1:]  # not contiguous: serialized as its contiguous copy
    got = serialize_dispatch_response(2**40, t, 123_456)
    assert got == _through_protobuf(2**40, t, 123_456)
    from kvasir_rpc import expert_pb2

    out = decode_tensor(expert_pb2.DispatchResponse.FromString(got).partials.partials)
    assert _raw(out) == _raw(t)


def test_serialized_answer_refuses_a_dtype_without_wire_form():
    with pytest.raises(TensorCodecError, match="no wire form"):
        serialize_dispatch_response(1, torch.zeros(2, dtype=torch.uint8), 0)


@SETTINGS
@given(hidden_dtype=st.sampled_from(DTYPES), hidden_shape=shapes, seed=st.integers(0, 2**32 - 1),
       call_id=st.integers(0, 2**64 - 1), layer=st.integers(0, 2**32 - 1),
       segments=st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)), max_size=6),
       row_index=st.lists(st.integers(0, 2**32 - 1), max_size=20), weights_len=st.integers(0, 9),
       projections=st.booleans())
def test_serialized_call_is_what_protobuf_serializes(hidden_dtype, hidden_shape, seed, call_id, layer, segments,
                                                     row_index, weights_len, projections):
    from kvasir_rpc import expert_pb2

    hidden = _random_tensor(hidden_shape, hidden_dtype, seed)
    weights = _random_tensor((weights_len,), torch.float32, seed + 1)
    req = expert_pb2.DispatchRequest(
        call_id=call_id, layer=layer, hidden=encode_tensor(hidden), weights=encode_tensor(weights),
        segments=[expert_pb2.ExpertSegment(expert=e, rows=r) for e, r in segments], row_index=row_index,
        projections=projections)
    got = serialize_dispatch_request(call_id, layer, hidden, weights, segments, row_index, projections)
    assert got == req.SerializeToString()
    assert len(got) == req.ByteSize()
