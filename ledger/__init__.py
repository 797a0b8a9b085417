"""The Kvasir ledger: verifies byte receipts signed by trusted hubs and credits each byte
once, in integer nano-KVR, with double-entry books on SQLite or PostgreSQL.

Run it with ``python -m ledger serve``; embed it with ``open_store`` + ``create_server``.
Importing this package connects to nothing and starts nothing.
"""

from __future__ import annotations

from ledger._open import open_store
from ledger._service import LedgerServicer, create_server
from ledger._store import (
    POOL_ACCOUNT,
    Balance,
    Books,
    CreditRecord,
    LedgerStore,
    Outcome,
    StoreError,
    StoreStatistics,
    StoreUnavailable,
    pending_account,
)

__all__ = [
    "POOL_ACCOUNT",
    "Balance",
    "Books",
    "CreditRecord",
    "LedgerServicer",
    "LedgerStore",
    "Outcome",
    "StoreError",
    "StoreStatistics",
    "StoreUnavailable",
    "create_server",
    "open_store",
    "pending_account",
]
