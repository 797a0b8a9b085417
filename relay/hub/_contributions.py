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

The database is used as the ledger's is (``ledger._store``, ``ledger._sqlite``):

* one connection (WAL, synchronous=FULL, a busy timeout) under one lock, so the store is
  thread-safe (the receipt loop's worker threads, the gRPC threads of the work desk); a
  write is one ``BEGIN IMMEDIATE`` transaction, re-run from scratch when it is retried;
* errors are classified: a condition that may pass (the write lock held elsewhere, a busy
  database, disk I/O trouble, a full disk) is tried ``ATTEMPTS`` times with a short backoff,
  then raised as ``ContributionStoreUnavailable``; anything else as
  ``ContributionStoreError``. No ``sqlite3.Error`` leaves a public method. Every write here
  is safe to repeat (counts keep their maximum, a receipt is signed once per growth);
* the schema is versioned (``contrib_meta.schema_version``): each numbered step of
  ``_MIGRATIONS`` is applied once, in its own transaction, and a database of a newer hub
  is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import TypeVar

from kvasir_rpc import ReceiptError, Wallet, get_logger, ledger_pb2, sign_receipt
from relay.hub._admission import WalletHistory
from relay.hub._registry import SessionStats

__all__ = [
    "SCHEMA_VERSION",
    "ContributionStore",
    "ContributionStoreError",
    "ContributionStoreUnavailable",
    "PendingReceipt",
    "ReceiptRecord",
    "Settlement",
]

log = get_logger("relay.contrib")

T = TypeVar("T")

# Tries of one call when the database answers with a condition that may pass, the pause after
# the first failed try (doubled after each), and how long SQLite itself waits for a write lock
# held elsewhere within one try. Worst case for a call that has the connection to itself:
# 3 x 1 s + 0.05 s + 0.1 s, within the backbone's 5 s deadline for ReportWork, so it hears
# UNAVAILABLE and not a timeout. The lock is given up between tries, so calls of other threads
# take their turns meanwhile rather than wait for every try of this one.
ATTEMPTS = 3
BACKOFF_S = 0.05
BUSY_TIMEOUT_S = 1.0
# How long a call waits for another call of this process to finish with the connection.
LOCK_WAIT_S = 10.0

# SQLite's primary result codes for conditions that may pass: the write lock held by another
# connection (BUSY, LOCKED), disk or file-system trouble (IOERR, CANTOPEN, PROTOCOL: a WAL
# lock race), a full disk (FULL: once space is freed).
_TRANSIENT = {
    sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_FULL,
    sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PROTOCOL,
}
_LOCKED = {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED}


class ContributionStoreError(RuntimeError):
    """The hub's contribution store cannot do what was asked, and trying again will not
    change that: a file that is not this hub's database (another program's, damaged, a newer
    hub's schema), a path SQLite cannot use, a closed store, or a bug in a statement. The
    message names the file and what to check."""


class ContributionStoreUnavailable(ContributionStoreError):
    """The database stayed locked or busy, or the disk failed, on every try of a call: a
    condition that may pass. Nothing of the call was committed (or, if the disk failed during
    the commit, it may have been); either way the call is safe to make again."""


UNTRUSTED_KEY = ledger_pb2.RejectReason.Name(ledger_pb2.REJECT_REASON_UNTRUSTED_KEY)

# The schema's version, kept in the database; each migration is one numbered step, applied
# once, in one transaction, in order. A database made before the version was kept (version 0)
# may have any earlier shape, so every step also checks what is already there (IF NOT EXISTS,
# a column present) before it changes anything.
_META = "CREATE TABLE IF NOT EXISTS contrib_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)"


def _v1_counters_and_receipts(db: sqlite3.Connection) -> None:
    for statement in (
        """CREATE TABLE IF NOT EXISTS sessions (
            session_id TEXT PRIMARY KEY,
            wallet TEXT NOT NULL,
            started_unix_ms INTEGER NOT NULL,
            ended_unix_ms INTEGER,
            bytes_to_worker INTEGER NOT NULL DEFAULT 0,
            bytes_from_worker INTEGER NOT NULL DEFAULT 0,
            last_seq INTEGER NOT NULL DEFAULT 0,
            last_receipt_bytes INTEGER NOT NULL DEFAULT 0  -- the cumulative of the last receipt
        )""",
        """CREATE TABLE IF NOT EXISTS receipts (
            session_id TEXT NOT NULL REFERENCES sessions(session_id),
            seq INTEGER NOT NULL,
            cumulative_bytes INTEGER NOT NULL,
            signed BLOB NOT NULL,
            state TEXT NOT NULL DEFAULT 'pending',  -- pending | acked | rejected
            detail TEXT,
            PRIMARY KEY (session_id, seq)
        )""",
        "CREATE INDEX IF NOT EXISTS receipts_pending ON receipts(state) WHERE state = 'pending'",
    ):
        db.execute(statement)


def _v2_work_quarantine_bans(db: sqlite3.Connection) -> None:
    for table, column, definition in (
        # The seq of the closing receipt; 0: not quarantined.
        ("sessions", "quarantined_seq", "INTEGER NOT NULL DEFAULT 0"),
        # The ledger's RejectReason name when it refused the receipt (last time).
        ("receipts", "reason", "TEXT"),
    ):
        if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
    db.execute("""CREATE TABLE IF NOT EXISTS work (
        session_id TEXT NOT NULL REFERENCES sessions(session_id),
        run_id TEXT NOT NULL,
        cumulative_bytes INTEGER NOT NULL,
        calls INTEGER NOT NULL,
        rows INTEGER NOT NULL,
        PRIMARY KEY (session_id, run_id)
    )""")
    db.execute("""CREATE TABLE IF NOT EXISTS bans (
        wallet TEXT PRIMARY KEY,
        until_unix_ms INTEGER NOT NULL,
        reason TEXT NOT NULL,
        banned_at_unix_ms INTEGER NOT NULL
    )""")
    # Receipts an older hub dropped because the ledger did not trust its key: that can be fixed
    # at the ledger, so they are worth sending again. Rows of an older hub have no reason; its
    # ledger's sentence for an untrusted key was "hub_key ... is not trusted".
    revived = db.execute(
        "UPDATE receipts SET state = 'pending', reason = ? WHERE state = 'rejected' AND reason IS NULL"
        " AND detail LIKE '%is not trusted%'",
        (UNTRUSTED_KEY,),
    ).rowcount
    if revived:
        log.info("receipts an older hub dropped for an untrusted key are pending again", receipts=revived)


def _v3_wallet_index(db: sqlite3.Connection) -> None:
    # The hub looks a wallet's history up at every verified hello (wallet_history).
    db.execute("CREATE INDEX IF NOT EXISTS sessions_wallet ON sessions(wallet)")


# (version, what it brings, the step). Append only: a released step never changes.
_MIGRATIONS: tuple[tuple[int, str, Callable[[sqlite3.Connection], None]], ...] = (
    (1, "sessions with their raw counters, receipts", _v1_counters_and_receipts),
    (2, "work per backbone run, quarantine, bans", _v2_work_quarantine_bans),
    (3, "the index of sessions by wallet", _v3_wallet_index),
)
SCHEMA_VERSION = _MIGRATIONS[-1][0]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _code(exc: sqlite3.Error) -> int | None:
    """SQLite's primary result code of ``exc`` (None when the module did not say)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def _transient(exc: sqlite3.Error) -> bool:
    code = _code(exc)
    if code is not None:
        return code in _TRANSIENT
    # No code (an error raised by the module itself): as ledger._sqlite classifies them.
    return isinstance(exc, sqlite3.OperationalError) and any(
        words in str(exc) for words in ("locked", "busy", "disk", "I/O", "unable to open"))


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
    """Thread-safe (one connection, one lock) SQLite store. Counters only ever grow.

    Opening it creates the tables or brings a database of an older hub up to date
    (``_MIGRATIONS``), and refuses one of a newer hub. Every public method raises
    ``ContributionStoreUnavailable`` when the database stayed locked, busy or unreadable for
    ``attempts`` tries of ``busy_timeout_s`` each, and ``ContributionStoreError`` for any other
    trouble of the database (never a raw ``sqlite3.Error``). Call ``close`` when done; calls
    after it raise ContributionStoreError.
    """

    def __init__(self, path: str | pathlib.Path, *, busy_timeout_s: float = BUSY_TIMEOUT_S,
                 attempts: int = ATTEMPTS) -> None:
        if attempts < 1 or busy_timeout_s < 0:
            raise ValueError(f"attempts must be at least 1 and busy_timeout_s not negative: {attempts}, "
                             f"{busy_timeout_s}")
        self.path = pathlib.Path(path)
        self.busy_timeout_s = busy_timeout_s
        self.attempts = attempts
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None  # made on first use, again after a failure
        self._closed = False
        try:
            self._migrate()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()

    # -- plumbing: connections, transactions, errors, migrations ------------------------

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: no implicit transactions; _call sends BEGIN IMMEDIATE/COMMIT.
        db = sqlite3.connect(str(self.path), timeout=self.busy_timeout_s, check_same_thread=False,
                             isolation_level=None)
        try:
            db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            (mode,) = db.execute("PRAGMA journal_mode = WAL").fetchone()
            # FULL: a commit is on disk (WAL fsynced) when the call returns, so counted work and
            # signed receipts survive a power cut, not only a crash of the hub.
            db.execute("PRAGMA synchronous = FULL")
        except BaseException:
            db.close()
            raise
        if str(mode).lower() != "wal":
            db.close()
            raise ContributionStoreError(
                f"the hub's contribution store {self.path}: SQLite refused WAL mode (journal_mode is {mode}); "
                "point --contrib-db at a file on a local disk")
        return db

    def _drop(self) -> None:
        """Close the connection (under the lock); the next call opens another."""
        if self._db is not None:
            with suppress(sqlite3.Error):
                self._db.close()
            self._db = None

    def _call(self, work: Callable[[sqlite3.Connection], T], *, write: bool = False) -> T:
        """``work(connection)`` under the lock; with ``write``, inside one BEGIN IMMEDIATE
        transaction, committed when it returns and rolled back when it raises. A condition
        that may pass is tried again from scratch (``work`` must change nothing but the
        database), up to ``attempts`` tries, pausing BACKOFF_S and doubling; then
        ContributionStoreUnavailable. Any other database error is ContributionStoreError;
        the exceptions of ``work`` itself (ValueError, KeyError...) pass unchanged."""
        try:
            return self._once(work, write)  # the usual case: no loop, no clock
        except sqlite3.Error as exc:
            error = exc
        for attempt in range(1, self.attempts):
            self._give_up_unless_transient(error)
            time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                return self._once(work, write)
            except sqlite3.Error as exc:
                error = exc
        self._give_up_unless_transient(error)
        raise self._unavailable(error) from error

    def _once(self, work: Callable[[sqlite3.Connection], T], write: bool) -> T:
        lock = self._lock
        if not (lock.acquire(False) or lock.acquire(timeout=LOCK_WAIT_S)):
            raise ContributionStoreUnavailable(
                f"the hub's contribution store {self.path} was held by another call of this hub for "
                f"{LOCK_WAIT_S:g} s; the call may be made again")
        try:
            db = self._db
            if db is None:
                if self._closed:
                    raise ContributionStoreError(f"the hub's contribution store {self.path} is closed")
                db = self._db = self._connect()
            if not write:
                return work(db)
            db.execute("BEGIN IMMEDIATE")
            try:
                result = work(db)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    with suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                raise
            return result
        except sqlite3.Error as exc:
            if _code(exc) not in _LOCKED:
                # After other trouble the connection's state is unknown: the next call opens
                # another (as the ledger's pool drops a connection whose use raised).
                self._drop()
            raise
        finally:
            lock.release()

    def _give_up_unless_transient(self, error: sqlite3.Error) -> None:
        if not _transient(error):
            raise ContributionStoreError(
                f"the hub's contribution store {self.path} failed ({type(error).__name__}: {error}); trying "
                f"again will not help: check that --contrib-db names this hub's own database and that it is "
                f"not damaged (sqlite3 {self.path} 'PRAGMA integrity_check')") from error

    def _unavailable(self, error: sqlite3.Error) -> ContributionStoreUnavailable:
        code = _code(error)
        text = str(error)
        tries = f"{self.attempts} tries of up to {self.busy_timeout_s:g} s"
        if code in _LOCKED or (code is None and ("locked" in text or "busy" in text)):
            why = (f"stayed locked by another connection ({tries}): is a second hub, a backup or a sqlite3 "
                   "shell using this file? Only this hub should write it")
        elif code == sqlite3.SQLITE_FULL:
            why = f"cannot grow ({tries}): its disk is full; free space there"
        else:
            why = (f"could not be read or written ({tries}): check the disk, that the file's directory exists "
                   "and that the hub may write there")
        return ContributionStoreUnavailable(
            f"the hub's contribution store {self.path} {why} ({error}); the call may be made again: "
            "nothing is counted twice")

    def _version(self, db: sqlite3.Connection) -> int:
        row = db.execute("SELECT value FROM contrib_meta WHERE name = 'schema_version'").fetchone()
        if row is None:
            return 0  # a new database, or one made before the version was kept
        try:
            return int(row[0])
        except (TypeError, ValueError):
            raise ContributionStoreError(
                f"the hub's contribution store {self.path} holds schema_version {row[0]!r}, not a number: "
                "point --contrib-db at this hub's own database, or at a new path to start one") from None

    def _migrate(self) -> None:
        def start(db: sqlite3.Connection) -> tuple[int, bool]:
            made = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'sessions'").fetchone()
            db.execute(_META)
            return self._version(db), made is not None

        version, made = self._call(start, write=True)
        if version > SCHEMA_VERSION:
            raise ContributionStoreError(
                f"the hub's contribution store {self.path} holds schema {version}, written by a newer hub; this "
                f"hub reads schemas up to {SCHEMA_VERSION}: run the newer hub on it (a new --contrib-db path "
                "would start an empty store, and the receipts this one holds would not be sent)")
        for number, _, step in _MIGRATIONS:
            if number > version:
                self._call(functools.partial(self._step, number, step), write=True)
        if made and version < SCHEMA_VERSION:
            log.info("the hub's contribution store was brought up to date", path=str(self.path),
                     from_version=version, to_version=SCHEMA_VERSION,
                     steps=[what for number, what, _ in _MIGRATIONS if number > version])

    def _step(self, number: int, step: Callable[[sqlite3.Connection], None], db: sqlite3.Connection) -> None:
        # Another hub opening the same file may have applied it since this one read the version.
        if self._version(db) >= number:
            return
        step(db)
        db.execute("INSERT INTO contrib_meta (name, value) VALUES ('schema_version', ?)"
                   " ON CONFLICT (name) DO UPDATE SET value = excluded.value", (str(number),))

    # -- sessions and raw counters -----------------------------------------------------

    def end_open_sessions(self) -> int:
        """At start-up: sessions of a previous run are over; their counters stand as saved."""
        now = _now_ms()
        return self._call(lambda db: db.execute(
            "UPDATE sessions SET ended_unix_ms = ? WHERE ended_unix_ms IS NULL", (now,)).rowcount, write=True)

    def record(self, stats: list[SessionStats], *, ended: bool = False) -> None:
        """Save the raw tunnel counters of live sessions (or of sessions that just ended), for
        display: receipts pay work (``add_work``), not these."""
        now = _now_ms()

        def write(db: sqlite3.Connection) -> None:
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

        self._call(write, write=True)

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

        def write(db: sqlite3.Connection) -> bool:
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

        return self._call(write, write=True)

    def work_bytes(self, session_id: str) -> int:
        """The bytes of work accepted from ``session_id``, summed over backbone runs; 0 for
        a session without work."""
        (total,) = self._call(lambda db: db.execute(
            "SELECT COALESCE(SUM(cumulative_bytes), 0) FROM work WHERE session_id = ?", (session_id,)
        ).fetchone())
        return int(total)

    def work_totals(self, session_id: str) -> tuple[int, int, int]:
        """The work accepted from ``session_id`` summed over backbone runs: (bytes, calls,
        rows); zeros for a session without work."""
        row = self._call(lambda db: db.execute(
            "SELECT COALESCE(SUM(cumulative_bytes), 0), COALESCE(SUM(calls), 0), COALESCE(SUM(rows), 0)"
            " FROM work WHERE session_id = ?", (session_id,)
        ).fetchone())
        return int(row[0]), int(row[1]), int(row[2])

    # -- receipts ----------------------------------------------------------------------

    def issue_receipts(self, key: Wallet) -> int:
        """Sign a receipt for every session whose work grew since its last receipt, with
        ``cumulative_bytes`` its work sum; never for a quarantined session. Returns how many
        were signed. A session whose count cannot be signed (beyond the receipt's bound) is
        logged and skipped, never blocking the others."""
        now = _now_ms()

        def write(db: sqlite3.Connection) -> int:
            issued = 0
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

        return self._call(write, write=True)

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
        def write(db: sqlite3.Connection) -> tuple[int, str, int, bool]:
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
                return int(closed_at), owner, receipted, False
            seq = last_seq + 1
            self._sign(db, key, session_id, owner, seq, receipted, _now_ms(), quarantined=True)
            db.execute("UPDATE sessions SET quarantined_seq = ? WHERE session_id = ?", (seq, session_id))
            return seq, owner, receipted, True

        seq, owner, receipted, closed_now = self._call(write, write=True)
        if not closed_now:
            return seq
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
        rows = self._call(lambda db: db.execute(
            "SELECT session_id, seq, signed FROM receipts WHERE state = 'pending' ORDER BY session_id, seq LIMIT ?",
            (limit,),
        ).fetchall())
        return [PendingReceipt(sid, seq, bytes(signed)) for sid, seq, signed in rows]

    def pending_count(self) -> int:
        """How many receipts wait for the ledger's answer."""
        (n,) = self._call(lambda db: db.execute("SELECT COUNT(*) FROM receipts WHERE state = 'pending'").fetchone())
        return int(n)

    def settle(self, results: Sequence[Settlement]) -> None:
        """Record the ledger's answers: 'acked' and 'rejected' receipts leave the pending
        set; 'pending' ones stay, with the reason they were refused this time."""
        def write(db: sqlite3.Connection) -> None:
            for s in results:
                if s.state not in ("acked", "rejected", "pending"):
                    raise ValueError(f"a receipt settles as acked, rejected or pending, not {s.state!r}")
                db.execute("UPDATE receipts SET state = ?, reason = ?, detail = ? WHERE session_id = ? AND seq = ?",
                           (s.state, s.reason or None, s.detail, s.receipt.session_id, s.receipt.seq))

        self._call(write, write=True)

    def receipts(self, session_id: str) -> list[ReceiptRecord]:
        """Every receipt signed for ``session_id``, by seq."""
        rows = self._call(lambda db: db.execute(
            "SELECT r.seq, r.cumulative_bytes, r.state, r.reason, r.detail, r.seq = s.quarantined_seq"
            " FROM receipts r JOIN sessions s ON s.session_id = r.session_id"
            " WHERE r.session_id = ? ORDER BY r.seq",
            (session_id,),
        ).fetchall())
        return [ReceiptRecord(session_id, int(seq), int(cum), state, reason, detail, bool(closing))
                for seq, cum, state, reason, detail, closing in rows]

    # -- bans --------------------------------------------------------------------------

    def ban(self, wallet: str, until_unix_ms: int, reason: str) -> None:
        """Refuse ``wallet`` until ``until_unix_ms``, across restarts. A ban never shortens
        one already in force: the later end wins, with its reason."""
        now = _now_ms()
        self._call(lambda db: db.execute(
            "INSERT INTO bans (wallet, until_unix_ms, reason, banned_at_unix_ms) VALUES (?, ?, ?, ?)"
            " ON CONFLICT(wallet) DO UPDATE SET"
            " reason = CASE WHEN excluded.until_unix_ms >= until_unix_ms THEN excluded.reason ELSE reason END,"
            " banned_at_unix_ms = CASE WHEN excluded.until_unix_ms >= until_unix_ms"
            " THEN excluded.banned_at_unix_ms ELSE banned_at_unix_ms END,"
            " until_unix_ms = MAX(until_unix_ms, excluded.until_unix_ms)",
            (wallet, until_unix_ms, reason, now),
        ), write=True)

    def active_bans(self, now_unix_ms: int) -> dict[str, int]:
        """Every ban in force at ``now_unix_ms``: wallet -> until (unix ms). The hub loads
        them at start-up so a restart frees no quarantined wallet."""
        rows = self._call(lambda db: db.execute("SELECT wallet, until_unix_ms FROM bans WHERE until_unix_ms > ?",
                                                (now_unix_ms,)).fetchall())
        return {str(w): int(u) for w, u in rows}

    def session_wallet(self, session_id: str) -> str | None:
        """The wallet of a session this store knows (live or ended), or None."""
        row = self._call(lambda db: db.execute("SELECT wallet FROM sessions WHERE session_id = ?",
                                               (session_id,)).fetchone())
        return None if row is None else str(row[0])

    def wallet_history(self, wallet: str) -> WalletHistory:
        """What this store holds about ``wallet`` for the hub's rate of new sessions: whether
        the backbone accepted work from one of its sessions that is not quarantined, and when
        its latest ban was imposed. Never raises: a store that cannot answer (logged) gives
        the history of a wallet it never saw, so the session pays a stranger's price and is
        not refused for the store's trouble."""
        try:
            worked, banned_at = self._call(lambda db: db.execute(
                "SELECT EXISTS (SELECT 1 FROM sessions s JOIN work w ON w.session_id = s.session_id"
                " WHERE s.wallet = ? AND s.quarantined_seq = 0 AND w.cumulative_bytes > 0),"
                " (SELECT banned_at_unix_ms FROM bans WHERE wallet = ?)",
                (wallet, wallet),
            ).fetchone())
        except ContributionStoreError as exc:
            log.warning("cannot read a wallet's history; it counts as new", wallet=wallet, error=str(exc))
            return WalletHistory()
        return WalletHistory(accepted_work=bool(worked),
                             last_quarantined_unix_ms=None if banned_at is None else int(banned_at))

    def banned_until(self, wallet: str, now_unix_ms: int) -> int | None:
        """When ``wallet``'s ban ends (unix ms), or None when it is not banned at
        ``now_unix_ms`` (never banned, or the ban has expired)."""
        row = self._call(lambda db: db.execute("SELECT until_unix_ms FROM bans WHERE wallet = ?",
                                               (wallet,)).fetchone())
        if row is None or int(row[0]) <= now_unix_ms:
            return None
        return int(row[0])
