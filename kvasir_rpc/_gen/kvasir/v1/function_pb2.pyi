from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExpertGate(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXPERT_GATE_UNSPECIFIED: _ClassVar[ExpertGate]
    EXPERT_GATE_GLU: _ClassVar[ExpertGate]
    EXPERT_GATE_CLAMPED_SWIGLU: _ClassVar[ExpertGate]
    EXPERT_GATE_CLAMPED_GLU: _ClassVar[ExpertGate]
EXPERT_GATE_UNSPECIFIED: ExpertGate
EXPERT_GATE_GLU: ExpertGate
EXPERT_GATE_CLAMPED_SWIGLU: ExpertGate
EXPERT_GATE_CLAMPED_GLU: ExpertGate

class ExpertFunction(_message.Message):
    __slots__ = ("gate", "activation", "alpha", "limit", "interleaved", "transposed", "bias", "layers")
    GATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    INTERLEAVED_FIELD_NUMBER: _ClassVar[int]
    TRANSPOSED_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    gate: ExpertGate
    activation: str
    alpha: float
    limit: float
    interleaved: bool
    transposed: bool
    bias: bool
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, gate: _Optional[_Union[ExpertGate, str]] = ..., activation: _Optional[str] = ..., alpha: _Optional[float] = ..., limit: _Optional[float] = ..., interleaved: _Optional[bool] = ..., transposed: _Optional[bool] = ..., bias: _Optional[bool] = ..., layers: _Optional[_Iterable[int]] = ...) -> None: ...
