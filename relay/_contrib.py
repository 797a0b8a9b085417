"""The hub's contribution registry on disk: per-session byte counters and the signed receipts
issued for them, in SQLite (WAL, full sync), so a hub restart loses no counted byte and no
receipt. The receipt sender delivers receipts to the ledger at least once; the ledger makes
crediting exactly once.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sqlite3
import threading
import time

from kvasir_rpc import Wallet, get_logger
from relay._registry import SessionStats

__all__ = ["ContributionStore", "PendingReceipt"]

log = get_logger("relay.contrib")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    wallet TEXT NOT NULL,
    started_unix_ms INTEGER NOT NULL,
    ended_unix_ms INTEGER,
    bytes_to_worker INTEGER NOT NULL DEFAULT 0,
    bytes_from_worker INTEGER NOT NULL DEFAULT 0,
    last_seq INTEGER NOT NULL DEFAULT 0,
    last_receipt_bytes INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS receipts (
    session_id TEXT NOT NULL REFERENCES sessions(session_id),
    seq INTEGER NOT NULL,
    cumulative_bytes INTEGER NOT NULL,
    signed BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',  -- pending | acked | rejected
    detail TEXT,
    PRIMARY KEY (session_id, seq)
);
CREATE INDEX IF NOT EXISTS receipts_pending ON receipts(state) WHERE state = 'pending';
"""


@dataclasses.dataclass(frozen=True)
class PendingReceipt:
    session_id: str
    seq: int
    signed: bytes  # a serialized kvasir.v1.SignedReceipt


class ContributionStore:
    """Thread-safe (one lock) SQLite store. Counters only ever grow."""

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def end_open_sessions(self) -> int:
        """At start-up: sessions of a previous run are over; their counters stand as saved."""
        now = time.time_ns() // 1_000_000
        with self._lock:
            cur = self._db.execute("UPDATE sessions SET ended_unix_ms = ? WHERE ended_unix_ms IS NULL", (now,))
            return cur.rowcount

    def record(self, stats: list[SessionStats], *, ended: bool = False) -> None:
        """Save the counters of live sessions (or of sessions that just ended)."""
        now = time.time_ns() // 1_000_000
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for s in stats:
                    self._db.execute(
                        "INSERT INTO sessions (session_id, wallet, started_unix_ms, bytes_to_worker, bytes_from_worker)"
                        " VALUES (?, ?, ?, ?, ?) ON CONFLICT(session_id) DO UPDATE SET"
                        " bytes_to_worker = MAX(bytes_to_worker, excluded.bytes_to_worker),"
                        " bytes_from_worker = MAX(bytes_from_worker, excluded.bytes_from_worker)",
                        (s.session_id, s.wallet, s.connected_since_unix_ms, s.bytes_to_worker, s.bytes_from_worker),
                    )
                    if ended:
                        self._db.execute("UPDATE sessions SET ended_unix_ms = ? WHERE session_id = ?", (now, s.session_id))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def issue_receipts(self, key: Wallet) -> int:
        """Sign a receipt for every session whose counted bytes grew since its last receipt."""
        from kvasir_rpc._gen.kvasir.v1 import ledger_pb2
        from kvasir_rpc._receipts import sign_receipt

        now = time.time_ns() // 1_000_000
        issued = 0
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = self._db.execute(
                    "SELECT session_id, wallet, bytes_to_worker + bytes_from_worker, last_seq FROM sessions"
                    " WHERE bytes_to_worker + bytes_from_worker > last_receipt_bytes"
                ).fetchall()
                for session_id, wallet, total, last_seq in rows:
                    seq = last_seq + 1
                    receipt = ledger_pb2.ByteReceipt(hub_key=key.address, session_id=session_id, wallet=wallet,
                                                     seq=seq, cumulative_bytes=total, issued_at_unix_ms=now)
                    signed = sign_receipt(key, receipt).SerializeToString()
                    self._db.execute(
                        "INSERT INTO receipts (session_id, seq, cumulative_bytes, signed) VALUES (?, ?, ?, ?)",
                        (session_id, seq, total, signed),
                    )
                    self._db.execute(
                        "UPDATE sessions SET last_seq = ?, last_receipt_bytes = ? WHERE session_id = ?",
                        (seq, total, session_id),
                    )
                    issued += 1
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return issued

    def pending(self, limit: int = 500) -> list[PendingReceipt]:
        with self._lock:
            rows = self._db.execute(
                "SELECT session_id, seq, signed FROM receipts WHERE state = 'pending' ORDER BY session_id, seq LIMIT ?",
                (limit,),
            ).fetchall()
        return [PendingReceipt(sid, seq, bytes(signed)) for sid, seq, signed in rows]

    def settle(self, results: list[tuple[PendingReceipt, str, str]]) -> None:
        """Mark receipts the ledger answered: state 'acked' or 'rejected', with its detail."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for r, state, detail in results:
                    self._db.execute("UPDATE receipts SET state = ?, detail = ? WHERE session_id = ? AND seq = ?",
                                     (state, detail, r.session_id, r.seq))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
