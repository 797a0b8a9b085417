"""Tensor codec: torch.Tensor <-> kvasir.v1.Tensor (dtype, shape, raw little-endian bytes)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvasir_rpc._gen.kvasir.v1 import expert_pb2, tensor_pb2
# Shared with the numpy worker's codec, which must not import torch.
from kvasir_rpc._wire import MAX_ELEMENTS, TensorCodecError, _join, _uint_field, _varint

__all__ = ["TensorCodecError", "decode_tensor", "encode_tensor", "encode_tensor_into", "serialize_dispatch_request",
           "serialize_dispatch_response", "DTYPE_TO_WIRE", "WIRE_TO_DTYPE"]

DTYPE_TO_WIRE: dict[torch.dtype, tensor_pb2.DType] = {
    torch.float32: tensor_pb2.D_TYPE_FLOAT32,
    torch.float16: tensor_pb2.D_TYPE_FLOAT16,
    torch.bfloat16: tensor_pb2.D_TYPE_BFLOAT16,
    torch.int32: tensor_pb2.D_TYPE_INT32,
    torch.int64: tensor_pb2.D_TYPE_INT64,
}
WIRE_TO_DTYPE: dict[int, torch.dtype] = {v: k for k, v in DTYPE_TO_WIRE.items()}


def encode_tensor(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    """Encode a CPU or device tensor as a wire Tensor (copies to CPU, contiguous).

    Raises TensorCodecError for a dtype the wire does not carry.
    """
    return encode_tensor_into(tensor, tensor_pb2.Tensor())


def _on_the_wire(tensor: torch.Tensor) -> tuple[tensor_pb2.DType, torch.Tensor]:
    """``tensor``'s wire dtype and its bytes as they travel: on the CPU, contiguous. Raises
    TensorCodecError for a dtype the wire does not carry."""
    wire = DTYPE_TO_WIRE.get(tensor.dtype)
    if wire is None:
        raise TensorCodecError(
            f"dtype {tensor.dtype} has no wire form; use one of {sorted(str(d) for d in DTYPE_TO_WIRE)}"
        )
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return wire, t.contiguous()


def encode_tensor_into(tensor: torch.Tensor, msg: tensor_pb2.Tensor) -> tensor_pb2.Tensor:
    """Encode ``tensor`` into ``msg``, an empty Tensor, which may be a field of a larger
    message (``response.partials.partials``): the payload is copied into the message once.
    Building a Tensor and then passing it to the enclosing message's constructor would copy
    the payload again at each level (upb copies submessages), which for a 4 MiB answer was
    more CPU than moving it through the tunnel. Returns ``msg``.

    Raises TensorCodecError for a dtype the wire does not carry.
    """
    wire, t = _on_the_wire(tensor)
    # uint8 view of the storage: one copy into the bytes object, no numpy round trip.
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    msg.dtype = wire
    msg.shape.extend(t.shape)
    msg.data = data
    return msg


def _tensor_field(tag: int, tensor: torch.Tensor) -> tuple[bytes, memoryview | None]:
    """A Tensor message as a field ``tag`` of the message it is in: (the bytes before its
    payload, its payload as a view of the tensor's memory or None when it has none).

    Raises TensorCodecError for a dtype the wire does not carry."""
    wire, t = _on_the_wire(tensor)
    nbytes = t.numel() * t.element_size()
    packed = b"".join(_varint(d) for d in t.shape)
    head = _uint_field(0x08, int(wire))  # Tensor.dtype
    if packed:
        head += b"\x12" + _varint(len(packed)) + packed  # Tensor.shape
    if not nbytes:
        return bytes([tag]) + _varint(len(head)) + head, None
    head += b"\x1a" + _varint(nbytes)  # Tensor.data
    return bytes([tag]) + _varint(len(head) + nbytes) + head, t.reshape(-1).view(torch.uint8).numpy().data


def serialize_dispatch_response(call_id: int, partials: torch.Tensor, compute_micros: int,
                                projections: torch.Tensor | None = None) -> bytes:
    """The serialized ``kvasir.v1.DispatchResponse`` of one answer, byte for byte what
    protobuf's ``SerializeToString`` gives for it, with the payload copied once, straight
    from the tensor into the result.

    Through protobuf (this protobuf, upb) a message built with a large bytes field and then
    serialized costs about 3 ns per byte of it, 13 ms for a 4 MiB answer: a tenth of a
    worker's CPU in a decode; this costs 0.04 ns per byte. The layout is the proto's (field numbers in
    ``expert.proto`` and ``tensor.proto``): DispatchResponse.partials (1) = ExpertPartials
    {call_id (1), partials (2) = Tensor {dtype (1), shape (2, packed), data (3)},
    compute_micros (3), projections (4) = Tensor, when given}, zero scalars and empty fields
    left out as proto3 leaves them.

    Raises TensorCodecError for a dtype the wire does not carry."""
    head, payload = _tensor_field(0x12, partials)  # ExpertPartials.partials
    before = _uint_field(0x08, call_id) + head  # ExpertPartials.call_id
    after = _uint_field(0x18, compute_micros)  # ExpertPartials.compute_micros
    extra_head, extra = _tensor_field(0x22, projections) if projections is not None else (b"", None)
    after += extra_head  # ExpertPartials.projections
    size = sum(len(p) for p in (before, payload, after, extra) if p is not None)
    return _join([b"\x0a" + _varint(size) + before, payload, after, extra])  # DispatchResponse.partials


def serialize_dispatch_request(call_id: int, layer: int, hidden: torch.Tensor, weights: torch.Tensor,
                               segments: Sequence[tuple[int, int]], row_index: Sequence[int] = (),
                               projections: bool = False) -> bytes:
    """The serialized ``kvasir.v1.DispatchRequest`` of one call, byte for byte what
    protobuf's ``SerializeToString`` gives for it (see serialize_dispatch_response for why),
    ``segments`` as (expert, rows) pairs. Fields in number order: call_id (1), layer (2),
    hidden (3), segments (4), weights (5), row_index (6, packed), projections (7).

    Raises TensorCodecError for a dtype the wire does not carry."""
    hidden_head, hidden_data = _tensor_field(0x1A, hidden)
    weights_head, weights_data = _tensor_field(0x2A, weights)
    # The repeated fields through protobuf: small, and many varints, which it writes in C.
    segs = expert_pb2.DispatchRequest(
        segments=[expert_pb2.ExpertSegment(expert=e, rows=r) for e, r in segments]).SerializeToString()
    index = expert_pb2.DispatchRequest(row_index=row_index).SerializeToString() if len(row_index) else b""
    return _join([_uint_field(0x08, call_id) + _uint_field(0x10, layer) + hidden_head, hidden_data,
                  segs + weights_head, weights_data, index + _uint_field(0x38, int(projections))])


def decode_tensor(msg: tensor_pb2.Tensor) -> torch.Tensor:
    """Decode a wire Tensor as a view over the message's payload bytes (no copy beyond the
    one some protobuf backends make when the field is read; the result shares that buffer
    and is read-only: clone it before writing in place).

    Raises TensorCodecError when the dtype is unknown, the shape is too large, or the byte
    length does not equal prod(shape) * itemsize.
    """
    dtype = WIRE_TO_DTYPE.get(msg.dtype)
    if dtype is None:
        raise TensorCodecError(f"unknown tensor dtype {msg.dtype}")
    shape = tuple(int(d) for d in msg.shape)
    # Bound the extent even of zero-element shapes: torch computes strides from every dim.
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise TensorCodecError(f"tensor of shape {list(shape)} has too many elements, more than {MAX_ELEMENTS}")
    count = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    data = msg.data  # one read: some protobuf backends copy on every access
    if len(data) != count * itemsize:
        raise TensorCodecError(
            f"tensor of shape {list(shape)} and dtype {dtype} needs {count * itemsize} bytes, got {len(data)}"
        )
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    # frombuffer shares memory with the immutable bytes object; torch warns that it is
    # not writable, which is exactly the contract we document.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)
