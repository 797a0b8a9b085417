"""The wire's tensors without torch: what the codec (``_codec``, torch tensors) and the numpy
worker (``_np_kernel``, numpy arrays) share: the error, the dtypes, the size limit, the
varints of a hand-serialized message; and the numpy side's decoding of a wire Tensor and
serializing of a DispatchResponse, byte for byte the layout ``_codec`` writes."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvasir_rpc._gen.kvasir.v1 import tensor_pb2

__all__ = ["MAX_ELEMENTS", "WIRE_DTYPE_NAMES", "TensorCodecError", "bfloat16_bits", "decode_array",
           "serialize_array_response"]

if sys.byteorder != "little":  # pragma: no cover - every platform we ship on is little-endian
    raise ImportError("kvasir_rpc's tensor codec needs a little-endian host")

# A decoded tensor must fit in memory we are willing to allocate for one call.
MAX_ELEMENTS = 1 << 31

#: kvasir.v1.DType's values (tensor.proto) by the name torch gives the dtype, and back.
WIRE_DTYPE_NAMES: dict[str, int] = {"float32": 1, "float16": 2, "bfloat16": 3, "int32": 4, "int64": 5}
_NAMES = {v: k for k, v in WIRE_DTYPE_NAMES.items()}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}
# The numpy dtype each wire dtype's bytes are read as (bfloat16: its bits, widened below).
_STORED = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int32": np.int32,
           "int64": np.int64}


class TensorCodecError(ValueError):
    """A wire tensor is malformed: unknown dtype, bad shape, or byte length that does not match."""


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


def _join(parts: list[bytes | memoryview | None]) -> bytes:
    return b"".join(p for p in parts if p is not None)


def _field(tag: int, wire: int, shape: tuple[int, ...], payload: memoryview | None) -> tuple[bytes, memoryview | None]:
    """A Tensor message as field ``tag`` of the message it is in: (the bytes before its payload,
    its payload or None when it has none); the layout of ``_codec._tensor_field``."""
    nbytes = payload.nbytes if payload is not None else 0
    packed = b"".join(_varint(d) for d in shape)
    head = _uint_field(0x08, wire)  # Tensor.dtype
    if packed:
        head += b"\x12" + _varint(len(packed)) + packed  # Tensor.shape
    if not nbytes:
        return bytes([tag]) + _varint(len(head)) + head, None
    head += b"\x1a" + _varint(nbytes)  # Tensor.data
    return bytes([tag]) + _varint(len(head) + nbytes) + head, payload


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to bfloat16 (to nearest, ties to even, as torch's cast rounds; a
    NaN stays a NaN, 0x7FC0), as uint16 bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0  # the bits above could carry a NaN's low payload into infinity
    return out


def _narrowed(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``x`` as ``dtype``'s bytes travel (float16 and bfloat16 rounded to nearest even)."""
    if dtype == "float32":
        return np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float16":
        with np.errstate(over="ignore"):  # beyond float16's range: infinity, as torch's cast gives
            return np.ascontiguousarray(x.astype(np.float16))
    if dtype == "bfloat16":
        return bfloat16_bits(x)
    raise TensorCodecError(f"dtype {dtype} has no wire form for partials; use float32, float16 or bfloat16")


def decode_array(msg: tensor_pb2.Tensor) -> tuple[np.ndarray, str]:
    """A wire Tensor as ``(values, dtype name)``: floating values widened to float32 (exactly:
    float16 and bfloat16 are subsets of it), integers as they are. Raises TensorCodecError as
    ``_codec.decode_tensor`` does: unknown dtype, too many elements, or a byte length that is
    not prod(shape) * itemsize."""
    name = _NAMES.get(msg.dtype)
    if name is None:
        raise TensorCodecError(f"unknown tensor dtype {msg.dtype}")
    shape = tuple(int(d) for d in msg.shape)
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise TensorCodecError(f"tensor of shape {list(shape)} has too many elements, more than {MAX_ELEMENTS}")
    count = math.prod(shape)
    data = msg.data  # one read: some protobuf backends copy on every access
    if len(data) != count * _ITEMSIZE[name]:
        raise TensorCodecError(
            f"tensor of shape {list(shape)} and dtype torch.{name} needs {count * _ITEMSIZE[name]} bytes, "
            f"got {len(data)}")
    raw = np.frombuffer(data, dtype=_STORED[name], count=count).reshape(shape)
    if name == "bfloat16":
        return (raw.astype(np.uint32) << np.uint32(16)).view(np.float32), name
    if name == "float16":
        return raw.astype(np.float32), name
    return raw, name


def serialize_array_response(call_id: int, partials: np.ndarray, dtype: str, compute_micros: int,
                             projections: np.ndarray | None = None) -> bytes:
    """The serialized ``kvasir.v1.DispatchResponse`` of one answer from float32 arrays, each
    rounded to ``dtype`` (the wire dtype the call's rows came in): the bytes
    ``_codec.serialize_dispatch_response`` writes for tensors of that dtype and these values.
    Raises TensorCodecError for a dtype partials cannot travel in."""
    wire = WIRE_DTYPE_NAMES[dtype]

    def field(tag: int, x: np.ndarray) -> tuple[bytes, memoryview | None]:
        stored = _narrowed(x, dtype)
        return _field(tag, wire, tuple(x.shape), stored.reshape(-1).view(np.uint8).data if x.size else None)

    head, payload = field(0x12, partials)  # ExpertPartials.partials
    before = _uint_field(0x08, call_id) + head  # ExpertPartials.call_id
    after = _uint_field(0x18, compute_micros)  # ExpertPartials.compute_micros
    extra_head, extra = field(0x22, projections) if projections is not None else (b"", None)
    after += extra_head  # ExpertPartials.projections
    size = sum(len(p) for p in (before, payload, after, extra) if p is not None)
    return _join([b"\x0a" + _varint(size) + before, payload, after, extra])  # DispatchResponse.partials

