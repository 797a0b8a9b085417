"""Tensor codec: torch.Tensor <-> kvasir.v1.Tensor (dtype, shape, raw little-endian bytes)."""

from __future__ import annotations

import math
import sys

import torch

from kvasir_rpc._gen.kvasir.v1 import tensor_pb2

__all__ = ["TensorCodecError", "decode_tensor", "encode_tensor", "encode_tensor_into", "serialize_dispatch_response",
           "DTYPE_TO_WIRE", "WIRE_TO_DTYPE"]

DTYPE_TO_WIRE: dict[torch.dtype, tensor_pb2.DType] = {
    torch.float32: tensor_pb2.D_TYPE_FLOAT32,
    torch.float16: tensor_pb2.D_TYPE_FLOAT16,
    torch.bfloat16: tensor_pb2.D_TYPE_BFLOAT16,
    torch.int32: tensor_pb2.D_TYPE_INT32,
    torch.int64: tensor_pb2.D_TYPE_INT64,
}
WIRE_TO_DTYPE: dict[int, torch.dtype] = {v: k for k, v in DTYPE_TO_WIRE.items()}

# A decoded tensor must fit in memory we are willing to allocate for one call.
MAX_ELEMENTS = 1 << 31

if sys.byteorder != "little":  # pragma: no cover - every platform we ship on is little-endian
    raise ImportError("kvasir_rpc's tensor codec needs a little-endian host")


class TensorCodecError(ValueError):
    """A wire tensor is malformed: unknown dtype, bad shape, or byte length that does not match."""


def encode_tensor(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    """Encode a CPU or device tensor as a wire Tensor (copies to CPU, contiguous).

    Raises TensorCodecError for a dtype the wire does not carry.
    """
    return encode_tensor_into(tensor, tensor_pb2.Tensor())


def encode_tensor_into(tensor: torch.Tensor, msg: tensor_pb2.Tensor) -> tensor_pb2.Tensor:
    """Encode ``tensor`` into ``msg``, an empty Tensor, which may be a field of a larger
    message (``response.partials.partials``): the payload is copied into the message once.
    Building a Tensor and then passing it to the enclosing message's constructor would copy
    the payload again at each level (upb copies submessages), which for a 4 MiB answer was
    more CPU than moving it through the tunnel. Returns ``msg``.

    Raises TensorCodecError for a dtype the wire does not carry.
    """
    wire = DTYPE_TO_WIRE.get(tensor.dtype)
    if wire is None:
        raise TensorCodecError(
            f"dtype {tensor.dtype} has no wire form; use one of {sorted(str(d) for d in DTYPE_TO_WIRE)}"
        )
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    # uint8 view of the storage: one copy into the bytes object, no numpy round trip.
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    msg.dtype = wire
    msg.shape.extend(t.shape)
    msg.data = data
    return msg


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _uint_field(tag: int, value: int) -> bytes:
    """A proto3 uint64/enum field: absent when 0."""
    return bytes([tag]) + _varint(value) if value else b""


def serialize_dispatch_response(call_id: int, partials: torch.Tensor, compute_micros: int) -> bytes:
    """The serialized ``kvasir.v1.DispatchResponse`` of one answer, byte for byte what
    protobuf's ``SerializeToString`` gives for it, with the payload copied once, straight
    from the tensor into the result.

    Through protobuf the payload is copied three times or more (into a bytes object, into the
    message, then into the serialized string as upb's encoder grows its buffer): a tenth of
    a worker's CPU in a decode, for a 4 MiB answer. The layout is the proto's (field numbers
    in ``expert.proto`` and ``tensor.proto``): DispatchResponse.partials (1) = ExpertPartials
    {call_id (1), partials (2) = Tensor {dtype (1), shape (2, packed), data (3)},
    compute_micros (3)}, zero scalars and empty fields left out as proto3 leaves them.

    Raises TensorCodecError for a dtype the wire does not carry."""
    wire = DTYPE_TO_WIRE.get(partials.dtype)
    if wire is None:
        raise TensorCodecError(
            f"dtype {partials.dtype} has no wire form; use one of {sorted(str(d) for d in DTYPE_TO_WIRE)}"
        )
    t = partials.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    packed = b"".join(_varint(d) for d in t.shape)
    head = _uint_field(0x08, int(wire))  # Tensor.dtype
    if packed:
        head += b"\x12" + _varint(len(packed)) + packed  # Tensor.shape
    if nbytes:
        head += b"\x1a" + _varint(nbytes)  # Tensor.data
    tensor_len = len(head) + nbytes
    before = _uint_field(0x08, call_id) + b"\x12" + _varint(tensor_len) + head  # ExpertPartials.call_id, .partials
    after = _uint_field(0x18, compute_micros)  # ExpertPartials.compute_micros
    prefix = b"\x0a" + _varint(len(before) + nbytes + len(after)) + before  # DispatchResponse.partials
    if not nbytes:
        return prefix + after
    return b"".join((prefix, t.reshape(-1).view(torch.uint8).numpy().data, after))


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
