from kvasir_rpc._gen.kvasir.v1 import session_pb2 as _session_pb2
from kvasir_rpc._gen.kvasir.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExpertSegment(_message.Message):
    __slots__ = ("expert", "rows")
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    expert: int
    rows: int
    def __init__(self, expert: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

class DispatchRequest(_message.Message):
    __slots__ = ("call_id", "layer", "hidden", "segments", "weights", "row_index", "projections")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ROW_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROJECTIONS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    layer: int
    hidden: _tensor_pb2.Tensor
    segments: _containers.RepeatedCompositeFieldContainer[ExpertSegment]
    weights: _tensor_pb2.Tensor
    row_index: _containers.RepeatedScalarFieldContainer[int]
    projections: bool
    def __init__(self, call_id: _Optional[int] = ..., layer: _Optional[int] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., segments: _Optional[_Iterable[_Union[ExpertSegment, _Mapping]]] = ..., weights: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., row_index: _Optional[_Iterable[int]] = ..., projections: _Optional[bool] = ...) -> None: ...

class ExpertPartials(_message.Message):
    __slots__ = ("call_id", "partials", "compute_micros", "projections")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PARTIALS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MICROS_FIELD_NUMBER: _ClassVar[int]
    PROJECTIONS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    partials: _tensor_pb2.Tensor
    compute_micros: int
    projections: _tensor_pb2.Tensor
    def __init__(self, call_id: _Optional[int] = ..., partials: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., compute_micros: _Optional[int] = ..., projections: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DispatchResponse(_message.Message):
    __slots__ = ("partials",)
    PARTIALS_FIELD_NUMBER: _ClassVar[int]
    partials: ExpertPartials
    def __init__(self, partials: _Optional[_Union[ExpertPartials, _Mapping]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("wallet", "slices", "weights_digest", "device", "model_type", "hidden_size", "dtype")
    WALLET_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    wallet: str
    slices: _containers.RepeatedCompositeFieldContainer[_session_pb2.ExpertSlice]
    weights_digest: bytes
    device: str
    model_type: str
    hidden_size: int
    dtype: _tensor_pb2.DType
    def __init__(self, wallet: _Optional[str] = ..., slices: _Optional[_Iterable[_Union[_session_pb2.ExpertSlice, _Mapping]]] = ..., weights_digest: _Optional[bytes] = ..., device: _Optional[str] = ..., model_type: _Optional[str] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ...) -> None: ...
