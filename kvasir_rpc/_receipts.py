"""Signed byte receipts: the hub signs them (``sign_receipt``), the ledger opens them
(``open_receipt``). Pure functions, no I/O; every way a receipt can be unacceptable is a
``ReceiptError`` whose ``reason`` is a ``kvasir.v1.RejectReason`` value.

Money is integers: 1 KVR = 10^9 nano-KVR, 1 unit = 1,000,000 bytes, and the default rate
of 7 nano-KVR per byte is 0.007 KVR per unit.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from google.protobuf import message as _message
from google.protobuf import unknown_fields as _unknown_fields

from kvasir_rpc._gen.kvasir.v1 import ledger_pb2
from kvasir_rpc._wallet import Wallet, is_address, verify_signature
from kvasir_rpc.protocol import MAX_SESSION_ID_CHARS

__all__ = [
    "DEFAULT_RATE_NANO_PER_BYTE",
    "MAX_CUMULATIVE_BYTES",
    "MAX_RECEIPT_BYTES",
    "MAX_SEQ",
    "NANO_PER_KVR",
    "BYTES_PER_UNIT",
    "ReceiptError",
    "format_kvr",
    "format_units",
    "open_receipt",
    "sign_receipt",
    "validate_receipt",
]

NANO_PER_KVR = 1_000_000_000
BYTES_PER_UNIT = 1_000_000
DEFAULT_RATE_NANO_PER_BYTE = 7
# A session worth more than 2^50 bytes (1 PiB) is a bug, not a workload; the bound keeps
# bytes x rate (rate <= 1000) far inside the signed 64-bit integers both databases use.
MAX_CUMULATIVE_BYTES = 1 << 50
# Databases keep integers as signed 64-bit.
MAX_SEQ = (1 << 63) - 1
# Six short fields serialize to well under 300 bytes; the bound caps the work a stranger's
# garbage can cost before it is rejected.
MAX_RECEIPT_BYTES = 1024
SESSION_ID_MAX_CHARS = MAX_SESSION_ID_CHARS
_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,%d}" % SESSION_ID_MAX_CHARS)
_SIGNATURE_BYTES = 64

class ReceiptError(ValueError):
    """A receipt that must not be credited. ``reason`` is a ``ledger_pb2.RejectReason`` value;
    ``detail`` a sentence naming the field or check that failed."""

    def __init__(self, reason: ledger_pb2.RejectReason, detail: str) -> None:
        super().__init__(f"{ledger_pb2.RejectReason.Name(reason)}: {detail}")
        self.reason = reason
        self.detail = detail


def _short(text: str, limit: int = 80) -> str:
    # Strangers choose these strings: never echo an unbounded one into errors or logs.
    return repr(text if len(text) <= limit else text[:limit] + "...")


def validate_receipt(receipt: ledger_pb2.ByteReceipt) -> None:
    """Check every field's format and bounds. Raises ReceiptError(REJECT_REASON_INVALID_FIELD)
    naming the first bad field; returns None when all are well-formed."""
    invalid = ledger_pb2.REJECT_REASON_INVALID_FIELD
    if not is_address(receipt.hub_key):
        raise ReceiptError(invalid, f"hub_key must be 64 lowercase hex characters, got {_short(receipt.hub_key)}")
    if not is_address(receipt.wallet):
        raise ReceiptError(invalid, f"wallet must be 64 lowercase hex characters, got {_short(receipt.wallet)}")
    if not _SESSION_ID.fullmatch(receipt.session_id):
        raise ReceiptError(
            invalid,
            f"session_id must be 1 to {SESSION_ID_MAX_CHARS} characters of [A-Za-z0-9._:-], "
            f"got {_short(receipt.session_id)}",
        )
    if not 1 <= receipt.seq <= MAX_SEQ:
        raise ReceiptError(invalid, f"seq must be 1 to 2^63-1, got {receipt.seq}")
    if receipt.cumulative_bytes > MAX_CUMULATIVE_BYTES:
        raise ReceiptError(
            invalid, f"cumulative_bytes {receipt.cumulative_bytes} exceeds the bound {MAX_CUMULATIVE_BYTES}"
        )
    if receipt.issued_at_unix_ms < 0:
        raise ReceiptError(invalid, f"issued_at_unix_ms must not be negative, got {receipt.issued_at_unix_ms}")


def sign_receipt(key: Wallet, receipt: ledger_pb2.ByteReceipt) -> ledger_pb2.SignedReceipt:
    """Serialize ``receipt`` (deterministically) and sign those bytes with the hub's ``key``.

    Takes the hub's key pair and a receipt whose ``hub_key`` is that key's address. Returns
    the SignedReceipt to send to the ledger. Raises ReceiptError when a field is malformed or
    ``hub_key`` is not ``key.address``: a receipt the ledger would reject is never signed.
    """
    validate_receipt(receipt)
    if receipt.hub_key != key.address:
        raise ReceiptError(
            ledger_pb2.REJECT_REASON_INVALID_FIELD,
            f"hub_key {receipt.hub_key[:16]}... is not the signing key's address {key.address[:16]}...",
        )
    body = receipt.SerializeToString(deterministic=True)
    return ledger_pb2.SignedReceipt(receipt=body, signature=key.sign(body))


def open_receipt(signed: ledger_pb2.SignedReceipt, trusted_keys: Collection[str]) -> ledger_pb2.ByteReceipt:
    """Verify a SignedReceipt and return the ByteReceipt it carries.

    ``trusted_keys`` holds the hub addresses whose receipts count. Never raises anything but
    ReceiptError, with reason MALFORMED (unparseable, too long, unknown fields), INVALID_FIELD,
    BAD_SIGNATURE (wrong length or does not verify) or UNTRUSTED_KEY. Checks run cheapest
    first, and the signature only for a trusted, well-formed receipt.
    """
    bad_sig = ledger_pb2.REJECT_REASON_BAD_SIGNATURE
    malformed = ledger_pb2.REJECT_REASON_MALFORMED
    if len(signed.signature) != _SIGNATURE_BYTES:
        raise ReceiptError(bad_sig, f"signature must be {_SIGNATURE_BYTES} bytes, got {len(signed.signature)}")
    if not signed.receipt:
        raise ReceiptError(malformed, "receipt is empty")
    if len(signed.receipt) > MAX_RECEIPT_BYTES:
        raise ReceiptError(malformed, f"receipt is {len(signed.receipt)} bytes, more than {MAX_RECEIPT_BYTES}")
    try:
        receipt = ledger_pb2.ByteReceipt.FromString(signed.receipt)
    except _message.DecodeError as exc:
        raise ReceiptError(malformed, f"receipt bytes are not a ByteReceipt ({exc})") from None
    # Fields we cannot read might change what the hub meant to attest: money is not paid
    # on a guess. A newer hub must wait for a ledger that knows its fields.
    unknown = _unknown_fields.UnknownFieldSet(receipt)
    if len(unknown):
        numbers = sorted({unknown[i].field_number for i in range(len(unknown))})
        raise ReceiptError(malformed, f"receipt carries fields this ledger does not know: {numbers}")
    validate_receipt(receipt)
    if receipt.hub_key not in trusted_keys:
        raise ReceiptError(ledger_pb2.REJECT_REASON_UNTRUSTED_KEY, f"hub_key {receipt.hub_key} is not trusted")
    if not verify_signature(receipt.hub_key, signed.receipt, signed.signature):
        raise ReceiptError(bad_sig, f"signature does not verify against hub_key {receipt.hub_key[:16]}...")
    return receipt


def format_kvr(nano_kvr: int) -> str:
    """Nano-KVR as an exact decimal KVR string with 9 decimals: 8945664 -> "0.008945664"."""
    sign = "-" if nano_kvr < 0 else ""
    whole, frac = divmod(abs(nano_kvr), NANO_PER_KVR)
    return f"{sign}{whole}.{frac:09d}"


def format_units(nbytes: int) -> str:
    """Bytes as an exact decimal string of units (10^6 bytes), 6 decimals: 1277952 -> "1.277952"."""
    sign = "-" if nbytes < 0 else ""
    whole, frac = divmod(abs(nbytes), BYTES_PER_UNIT)
    return f"{sign}{whole}.{frac:06d}"
