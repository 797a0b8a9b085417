from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReceiptStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECEIPT_STATUS_UNSPECIFIED: _ClassVar[ReceiptStatus]
    RECEIPT_STATUS_CREDITED: _ClassVar[ReceiptStatus]
    RECEIPT_STATUS_DUPLICATE: _ClassVar[ReceiptStatus]
    RECEIPT_STATUS_STALE: _ClassVar[ReceiptStatus]
    RECEIPT_STATUS_REJECTED: _ClassVar[ReceiptStatus]

class RejectReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_REASON_UNSPECIFIED: _ClassVar[RejectReason]
    REJECT_REASON_MALFORMED: _ClassVar[RejectReason]
    REJECT_REASON_INVALID_FIELD: _ClassVar[RejectReason]
    REJECT_REASON_BAD_SIGNATURE: _ClassVar[RejectReason]
    REJECT_REASON_UNTRUSTED_KEY: _ClassVar[RejectReason]
    REJECT_REASON_WALLET_MISMATCH: _ClassVar[RejectReason]
    REJECT_REASON_CONFLICT: _ClassVar[RejectReason]
    REJECT_REASON_SESSION_QUARANTINED: _ClassVar[RejectReason]
    REJECT_REASON_LEDGER_LIMIT: _ClassVar[RejectReason]
RECEIPT_STATUS_UNSPECIFIED: ReceiptStatus
RECEIPT_STATUS_CREDITED: ReceiptStatus
RECEIPT_STATUS_DUPLICATE: ReceiptStatus
RECEIPT_STATUS_STALE: ReceiptStatus
RECEIPT_STATUS_REJECTED: ReceiptStatus
REJECT_REASON_UNSPECIFIED: RejectReason
REJECT_REASON_MALFORMED: RejectReason
REJECT_REASON_INVALID_FIELD: RejectReason
REJECT_REASON_BAD_SIGNATURE: RejectReason
REJECT_REASON_UNTRUSTED_KEY: RejectReason
REJECT_REASON_WALLET_MISMATCH: RejectReason
REJECT_REASON_CONFLICT: RejectReason
REJECT_REASON_SESSION_QUARANTINED: RejectReason
REJECT_REASON_LEDGER_LIMIT: RejectReason

class ByteReceipt(_message.Message):
    __slots__ = ("hub_key", "session_id", "wallet", "seq", "cumulative_bytes", "issued_at_unix_ms", "quarantined")
    HUB_KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WALLET_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    hub_key: str
    session_id: str
    wallet: str
    seq: int
    cumulative_bytes: int
    issued_at_unix_ms: int
    quarantined: bool
    def __init__(self, hub_key: _Optional[str] = ..., session_id: _Optional[str] = ..., wallet: _Optional[str] = ..., seq: _Optional[int] = ..., cumulative_bytes: _Optional[int] = ..., issued_at_unix_ms: _Optional[int] = ..., quarantined: _Optional[bool] = ...) -> None: ...

class SignedReceipt(_message.Message):
    __slots__ = ("receipt", "signature")
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    receipt: bytes
    signature: bytes
    def __init__(self, receipt: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Credit(_message.Message):
    __slots__ = ("credit_id", "wallet", "hub_key", "session_id", "seq", "cumulative_bytes", "bytes", "nano_kvr", "rate_nano_per_byte", "issued_at_unix_ms", "credited_at_unix_ms", "quarantined")
    CREDIT_ID_FIELD_NUMBER: _ClassVar[int]
    WALLET_FIELD_NUMBER: _ClassVar[int]
    HUB_KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NANO_KVR_FIELD_NUMBER: _ClassVar[int]
    RATE_NANO_PER_BYTE_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CREDITED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    credit_id: int
    wallet: str
    hub_key: str
    session_id: str
    seq: int
    cumulative_bytes: int
    bytes: int
    nano_kvr: int
    rate_nano_per_byte: int
    issued_at_unix_ms: int
    credited_at_unix_ms: int
    quarantined: bool
    def __init__(self, credit_id: _Optional[int] = ..., wallet: _Optional[str] = ..., hub_key: _Optional[str] = ..., session_id: _Optional[str] = ..., seq: _Optional[int] = ..., cumulative_bytes: _Optional[int] = ..., bytes: _Optional[int] = ..., nano_kvr: _Optional[int] = ..., rate_nano_per_byte: _Optional[int] = ..., issued_at_unix_ms: _Optional[int] = ..., credited_at_unix_ms: _Optional[int] = ..., quarantined: _Optional[bool] = ...) -> None: ...

class ReceiptResult(_message.Message):
    __slots__ = ("status", "reason", "detail", "credit")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    status: ReceiptStatus
    reason: RejectReason
    detail: str
    credit: Credit
    def __init__(self, status: _Optional[_Union[ReceiptStatus, str]] = ..., reason: _Optional[_Union[RejectReason, str]] = ..., detail: _Optional[str] = ..., credit: _Optional[_Union[Credit, _Mapping]] = ...) -> None: ...

class SubmitReceiptsRequest(_message.Message):
    __slots__ = ("receipts",)
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    receipts: _containers.RepeatedCompositeFieldContainer[SignedReceipt]
    def __init__(self, receipts: _Optional[_Iterable[_Union[SignedReceipt, _Mapping]]] = ...) -> None: ...

class SubmitReceiptsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ReceiptResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ReceiptResult, _Mapping]]] = ...) -> None: ...

class GetBalanceRequest(_message.Message):
    __slots__ = ("wallet",)
    WALLET_FIELD_NUMBER: _ClassVar[int]
    wallet: str
    def __init__(self, wallet: _Optional[str] = ...) -> None: ...

class GetBalanceResponse(_message.Message):
    __slots__ = ("wallet", "pending_nano_kvr", "pending_kvr", "bytes_credited", "units", "credit_count")
    WALLET_FIELD_NUMBER: _ClassVar[int]
    PENDING_NANO_KVR_FIELD_NUMBER: _ClassVar[int]
    PENDING_KVR_FIELD_NUMBER: _ClassVar[int]
    BYTES_CREDITED_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    CREDIT_COUNT_FIELD_NUMBER: _ClassVar[int]
    wallet: str
    pending_nano_kvr: int
    pending_kvr: str
    bytes_credited: int
    units: str
    credit_count: int
    def __init__(self, wallet: _Optional[str] = ..., pending_nano_kvr: _Optional[int] = ..., pending_kvr: _Optional[str] = ..., bytes_credited: _Optional[int] = ..., units: _Optional[str] = ..., credit_count: _Optional[int] = ...) -> None: ...

class ListCreditsRequest(_message.Message):
    __slots__ = ("wallet", "page_size", "page_token")
    WALLET_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    wallet: str
    page_size: int
    page_token: str
    def __init__(self, wallet: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListCreditsResponse(_message.Message):
    __slots__ = ("credits", "next_page_token")
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    credits: _containers.RepeatedCompositeFieldContainer[Credit]
    next_page_token: str
    def __init__(self, credits: _Optional[_Iterable[_Union[Credit, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...
