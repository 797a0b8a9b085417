from kvasir_rpc._gen.kvasir.v1 import function_pb2 as _function_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_token_ids", "max_tokens", "sampling", "stop", "ignore_eos", "digest_logits")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_LOGITS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: Sampling
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    digest_logits: bool
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., digest_logits: _Optional[bool] = ...) -> None: ...

class GenerateSummary(_message.Message):
    __slots__ = ("finish_reason", "stop", "prompt_tokens", "completion_tokens", "queue_seconds", "time_to_first_token_seconds", "total_seconds", "tokens_per_second", "remote_rows", "local_rows", "fallback_rows", "max_batch_size", "seed", "logits_digest")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGITS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    stop: str
    prompt_tokens: int
    completion_tokens: int
    queue_seconds: float
    time_to_first_token_seconds: float
    total_seconds: float
    tokens_per_second: float
    remote_rows: int
    local_rows: int
    fallback_rows: int
    max_batch_size: int
    seed: int
    logits_digest: bytes
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., time_to_first_token_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., remote_rows: _Optional[int] = ..., local_rows: _Optional[int] = ..., fallback_rows: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., seed: _Optional[int] = ..., logits_digest: _Optional[bytes] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "summary")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    summary: GenerateSummary
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., summary: _Optional[_Union[GenerateSummary, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "architecture", "context_length", "layers", "experts_per_layer", "experts_per_token", "dtype", "created", "expert_functions")
    ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    architecture: str
    context_length: int
    layers: int
    experts_per_layer: int
    experts_per_token: int
    dtype: str
    created: int
    expert_functions: _containers.RepeatedCompositeFieldContainer[_function_pb2.ExpertFunction]
    def __init__(self, id: _Optional[str] = ..., architecture: _Optional[str] = ..., context_length: _Optional[int] = ..., layers: _Optional[int] = ..., experts_per_layer: _Optional[int] = ..., experts_per_token: _Optional[int] = ..., dtype: _Optional[str] = ..., created: _Optional[int] = ..., expert_functions: _Optional[_Iterable[_Union[_function_pb2.ExpertFunction, _Mapping]]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...

class BackboneServiceDescribeRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class LayerCoverage(_message.Message):
    __slots__ = ("layer", "experts", "covered")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    COVERED_FIELD_NUMBER: _ClassVar[int]
    layer: int
    experts: int
    covered: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., experts: _Optional[int] = ..., covered: _Optional[_Iterable[int]] = ...) -> None: ...

class BackboneServiceDescribeResponse(_message.Message):
    __slots__ = ("model", "layers", "coverage", "live_sessions", "running", "waiting", "max_batch_size", "max_waiting", "remote", "stats")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    model: ModelCard
    layers: _containers.RepeatedCompositeFieldContainer[LayerCoverage]
    coverage: float
    live_sessions: int
    running: int
    waiting: int
    max_batch_size: int
    max_waiting: int
    remote: bool
    stats: ExpertPathStats
    def __init__(self, model: _Optional[_Union[ModelCard, _Mapping]] = ..., layers: _Optional[_Iterable[_Union[LayerCoverage, _Mapping]]] = ..., coverage: _Optional[float] = ..., live_sessions: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_waiting: _Optional[int] = ..., remote: _Optional[bool] = ..., stats: _Optional[_Union[ExpertPathStats, _Mapping]] = ...) -> None: ...

class ExpertPathStats(_message.Message):
    __slots__ = ("remote_calls", "remote_rows", "local_rows", "fallback_calls", "fallback_rows", "hedged_calls", "audited_rows", "audit_exact_rows", "sessions_quarantined", "replays", "requests_finished", "tokens_generated", "sessions_used", "shared_overlapped")
    REMOTE_CALLS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_CALLS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ROWS_FIELD_NUMBER: _ClassVar[int]
    HEDGED_CALLS_FIELD_NUMBER: _ClassVar[int]
    AUDITED_ROWS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_EXACT_ROWS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_USED_FIELD_NUMBER: _ClassVar[int]
    SHARED_OVERLAPPED_FIELD_NUMBER: _ClassVar[int]
    remote_calls: int
    remote_rows: int
    local_rows: int
    fallback_calls: int
    fallback_rows: int
    hedged_calls: int
    audited_rows: int
    audit_exact_rows: int
    sessions_quarantined: _containers.RepeatedScalarFieldContainer[str]
    replays: int
    requests_finished: int
    tokens_generated: int
    sessions_used: _containers.RepeatedScalarFieldContainer[str]
    shared_overlapped: int
    def __init__(self, remote_calls: _Optional[int] = ..., remote_rows: _Optional[int] = ..., local_rows: _Optional[int] = ..., fallback_calls: _Optional[int] = ..., fallback_rows: _Optional[int] = ..., hedged_calls: _Optional[int] = ..., audited_rows: _Optional[int] = ..., audit_exact_rows: _Optional[int] = ..., sessions_quarantined: _Optional[_Iterable[str]] = ..., replays: _Optional[int] = ..., requests_finished: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., sessions_used: _Optional[_Iterable[str]] = ..., shared_overlapped: _Optional[int] = ...) -> None: ...
