"""The hub's contribution registry on disk, in SQLite (WAL, full sync), so a hub restart loses
no counted byte and no receipt:

* ``sessions``: who each session paid (its wallet), its raw tunnel counters (``record``,
  for display only: raw bytes are not work), its last receipt, and its quarantine marker;
* ``work``: the bytes of work the backbone accepted from each session, cumulative per
  backbone run (``add_work``); receipts pay the sum over runs, nothing else;
* ``receipts``: every signed receipt and what the ledger answered;
* ``bans``: wallets refused until a time (``ban``), kept across restarts.

The receipt sender delivers receipts to the ledger at least once; the ledger makes crediting
exactly once. A quarantined session gets one final receipt that closes it at the ledger, and
no receipt after it.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvasir_rpc import ReceiptError, Wallet, get_logger, ledger_pb2, sign_receipt
from relay.hub._admission import WalletHistory
from relay.hub._registry import SessionStats

__all__ = ["ContributionStore", "PendingReceipt", "ReceiptRecord", "Settlement"]

log = get_logger("relay.contrib")

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS sessions (
        session_id TEXT PRIMARY KEY,
        wallet TEXT NOT NULL,
        started_unix_ms INTEGER NOT NULL,
        ended_unix_ms INTEGER,
        bytes_to_worker INTEGER NOT NULL DEFAULT 0,
        bytes_from_worker INTEGER NOT NULL DEFAULT 0,
        last_seq INTEGER NOT NULL DEFAULT 0,
        last_receipt_bytes INTEGER NOT NULL DEFAULT 0,  -- the cumulative of the last receipt
        quarantined_seq INTEGER NOT NULL DEFAULT 0  -- the seq of the closing receipt; 0: not quarantined
    )""",
    """CREATE TABLE IF NOT EXISTS receipts (
        session_id TEXT NOT NULL REFERENCES sessions(session_id),
        seq INTEGER NOT NULL,
        cumulative_bytes INTEGER NOT NULL,
        signed BLOB NOT NULL,
        state TEXT NOT NULL DEFAULT 'pending',  -- pending | acked | rejected
        detail TEXT,
        reason TEXT,  -- the ledger's RejectReason name when it refused the receipt (last time)
        PRIMARY KEY (session_id, seq)
    )""",
    "CREATE INDEX IF NOT EXISTS receipts_pending ON receipts(state) WHERE state = 'pending'",
    # The hub looks a wallet's history up at every verified hello (wallet_history).
    "CREATE INDEX IF NOT EXISTS sessions_wallet ON sessions(wallet)",
    """CREATE TABLE IF NOT EXISTS work (
        session_id TEXT NOT NULL REFERENCES sessions(session_id),
        run_id TEXT NOT NULL,
        cumulative_bytes INTEGER NOT NULL,
        calls INTEGER NOT NULL,
        rows INTEGER NOT NULL,
        PRIMARY KEY (session_id, run_id)
    )""",
    """CREATE TABLE IF NOT EXISTS bans (
        wallet TEXT PRIMARY KEY,
        until_unix_ms INTEGER NOT NULL,
        reason TEXT NOT NULL,
        banned_at_unix_ms INTEGER NOT NULL
    )""",
)

# Columns added since a table was first released: (table, column, its DDL). A hub database
# made by an older hub lacks them; opening the store adds them.
_MIGRATIONS = (
    ("sessions", "quarantined_seq", "INTEGER NOT NULL DEFAULT 0"),
    ("receipts", "reason", "TEXT"),
)

UNTRUSTED_KEY = ledger_pb2.RejectReason.Name(ledger_pb2.REJECT_REASON_UNTRUSTED_KEY)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclasses.dataclass(frozen=True)
class PendingReceipt:
    session_id: str
    seq: int
    signed: bytes  # a serialized kvasir.v1.SignedReceipt


@dataclasses.dataclass(frozen=True)
class Settlement:
    """What to record of the ledger's answer to one receipt: ``state`` 'acked' (credited,
    duplicate or stale: nothing more to send), 'rejected' (never valid: dropped) or
    'pending' (refused for a reason that can change: sent again later); ``reason`` is the
    RejectReason name when the ledger refused it, ``detail`` the ledger's sentence."""

    receipt: PendingReceipt
    state: str
    reason: str = ""
    detail: str = ""
    # The ledger's Credit for an acked receipt (made now, or earlier for a duplicate).
    credit: ledger_pb2.Credit | None = None


@dataclasses.dataclass(frozen=True)
class ReceiptRecord:
    """One signed receipt as the hub keeps it."""

    session_id: str
    seq: int
    cumulative_bytes: int
    state: str
    reason: str | None
    detail: str | None
    quarantined: bool


class ContributionStore:
    """Thread-safe (one lock) SQLite store. Counters only ever grow.

    Opening it creates the tables, brings a database of an older hub up to date, and puts
    back to pending the receipts an older hub dropped because the ledger did not trust its
    key (that can be fixed at the ledger, so they are worth sending again). Call ``close``
    when done.
    """

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        with self._write() as db:
            for statement in _SCHEMA:
                db.execute(statement)
            for table, column, definition in _MIGRATIONS:
                if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
            # Rows of an older hub have no reason; its ledger's sentence for an untrusted key
            # was "hub_key ... is not trusted".
            revived = db.execute(
                "UPDATE receipts SET state = 'pending', reason = ? WHERE state = 'rejected' AND reason IS NULL"
                " AND detail LIKE '%is not trusted%'",
                (UNTRUSTED_KEY,),
            ).rowcount
        if revived:
            log.info("receipts an older hub dropped for an untrusted key are pending again", receipts=revived)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under the lock: committed when the block ends, rolled back
        when it raises."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- sessions and raw counters -----------------------------------------------------

    def end_open_sessions(self) -> int:
        """At start-up: sessions of a previous run are over; their counters stand as saved."""
        now = _now_ms()
        with self._lock:
            cur = self._db.execute("UPDATE sessions SET ended_unix_ms = ? WHERE ended_unix_ms IS NULL", (now,))
            return cur.rowcount

    def record(self, stats: list[SessionStats], *, ended: bool = False) -> None:
        """Save the raw tunnel counters of live sessions (or of sessions that just ended), for
        display: receipts pay work (``add_work``), not these."""
        now = _now_ms()
        with self._write() as db:
            for s in stats:
                db.execute(
                    "INSERT INTO sessions (session_id, wallet, started_unix_ms, bytes_to_worker, bytes_from_worker)"
                    " VALUES (?, ?, ?, ?, ?) ON CONFLICT(session_id) DO UPDATE SET"
                    " bytes_to_worker = MAX(bytes_to_worker, excluded.bytes_to_worker),"
                    " bytes_from_worker = MAX(bytes_from_worker, excluded.bytes_from_worker)",
                    (s.session_id, s.wallet, s.connected_since_unix_ms, s.bytes_to_worker, s.bytes_from_worker),
                )
                if ended:
                    db.execute("UPDATE sessions SET ended_unix_ms = ? WHERE session_id = ?", (now, s.session_id))

    # -- work --------------------------------------------------------------------------

    def add_work(self, run_id: str, session_id: str, cumulative_bytes: int, calls: int, rows: int, *,
                 wallet: str | None = None, started_unix_ms: int | None = None) -> bool:
        """Record the work the backbone run ``run_id`` accepted from ``session_id`` so far:
        ``cumulative_bytes`` of work in ``calls`` calls of ``rows`` rows, each cumulative for
        this run. Each count keeps its maximum per (session, run), so a repeated or older
        report adds nothing.

        A session without a row is added when ``wallet`` is given (started at
        ``started_unix_ms``, or now). Returns False, counting nothing, for a session this
        store does not know (no row and no wallet) or that is quarantined; True otherwise.
        Raises ValueError for an empty ``run_id`` or a negative count.
        """
        if not run_id:
            raise ValueError("run_id must name the backbone run that reports the work")
        if min(cumulative_bytes, calls, rows) < 0:
            raise ValueError(f"work counts must not be negative: {cumulative_bytes}, {calls}, {rows}")
        with self._write() as db:
            row = db.execute("SELECT quarantined_seq FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
            if row is None:
                if wallet is None:
                    return False
                db.execute("INSERT INTO sessions (session_id, wallet, started_unix_ms) VALUES (?, ?, ?)",
                           (session_id, wallet, _now_ms() if started_unix_ms is None else started_unix_ms))
            elif row[0]:
                return False
            db.execute(
                "INSERT INTO work (session_id, run_id, cumulative_bytes, calls, rows) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT(session_id, run_id) DO UPDATE SET"
                " cumulative_bytes = MAX(cumulative_bytes, excluded.cumulative_bytes),"
                " calls = MAX(calls, excluded.calls), rows = MAX(rows, excluded.rows)",
                (session_id, run_id, cumulative_bytes, calls, rows),
            )
            return True

    def work_bytes(self, session_id: str) -> int:
        """The bytes of work accepted from ``session_id``, summed over backbone runs; 0 for
        a session without work."""
        with self._lock:
            (total,) = self._db.execute(
                "SELECT COALESCE(SUM(cumulative_bytes), 0) FROM work WHERE session_id = ?", (session_id,)
            ).fetchone()
        return int(total)

    def work_totals(self, session_id: str) -> tuple[int, int, int]:
        """The work accepted from ``session_id`` summed over backbone runs: (bytes, calls,
        rows); zeros for a session without work."""
        with self._lock:
            row = self._db.execute(
                "SELECT COALESCE(SUM(cumulative_bytes), 0), COALESCE(SUM(calls), 0), COALESCE(SUM(rows), 0)"
                " FROM work WHERE session_id = ?", (session_id,)
            ).fetchone()
        return int(row[0]), int(row[1]), int(row[2])

    # -- receipts ----------------------------------------------------------------------

    def issue_receipts(self, key: Wallet) -> int:
        """Sign a receipt for every session whose work grew since its last receipt, with
        ``cumulative_bytes`` its work sum; never for a quarantined session. Returns how many
        were signed. A session whose count cannot be signed (beyond the receipt's bound) is
        logged and skipped, never blocking the others."""
        now = _now_ms()
        issued = 0
        with self._write() as db:
            rows = db.execute(
                "SELECT s.session_id, s.wallet, w.total, s.last_seq FROM sessions s JOIN"
                " (SELECT session_id, SUM(cumulative_bytes) AS total FROM work GROUP BY session_id) w"
                " ON w.session_id = s.session_id"
                " WHERE s.quarantined_seq = 0 AND w.total > s.last_receipt_bytes"
            ).fetchall()
            for session_id, wallet, total, last_seq in rows:
                try:
                    self._sign(db, key, session_id, wallet, last_seq + 1, total, now, quarantined=False)
                except ReceiptError as exc:
                    log.error("cannot sign a receipt for this session; its work is not paid", session_id=session_id,
                              work_bytes=total, error=str(exc))
                    continue
                issued += 1
        return issued

    def quarantine(self, session_id: str, key: Wallet, *, wallet: str | None = None,
                   started_unix_ms: int | None = None) -> int:
        """Quarantine ``session_id``: from now on it earns nothing (``add_work`` refuses it,
        ``issue_receipts`` skips it). Signs one final receipt with ``quarantined=True``,
        seq = last + 1 and cumulative = the last receipted work count: work not yet
        receipted is forfeited, since the session did it after it was last checked. The
        ledger credits that receipt's delta (zero) and closes the session.

        Returns the seq of the closing receipt; a second call issues nothing and returns the
        same seq. A session without a row is added when ``wallet`` is given (as for
        ``add_work``); otherwise raises KeyError. Raises ReceiptError only for a malformed
        session id or wallet (a receipt the ledger would reject is never signed).
        """
        with self._write() as db:
            row = db.execute(
                "SELECT wallet, last_seq, last_receipt_bytes, quarantined_seq FROM sessions WHERE session_id = ?",
                (session_id,),
            ).fetchone()
            if row is None:
                if wallet is None:
                    raise KeyError(f"session {session_id!r} is unknown to this hub's contribution store")
                db.execute("INSERT INTO sessions (session_id, wallet, started_unix_ms) VALUES (?, ?, ?)",
                           (session_id, wallet, _now_ms() if started_unix_ms is None else started_unix_ms))
                row = (wallet, 0, 0, 0)
            owner, last_seq, receipted, closed_at = row
            if closed_at:
                return int(closed_at)
            seq = last_seq + 1
            self._sign(db, key, session_id, owner, seq, receipted, _now_ms(), quarantined=True)
            db.execute("UPDATE sessions SET quarantined_seq = ? WHERE session_id = ?", (seq, session_id))
        log.warning("session quarantined; its final receipt closes it at the ledger", session_id=session_id,
                    wallet=owner, seq=seq, receipted_bytes=receipted)
        return seq

    def _sign(self, db: sqlite3.Connection, key: Wallet, session_id: str, wallet: str, seq: int, cumulative: int,
              now: int, *, quarantined: bool) -> None:
        receipt = ledger_pb2.ByteReceipt(hub_key=key.address, session_id=session_id, wallet=wallet, seq=seq,
                                         cumulative_bytes=cumulative, issued_at_unix_ms=now, quarantined=quarantined)
        signed = sign_receipt(key, receipt).SerializeToString()
        db.execute("INSERT INTO receipts (session_id, seq, cumulative_bytes, signed) VALUES (?, ?, ?, ?)",
                   (session_id, seq, cumulative, signed))
        db.execute("UPDATE sessions SET last_seq = ?, last_receipt_bytes = ? WHERE session_id = ?",
                   (seq, cumulative, session_id))

    def pending(self, limit: int = 500) -> list[PendingReceipt]:
        """Up to ``limit`` receipts not yet answered for good, by session and seq."""
        with self._lock:
            rows = self._db.execute(
                "SELECT session_id, seq, signed FROM receipts WHERE state = 'pending' ORDER BY session_id, seq LIMIT ?",
                (limit,),
            ).fetchall()
        return [PendingReceipt(sid, seq, bytes(signed)) for sid, seq, signed in rows]

    def pending_count(self) -> int:
        """How many receipts wait for the ledger's answer."""
        with self._lock:
            (n,) = self._db.execute("SELECT COUNT(*) FROM receipts WHERE state = 'pending'").fetchone()
        return int(n)

    def settle(self, results: Sequence[Settlement]) -> None:
        """Record the ledger's answers: 'acked' and 'rejected' receipts leave the pending
        set; 'pending' ones stay, with the reason they were refused this time."""
        with self._write() as db:
            for s in results:
                if s.state not in ("acked", "rejected", "pending"):
                    raise ValueError(f"a receipt settles as acked, rejected or pending, not {s.state!r}")
                db.execute("UPDATE receipts SET state = ?, reason = ?, detail = ? WHERE session_id = ? AND seq = ?",
                           (s.state, s.reason or None, s.detail, s.receipt.session_id, s.receipt.seq))

    def receipts(self, session_id: str) -> list[ReceiptRecord]:
        """Every receipt signed for ``session_id``, by seq."""
        with self._lock:
            rows = self._db.execute(
                "SELECT r.seq, r.cumulative_bytes, r.state, r.reason, r.detail, r.seq = s.quarantined_seq"
                " FROM receipts r JOIN sessions s ON s.session_id = r.session_id"
                " WHERE r.session_id = ? ORDER BY r.seq",
                (session_id,),
            ).fetchall()
        return [ReceiptRecord(session_id, int(seq), int(cum), state, reason, detail, bool(closing))
                for seq, cum, state, reason, detail, closing in rows]

    # -- bans --------------------------------------------------------------------------

    def ban(self, wallet: str, until_unix_ms: int, reason: str) -> None:
        """Refuse ``wallet`` until ``until_unix_ms``, across restarts. A ban never shortens
        one already in force: the later end wins, with its reason."""
        with self._write() as db:
            db.execute(
                "INSERT INTO bans (wallet, until_unix_ms, reason, banned_at_unix_ms) VALUES (?, ?, ?, ?)"
                " ON CONFLICT(wallet) DO UPDATE SET"
                " reason = CASE WHEN excluded.until_unix_ms >= until_unix_ms THEN excluded.reason ELSE reason END,"
                " banned_at_unix_ms = CASE WHEN excluded.until_unix_ms >= until_unix_ms"
                " THEN excluded.banned_at_unix_ms ELSE banned_at_unix_ms END,"
                " until_unix_ms = MAX(until_unix_ms, excluded.until_unix_ms)",
                (wallet, until_unix_ms, reason, _now_ms()),
            )

    def active_bans(self, now_unix_ms: int) -> dict[str, int]:
        """Every ban in force at ``now_unix_ms``: wallet -> until (unix ms). The hub loads
        them at start-up so a restart frees no quarantined wallet."""
        with self._lock:
            rows = self._db.execute("SELECT wallet, until_unix_ms FROM bans WHERE until_unix_ms > ?",
                                    (now_unix_ms,)).fetchall()
        return {str(w): int(u) for w, u in rows}

    def session_wallet(self, session_id: str) -> str | None:
        """The wallet of a session this store knows (live or ended), or None."""
        with self._lock:
            row = self._db.execute("SELECT wallet FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        return None if row is None else str(row[0])

    def wallet_history(self, wallet: str) -> WalletHistory:
        """What this store holds about ``wallet`` for the hub's rate of new sessions: whether
        the backbone accepted work from one of its sessions that is not quarantined, and when
        its latest ban was imposed. Never raises: a store that cannot answer (logged) gives
        the history of a wallet it never saw, so the session pays a stranger's price and is
        not refused for the store's trouble."""
        try:
            with self._lock:
                worked, banned_at = self._db.execute(
                    "SELECT EXISTS (SELECT 1 FROM sessions s JOIN work w ON w.session_id = s.session_id"
                    " WHERE s.wallet = ? AND s.quarantined_seq = 0 AND w.cumulative_bytes > 0),"
                    " (SELECT banned_at_unix_ms FROM bans WHERE wallet = ?)",
                    (wallet, wallet),
                ).fetchone()
        except sqlite3.Error as exc:
            log.warning("cannot read a wallet's history; it counts as new", wallet=wallet, error=str(exc))
            return WalletHistory()
        return WalletHistory(accepted_work=bool(worked),
                             last_quarantined_unix_ms=None if banned_at is None else int(banned_at))

    def banned_until(self, wallet: str, now_unix_ms: int) -> int | None:
        """When ``wallet``'s ban ends (unix ms), or None when it is not banned at
        ``now_unix_ms`` (never banned, or the ban has expired)."""
        with self._lock:
            row = self._db.execute("SELECT until_unix_ms FROM bans WHERE wallet = ?", (wallet,)).fetchone()
        if row is None or int(row[0]) <= now_unix_ms:
            return None
        return int(row[0])
