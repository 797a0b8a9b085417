from kvasir_rpc._gen.kvasir.v1 import function_pb2 as _function_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TunnelAead(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TUNNEL_AEAD_UNSPECIFIED: _ClassVar[TunnelAead]
    TUNNEL_AEAD_AES_256_GCM: _ClassVar[TunnelAead]

class Violation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VIOLATION_UNSPECIFIED: _ClassVar[Violation]
    VIOLATION_NON_FINITE: _ClassVar[Violation]
    VIOLATION_AUDIT_MISMATCH: _ClassVar[Violation]
    VIOLATION_MALFORMED: _ClassVar[Violation]
    VIOLATION_ROW_CHECK: _ClassVar[Violation]
TUNNEL_AEAD_UNSPECIFIED: TunnelAead
TUNNEL_AEAD_AES_256_GCM: TunnelAead
VIOLATION_UNSPECIFIED: Violation
VIOLATION_NON_FINITE: Violation
VIOLATION_AUDIT_MISMATCH: Violation
VIOLATION_MALFORMED: Violation
VIOLATION_ROW_CHECK: Violation

class ExpertSlice(_message.Message):
    __slots__ = ("layer", "experts")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionChallenge(_message.Message):
    __slots__ = ("nonce", "hub_key", "issued_at_unix_ms", "kx_public")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    HUB_KEY_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KX_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    hub_key: str
    issued_at_unix_ms: int
    kx_public: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., hub_key: _Optional[str] = ..., issued_at_unix_ms: _Optional[int] = ..., kx_public: _Optional[bytes] = ...) -> None: ...

class HelloBody(_message.Message):
    __slots__ = ("nonce", "hub_key", "wallet", "slices", "weights_digest", "device", "model_type", "worker_version", "kx_public", "hub_kx_public", "require_encryption", "aeads", "projections", "expert_function", "tunnel_channels", "expert_capacity")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    HUB_KEY_FIELD_NUMBER: _ClassVar[int]
    WALLET_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    WORKER_VERSION_FIELD_NUMBER: _ClassVar[int]
    KX_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    HUB_KX_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    REQUIRE_ENCRYPTION_FIELD_NUMBER: _ClassVar[int]
    AEADS_FIELD_NUMBER: _ClassVar[int]
    PROJECTIONS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    TUNNEL_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    hub_key: str
    wallet: str
    slices: _containers.RepeatedCompositeFieldContainer[ExpertSlice]
    weights_digest: bytes
    device: str
    model_type: str
    worker_version: str
    kx_public: bytes
    hub_kx_public: bytes
    require_encryption: bool
    aeads: _containers.RepeatedScalarFieldContainer[TunnelAead]
    projections: bool
    expert_function: _function_pb2.ExpertFunction
    tunnel_channels: int
    expert_capacity: int
    def __init__(self, nonce: _Optional[bytes] = ..., hub_key: _Optional[str] = ..., wallet: _Optional[str] = ..., slices: _Optional[_Iterable[_Union[ExpertSlice, _Mapping]]] = ..., weights_digest: _Optional[bytes] = ..., device: _Optional[str] = ..., model_type: _Optional[str] = ..., worker_version: _Optional[str] = ..., kx_public: _Optional[bytes] = ..., hub_kx_public: _Optional[bytes] = ..., require_encryption: _Optional[bool] = ..., aeads: _Optional[_Iterable[_Union[TunnelAead, str]]] = ..., projections: _Optional[bool] = ..., expert_function: _Optional[_Union[_function_pb2.ExpertFunction, _Mapping]] = ..., tunnel_channels: _Optional[int] = ..., expert_capacity: _Optional[int] = ...) -> None: ...

class SessionHello(_message.Message):
    __slots__ = ("body", "signature")
    BODY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    body: bytes
    signature: bytes
    def __init__(self, body: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SessionAccept(_message.Message):
    __slots__ = ("session_id", "encrypted", "signature", "aead", "tunnel_channels", "suggested_slices")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTED_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    AEAD_FIELD_NUMBER: _ClassVar[int]
    TUNNEL_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    SUGGESTED_SLICES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    encrypted: bool
    signature: bytes
    aead: TunnelAead
    tunnel_channels: int
    suggested_slices: _containers.RepeatedCompositeFieldContainer[ExpertSlice]
    def __init__(self, session_id: _Optional[str] = ..., encrypted: _Optional[bool] = ..., signature: _Optional[bytes] = ..., aead: _Optional[_Union[TunnelAead, str]] = ..., tunnel_channels: _Optional[int] = ..., suggested_slices: _Optional[_Iterable[_Union[ExpertSlice, _Mapping]]] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "wallet", "slices", "weights_digest", "device", "model_type", "connected_since_unix_ms", "bytes_to_worker", "bytes_from_worker", "target", "remote_address", "work_bytes", "encrypted", "via_gateway", "rtt_ms", "work_calls", "work_rows", "credited_bytes", "credited_nano_kvr", "aead", "projections", "expert_function", "tunnel_channels", "backbone_connections", "connections_refused_busy")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WALLET_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_SINCE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_TO_WORKER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FROM_WORKER_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTED_FIELD_NUMBER: _ClassVar[int]
    VIA_GATEWAY_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    WORK_CALLS_FIELD_NUMBER: _ClassVar[int]
    WORK_ROWS_FIELD_NUMBER: _ClassVar[int]
    CREDITED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREDITED_NANO_KVR_FIELD_NUMBER: _ClassVar[int]
    AEAD_FIELD_NUMBER: _ClassVar[int]
    PROJECTIONS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    TUNNEL_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    BACKBONE_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_REFUSED_BUSY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    wallet: str
    slices: _containers.RepeatedCompositeFieldContainer[ExpertSlice]
    weights_digest: bytes
    device: str
    model_type: str
    connected_since_unix_ms: int
    bytes_to_worker: int
    bytes_from_worker: int
    target: str
    remote_address: str
    work_bytes: int
    encrypted: bool
    via_gateway: bool
    rtt_ms: float
    work_calls: int
    work_rows: int
    credited_bytes: int
    credited_nano_kvr: int
    aead: TunnelAead
    projections: bool
    expert_function: _function_pb2.ExpertFunction
    tunnel_channels: int
    backbone_connections: int
    connections_refused_busy: int
    def __init__(self, session_id: _Optional[str] = ..., wallet: _Optional[str] = ..., slices: _Optional[_Iterable[_Union[ExpertSlice, _Mapping]]] = ..., weights_digest: _Optional[bytes] = ..., device: _Optional[str] = ..., model_type: _Optional[str] = ..., connected_since_unix_ms: _Optional[int] = ..., bytes_to_worker: _Optional[int] = ..., bytes_from_worker: _Optional[int] = ..., target: _Optional[str] = ..., remote_address: _Optional[str] = ..., work_bytes: _Optional[int] = ..., encrypted: _Optional[bool] = ..., via_gateway: _Optional[bool] = ..., rtt_ms: _Optional[float] = ..., work_calls: _Optional[int] = ..., work_rows: _Optional[int] = ..., credited_bytes: _Optional[int] = ..., credited_nano_kvr: _Optional[int] = ..., aead: _Optional[_Union[TunnelAead, str]] = ..., projections: _Optional[bool] = ..., expert_function: _Optional[_Union[_function_pb2.ExpertFunction, _Mapping]] = ..., tunnel_channels: _Optional[int] = ..., backbone_connections: _Optional[int] = ..., connections_refused_busy: _Optional[int] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ...) -> None: ...

class WatchSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("kind", "session")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[SessionEvent.Kind]
        KIND_ADDED: _ClassVar[SessionEvent.Kind]
        KIND_REMOVED: _ClassVar[SessionEvent.Kind]
        KIND_SYNCED: _ClassVar[SessionEvent.Kind]
    KIND_UNSPECIFIED: SessionEvent.Kind
    KIND_ADDED: SessionEvent.Kind
    KIND_REMOVED: SessionEvent.Kind
    KIND_SYNCED: SessionEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    kind: SessionEvent.Kind
    session: Session
    def __init__(self, kind: _Optional[_Union[SessionEvent.Kind, str]] = ..., session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class WatchSessionsResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: SessionEvent
    def __init__(self, event: _Optional[_Union[SessionEvent, _Mapping]] = ...) -> None: ...

class WorkReport(_message.Message):
    __slots__ = ("session_id", "cumulative_bytes", "calls", "rows", "fallback_rows")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ROWS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cumulative_bytes: int
    calls: int
    rows: int
    fallback_rows: int
    def __init__(self, session_id: _Optional[str] = ..., cumulative_bytes: _Optional[int] = ..., calls: _Optional[int] = ..., rows: _Optional[int] = ..., fallback_rows: _Optional[int] = ...) -> None: ...

class ReportWorkRequest(_message.Message):
    __slots__ = ("run_id", "reports", "demand", "status")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    DEMAND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reports: _containers.RepeatedCompositeFieldContainer[WorkReport]
    demand: _containers.RepeatedCompositeFieldContainer[ExpertDemand]
    status: BackboneStatus
    def __init__(self, run_id: _Optional[str] = ..., reports: _Optional[_Iterable[_Union[WorkReport, _Mapping]]] = ..., demand: _Optional[_Iterable[_Union[ExpertDemand, _Mapping]]] = ..., status: _Optional[_Union[BackboneStatus, _Mapping]] = ...) -> None: ...

class BackboneStatus(_message.Message):
    __slots__ = ("kind", "running", "waiting", "remote_rows", "local_rows", "fallback_rows", "worker_busy_refusals")
    KIND_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ROWS_FIELD_NUMBER: _ClassVar[int]
    WORKER_BUSY_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    running: int
    waiting: int
    remote_rows: int
    local_rows: int
    fallback_rows: int
    worker_busy_refusals: int
    def __init__(self, kind: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., remote_rows: _Optional[int] = ..., local_rows: _Optional[int] = ..., fallback_rows: _Optional[int] = ..., worker_busy_refusals: _Optional[int] = ...) -> None: ...

class ExpertDemand(_message.Message):
    __slots__ = ("layer", "rows")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., rows: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportWorkResponse(_message.Message):
    __slots__ = ("refused_session_ids",)
    REFUSED_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    refused_session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, refused_session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class QuarantineRequest(_message.Message):
    __slots__ = ("session_id", "violation", "layer", "expert", "call_id", "row", "max_abs_diff", "tolerance", "audited_rows", "detail")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VIOLATION_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_DIFF_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    AUDITED_ROWS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    violation: Violation
    layer: int
    expert: int
    call_id: int
    row: int
    max_abs_diff: float
    tolerance: float
    audited_rows: int
    detail: str
    def __init__(self, session_id: _Optional[str] = ..., violation: _Optional[_Union[Violation, str]] = ..., layer: _Optional[int] = ..., expert: _Optional[int] = ..., call_id: _Optional[int] = ..., row: _Optional[int] = ..., max_abs_diff: _Optional[float] = ..., tolerance: _Optional[float] = ..., audited_rows: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class QuarantineResponse(_message.Message):
    __slots__ = ("refused_until_unix_ms",)
    REFUSED_UNTIL_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    refused_until_unix_ms: int
    def __init__(self, refused_until_unix_ms: _Optional[int] = ...) -> None: ...
