"""The ledger's books: sessions, credits and double-entry journal, on SQLite or PostgreSQL.

One schema and one set of SQL statements serve both databases; ``_sqlite`` and
``_postgres`` hold only what must differ (connecting, locking, the identity column, how a
batch draws its credit ids).

Money rules, enforced in one transaction per batch of receipts, receipt by receipt in order:

* a receipt credits ``(cumulative_bytes - last credited cumulative) x rate`` nano-KVR
  to its wallet, once, together with the record of the receipt (``credits``);
* the first receipt of a (hub_key, session_id) fixes its wallet: another wallet is
  REJECTED (WALLET_MISMATCH);
* a seq already credited is DUPLICATE with the same count, REJECTED (CONFLICT) with
  another; a seq at or below the last credited one, or a count below the credited count,
  is STALE;
* a receipt marked ``quarantined`` is checked and credited like any other, and its credit
  closes the session: every later receipt of that (hub_key, session_id) is REJECTED
  (SESSION_QUARANTINED), while a replay of the closing receipt stays DUPLICATE;
* a credit that would take the total credited past ``MAX_CREDITED_NANO`` (2^62) is
  REJECTED (LEDGER_LIMIT), so that every balance and sum stays a 64-bit integer;
* every credit is two journal ``entries``: +amount to the wallet's ``pending:<wallet>``
  account, -amount to ``rewards_pool``; account balances are kept with the entries, so
  the entries and the balances each sum to zero (``LedgerStore.books`` checks it).

Concurrency: a batch locks the session rows it touches in sorted order, then the accounts
it changes in sorted order (PostgreSQL row locks; SQLite takes its one write lock with
BEGIN IMMEDIATE). Every transaction takes locks in that one global order, so concurrent
hubs never deadlock, and the hot ``rewards_pool`` row is held only from the end of a batch
to its commit.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, Protocol, TypeVar

from kvasir_rpc import ReceiptError, ledger_pb2, open_receipt

__all__ = [
    "POOL_ACCOUNT",
    "Balance",
    "Books",
    "CreditRecord",
    "LedgerStore",
    "Outcome",
    "StoreError",
    "StoreStatistics",
    "StoreUnavailable",
    "pending_account",
]

POOL_ACCOUNT = "rewards_pool"
# 2 added the quarantine columns. A version-1 database is migrated when opened (MIGRATIONS);
# a ledger that reads version 1 refuses a version-2 one, since it would ignore the marker
# and credit a quarantined session.
SCHEMA_VERSION = "2"
_MIGRATES_FROM = ("1",)
MAX_RATE_NANO_PER_BYTE = 1000  # with MAX_CUMULATIVE_BYTES (2^50) a credit stays below 2^60
# All credits together stay at or below this, so that every balance, every sum of entries and
# the books' totals fit a signed 64-bit integer (SQLite would otherwise turn an overflowing
# balance into a float without a word). Past it a receipt is REJECTED (LEDGER_LIMIT).
MAX_CREDITED_NANO = 1 << 62

T = TypeVar("T")

# {id} and {blob} are the only spellings the two databases disagree on.
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS ledger_meta (
        name TEXT PRIMARY KEY,
        value TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS sessions (
        hub_key TEXT NOT NULL,
        session_id TEXT NOT NULL,
        wallet TEXT NOT NULL,
        last_seq BIGINT NOT NULL,
        last_cumulative_bytes BIGINT NOT NULL,
        quarantined BOOLEAN NOT NULL DEFAULT FALSE,
        PRIMARY KEY (hub_key, session_id)
    )""",
    """CREATE TABLE IF NOT EXISTS credits (
        credit_id {id},
        hub_key TEXT NOT NULL,
        session_id TEXT NOT NULL,
        seq BIGINT NOT NULL,
        wallet TEXT NOT NULL,
        cumulative_bytes BIGINT NOT NULL,
        bytes BIGINT NOT NULL CHECK (bytes >= 0),
        nano_kvr BIGINT NOT NULL CHECK (nano_kvr >= 0),
        rate_nano_per_byte BIGINT NOT NULL,
        issued_at_unix_ms BIGINT NOT NULL,
        credited_at_unix_ms BIGINT NOT NULL,
        receipt {blob} NOT NULL,
        signature {blob} NOT NULL,
        quarantined BOOLEAN NOT NULL DEFAULT FALSE,
        UNIQUE (hub_key, session_id, seq),
        FOREIGN KEY (hub_key, session_id) REFERENCES sessions (hub_key, session_id)
    )""",
    "CREATE INDEX IF NOT EXISTS credits_by_wallet ON credits (wallet, credit_id)",
    """CREATE TABLE IF NOT EXISTS accounts (
        account TEXT PRIMARY KEY,
        balance_nano BIGINT NOT NULL,
        bytes BIGINT NOT NULL,
        entry_count BIGINT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS entries (
        credit_id BIGINT NOT NULL REFERENCES credits (credit_id),
        account TEXT NOT NULL REFERENCES accounts (account),
        amount_nano BIGINT NOT NULL,
        PRIMARY KEY (credit_id, account)
    )""",
)

# Columns added after a table was first released: (table, column, its DDL). A database made
# by an older ledger lacks them; _init_schema adds them, and CREATE TABLE above already
# holds them for a new database.
MIGRATIONS = (
    ("sessions", "quarantined", "BOOLEAN NOT NULL DEFAULT FALSE"),
    ("credits", "quarantined", "BOOLEAN NOT NULL DEFAULT FALSE"),
)

_CREDIT_COLUMNS = (
    "credit_id, wallet, hub_key, session_id, seq, cumulative_bytes, bytes, nano_kvr, "
    "rate_nano_per_byte, issued_at_unix_ms, credited_at_unix_ms, quarantined"
)


class StoreError(RuntimeError):
    """The database cannot be used as a ledger (bad URL, newer schema, unsupported setting)."""


class StoreUnavailable(StoreError):
    """The database did not answer in time or refused the connection. Nothing of the failed
    call was committed, or, if the connection broke during COMMIT, it may have been: either
    way retrying the same receipts is safe, since they credit once."""


class Dialect(Protocol):
    """What differs between the databases. Connections are in autocommit mode and every
    transaction is an explicit BEGIN ... COMMIT sent by LedgerStore."""

    name: str
    id_column: str  # the DDL of credits.credit_id
    blob_type: str
    begin_write: str
    begin_read: str
    lock_suffix: str  # appended to a SELECT that must lock its row until COMMIT

    def connect(self) -> Any: ...
    def sql(self, text: str) -> str: ...
    def allocate_ids(self, cur: Any, n: int) -> list[int]:
        """``n`` new, ascending credit ids, inside the current write transaction."""
        ...
    def init_schema(self, cur: Any, statements: Sequence[str]) -> None: ...
    def columns(self, cur: Any, table: str) -> set[str]:
        """The names of ``table``'s columns, inside the current transaction."""
        ...
    def classify(self, exc: BaseException) -> str | None:
        """'retry' (deadlock, serialization failure), 'reconnect' (the connection broke),
        'unavailable' (a timeout: give up now), or None (a bug: let it propagate)."""
        ...


@dataclasses.dataclass(frozen=True)
class CreditRecord:
    """One credited receipt, as stored."""

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
    quarantined: bool = False  # this credit closed its session

    def to_proto(self) -> ledger_pb2.Credit:
        return ledger_pb2.Credit(**dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What became of one receipt: a ``ledger_pb2.ReceiptStatus``, with a ``RejectReason`` and
    a sentence when it did not credit, and the credit when CREDITED or DUPLICATE."""

    status: ledger_pb2.ReceiptStatus
    reason: ledger_pb2.RejectReason = ledger_pb2.REJECT_REASON_UNSPECIFIED
    detail: str = ""
    credit: CreditRecord | None = None

    @classmethod
    def rejected(cls, error: ReceiptError) -> Outcome:
        return cls(ledger_pb2.RECEIPT_STATUS_REJECTED, error.reason, error.detail)

    def to_proto(self) -> ledger_pb2.ReceiptResult:
        result = ledger_pb2.ReceiptResult(status=self.status, reason=self.reason, detail=self.detail)
        if self.credit is not None:
            result.credit.CopyFrom(self.credit.to_proto())
        return result


@dataclasses.dataclass(frozen=True)
class Balance:
    """A wallet's pending rewards (nano-KVR), bytes credited and number of credits."""

    wallet: str
    pending_nano_kvr: int
    bytes_credited: int
    credit_count: int


@dataclasses.dataclass(frozen=True)
class Books:
    """Totals of the whole ledger and every inconsistency found (``problems``)."""

    entries_total_nano: int
    balances_total_nano: int
    pool_balance_nano: int
    credits: int
    entries: int
    credited_nano: int
    credited_bytes: int
    problems: tuple[str, ...]

    @property
    def balanced(self) -> bool:
        """True when entries and balances sum to zero and no inconsistency was found."""
        return self.entries_total_nano == 0 and self.balances_total_nano == 0 and not self.problems


@dataclasses.dataclass(frozen=True)
class StoreStatistics:
    """Counters since the store was opened: batches committed and receipts by outcome."""

    batches: int
    credited: int
    duplicate: int
    stale: int
    rejected: int
    credited_nano: int
    credited_bytes: int


def pending_account(wallet: str) -> str:
    """The name of a wallet's pending-rewards account."""
    return f"pending:{wallet}"


@dataclasses.dataclass
class _SessionState:
    wallet: str
    last_seq: int
    last_cumulative: int
    quarantined: bool
    dirty: bool = False


class _Pool:
    """At most ``size`` connections, made on demand. A connection whose use raised is closed
    rather than reused: its transaction state is unknown."""

    def __init__(self, connect: Callable[[], Any], size: int, wait_s: float) -> None:
        self._connect = connect
        self._slots = threading.BoundedSemaphore(size)
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._wait_s = wait_s
        self._closed = False

    @contextmanager
    def connection(self) -> Iterator[Any]:
        if not self._slots.acquire(timeout=self._wait_s):
            raise StoreUnavailable(f"no free database connection within {self._wait_s:g} s")
        try:
            with self._lock:
                if self._closed:
                    raise StoreUnavailable("the store is closed")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = self._connect()
            try:
                yield conn
            except BaseException:
                with suppress(Exception):
                    conn.close()
                raise
            with self._lock:
                if self._closed:
                    conn.close()
                else:
                    self._idle.append(conn)
        finally:
            self._slots.release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            with suppress(Exception):
                conn.close()


class LedgerStore:
    """The ledger's books in one database. Thread-safe: each call takes a pooled connection.

    Methods raise StoreUnavailable when the database does not answer in time or drops the
    connection, and StoreError for a database that cannot hold these books. Call ``close``
    when done (also a context manager).
    """

    _ATTEMPTS = 4

    def __init__(
        self,
        dialect: Dialect,
        *,
        pool_size: int = 8,
        pool_wait_s: float = 15.0,
        clock_ms: Callable[[], int] | None = None,
    ) -> None:
        self.dialect = dialect
        self._pool = _Pool(dialect.connect, pool_size, pool_wait_s)
        self._clock_ms = clock_ms or (lambda: time.time_ns() // 1_000_000)
        self._stats_lock = threading.Lock()
        self._stats = {f.name: 0 for f in dataclasses.fields(StoreStatistics)}
        self._sql: dict[str, str] = {}
        self._transaction(self._init_schema, write=True)

    def __enter__(self) -> LedgerStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every pooled connection; later calls raise StoreUnavailable."""
        self._pool.close()

    # -- plumbing ---------------------------------------------------------------------

    def _q(self, text: str) -> str:
        sql = self._sql.get(text)
        if sql is None:
            sql = self._sql[text] = self.dialect.sql(text)
        return sql

    def _transaction(self, work: Callable[[Any], T], *, write: bool) -> T:
        """Run ``work(cursor)`` in one transaction, retrying deadlocks, serialization failures
        and broken connections (the work is re-run from scratch, so it must only touch the
        database)."""
        for attempt in range(self._ATTEMPTS):
            try:
                with self._pool.connection() as conn:
                    cur = conn.cursor()
                    cur.execute(self.dialect.begin_write if write else self.dialect.begin_read)
                    try:
                        result = work(cur)
                        cur.execute("COMMIT")
                    except BaseException:
                        with suppress(Exception):
                            cur.execute("ROLLBACK")
                        raise
                    return result
            except StoreError:
                raise
            except Exception as exc:
                kind = self.dialect.classify(exc)
                if kind in ("retry", "reconnect") and attempt + 1 < self._ATTEMPTS:
                    # The pool dropped the failed connection; the next attempt takes another.
                    time.sleep(0.005 * 2**attempt)
                    continue
                if kind in ("retry", "reconnect", "unavailable"):
                    raise StoreUnavailable(f"{self.dialect.name}: {type(exc).__name__}: {exc}".strip()) from exc
                raise
        raise AssertionError("unreachable")

    def _init_schema(self, cur: Any) -> None:
        # The one place the schema is made and migrated, inside one write transaction (and,
        # on PostgreSQL, under the dialect's schema lock): two ledgers starting at once on an
        # old database migrate it once.
        ddl = [s.format(id=self.dialect.id_column, blob=self.dialect.blob_type) for s in SCHEMA]
        self.dialect.init_schema(cur, ddl)
        cur.execute(
            self._q("INSERT INTO ledger_meta (name, value) VALUES (?, ?) ON CONFLICT (name) DO NOTHING"),
            ("schema_version", SCHEMA_VERSION),
        )
        cur.execute(self._q("SELECT value FROM ledger_meta WHERE name = ?"), ("schema_version",))
        (version,) = cur.fetchone()
        if version != SCHEMA_VERSION and version not in _MIGRATES_FROM:
            raise StoreError(f"the database holds ledger schema {version}; this ledger reads {SCHEMA_VERSION}")
        for table, column, definition in MIGRATIONS:
            if column not in self.dialect.columns(cur, table):
                cur.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
        if version != SCHEMA_VERSION:
            cur.execute(self._q("UPDATE ledger_meta SET value = ? WHERE name = ?"), (SCHEMA_VERSION, "schema_version"))

    # -- writing ----------------------------------------------------------------------

    def submit(
        self, signed: Sequence[ledger_pb2.SignedReceipt], trusted_keys: Collection[str], rate: int
    ) -> list[Outcome]:
        """Verify each signed receipt against ``trusted_keys`` and credit the good ones at
        ``rate`` nano-KVR per byte, in one transaction. Returns one Outcome per receipt, in
        order; a bad receipt is its own REJECTED outcome. When this returns, every CREDITED
        and DUPLICATE outcome is committed. Raises StoreUnavailable (nothing to assume about
        this batch: submit it again) or ValueError for a rate out of [1, 1000].
        """
        items: list[ledger_pb2.ByteReceipt | Outcome] = []
        for s in signed:
            try:
                items.append(open_receipt(s, trusted_keys))
            except ReceiptError as exc:
                items.append(Outcome.rejected(exc))
        if not 1 <= rate <= MAX_RATE_NANO_PER_BYTE:
            raise ValueError(f"rate must be 1 to {MAX_RATE_NANO_PER_BYTE} nano-KVR per byte, got {rate}")
        if not any(isinstance(i, ledger_pb2.ByteReceipt) for i in items):
            outcomes = [i for i in items if isinstance(i, Outcome)]
        else:
            now = self._clock_ms()
            outcomes = self._transaction(lambda cur: self._apply(cur, items, signed, rate, now), write=True)
        self._count(outcomes)
        return outcomes

    def _apply(
        self,
        cur: Any,
        items: Sequence[ledger_pb2.ByteReceipt | Outcome],
        raw: Sequence[ledger_pb2.SignedReceipt],
        rate: int,
        now: int,
    ) -> list[Outcome]:
        # Decides and writes one batch inside the open transaction. Re-run from scratch on a
        # retry, so it changes nothing outside the database but its own locals.
        q = self._q
        receipts = [(i, r) for i, r in enumerate(items) if isinstance(r, ledger_pb2.ByteReceipt)]
        # Lock every session of the batch first, in sorted order (see the module docstring).
        first_wallet: dict[tuple[str, str], str] = {}
        for _, r in receipts:
            first_wallet.setdefault((r.hub_key, r.session_id), r.wallet)
        sessions: dict[tuple[str, str], _SessionState] = {}
        select = q(
            "SELECT wallet, last_seq, last_cumulative_bytes, quarantined FROM sessions"
            " WHERE hub_key = ? AND session_id = ?"
            + self.dialect.lock_suffix
        )
        for key in sorted(first_wallet):
            cur.execute(select, key)
            row = cur.fetchone()
            if row is None:
                # A new session: the first receipt seen fixes its wallet. ON CONFLICT covers a
                # concurrent batch that inserted it since our SELECT; we then lock theirs.
                cur.execute(
                    q(
                        "INSERT INTO sessions (hub_key, session_id, wallet, last_seq, last_cumulative_bytes)"
                        " VALUES (?, ?, ?, 0, 0) ON CONFLICT (hub_key, session_id) DO NOTHING"
                    ),
                    (*key, first_wallet[key]),
                )
                cur.execute(select, key)
                row = cur.fetchone()
            sessions[key] = _SessionState(row[0], int(row[1]), int(row[2]), bool(row[3]))

        # Decide every receipt in order, against the locked rows and this batch's own credits;
        # write afterwards in a few executemany calls (pipelined on PostgreSQL), since one
        # round trip per credit was most of a batch's time.
        outcomes: list[Outcome | None] = [i if isinstance(i, Outcome) else None for i in items]
        # The total credited so far, read (not locked: the pool row stays last in the lock
        # order) inside this write transaction. SQLite's one writer makes it exact; on
        # PostgreSQL a concurrent batch may have added to it since, and a bigint that still
        # overflowed would fail that batch with an error, never corrupt the books.
        cur.execute(q("SELECT balance_nano FROM accounts WHERE account = ?"), (POOL_ACCOUNT,))
        pool = cur.fetchone()
        credited_nano = -int(pool[0]) if pool is not None else 0
        fresh: list[tuple[int, ledger_pb2.ByteReceipt, int]] = []  # (item index, receipt, delta bytes)
        fresh_by_seq: dict[tuple[str, str, int], int] = {}  # -> position in fresh
        duplicates_of_fresh: list[tuple[int, int]] = []  # (item index, position in fresh)
        for index, r in receipts:
            key = (r.hub_key, r.session_id)
            st = sessions[key]
            if r.wallet != st.wallet:
                outcomes[index] = Outcome(
                    ledger_pb2.RECEIPT_STATUS_REJECTED, ledger_pb2.REJECT_REASON_WALLET_MISMATCH,
                    f"session {r.session_id} of hub {r.hub_key[:16]}... belongs to wallet {st.wallet}, "
                    f"not {r.wallet}",
                )
            elif r.seq <= st.last_seq:
                pos = fresh_by_seq.get((*key, r.seq))
                if pos is not None:
                    earlier_bytes = fresh[pos][1].cumulative_bytes
                    earlier_quarantined = fresh[pos][1].quarantined
                    earlier = None
                else:
                    earlier = self._credit_by_seq(cur, r.hub_key, r.session_id, r.seq)
                    earlier_bytes = earlier.cumulative_bytes if earlier is not None else -1
                    earlier_quarantined = earlier is not None and earlier.quarantined
                if earlier_bytes >= 0 and earlier_quarantined != r.quarantined:
                    # One seq signed both as closing the session and not: as with two counts,
                    # neither statement is trusted more.
                    outcomes[index] = Outcome(
                        ledger_pb2.RECEIPT_STATUS_REJECTED, ledger_pb2.REJECT_REASON_CONFLICT,
                        f"seq {r.seq} was credited with quarantined={earlier_quarantined}, "
                        f"not quarantined={r.quarantined}",
                    )
                elif earlier_bytes == r.cumulative_bytes:
                    outcomes[index] = Outcome(
                        ledger_pb2.RECEIPT_STATUS_DUPLICATE, detail=f"seq {r.seq} was credited before",
                        credit=earlier,
                    )
                    if pos is not None:
                        duplicates_of_fresh.append((index, pos))
                elif earlier_bytes >= 0:
                    # The hub signed two counts for one seq: a hub bug or a forged key; either
                    # way neither count is trusted more, so the second earns nothing.
                    outcomes[index] = Outcome(
                        ledger_pb2.RECEIPT_STATUS_REJECTED, ledger_pb2.REJECT_REASON_CONFLICT,
                        f"seq {r.seq} was credited with cumulative_bytes {earlier_bytes}, not {r.cumulative_bytes}",
                    )
                else:
                    outcomes[index] = Outcome(
                        ledger_pb2.RECEIPT_STATUS_STALE,
                        detail=f"seq {r.seq} is older than the last credited seq {st.last_seq}",
                    )
            elif st.quarantined:
                outcomes[index] = Outcome(
                    ledger_pb2.RECEIPT_STATUS_REJECTED, ledger_pb2.REJECT_REASON_SESSION_QUARANTINED,
                    f"session {r.session_id} of hub {r.hub_key[:16]}... was quarantined by its hub with seq "
                    f"{st.last_seq}: it earns nothing after that receipt, so seq {r.seq} is refused for good; "
                    f"the hub should stop issuing receipts for this session",
                )
            elif r.cumulative_bytes < st.last_cumulative:
                outcomes[index] = Outcome(
                    ledger_pb2.RECEIPT_STATUS_STALE,
                    detail=f"cumulative_bytes {r.cumulative_bytes} is below the {st.last_cumulative} "
                    f"already credited",
                )
            elif credited_nano + (r.cumulative_bytes - st.last_cumulative) * rate > MAX_CREDITED_NANO:
                outcomes[index] = Outcome(
                    ledger_pb2.RECEIPT_STATUS_REJECTED, ledger_pb2.REJECT_REASON_LEDGER_LIMIT,
                    f"crediting {r.cumulative_bytes - st.last_cumulative} bytes would take the ledger's total credited "
                    f"past {MAX_CREDITED_NANO} nano-KVR; a hub that signs such counts is broken",
                )
            else:
                credited_nano += (r.cumulative_bytes - st.last_cumulative) * rate
                fresh_by_seq[(*key, r.seq)] = len(fresh)
                fresh.append((index, r, r.cumulative_bytes - st.last_cumulative))
                st.last_seq, st.last_cumulative, st.dirty = r.seq, r.cumulative_bytes, True
                st.quarantined = r.quarantined

        if fresh:
            self._write_credits(cur, fresh, raw, rate, now, outcomes)
            for index, pos in duplicates_of_fresh:
                credited, duplicate = outcomes[fresh[pos][0]], outcomes[index]
                assert credited is not None and duplicate is not None
                outcomes[index] = dataclasses.replace(duplicate, credit=credited.credit)
            cur.executemany(
                q(
                    "UPDATE sessions SET last_seq = ?, last_cumulative_bytes = ?, quarantined = ?"
                    " WHERE hub_key = ? AND session_id = ?"
                ),
                [(st.last_seq, st.last_cumulative, st.quarantined, *key)
                 for key, st in sorted(sessions.items()) if st.dirty],
            )
        assert all(o is not None for o in outcomes)
        return outcomes  # type: ignore[return-value]

    def _write_credits(
        self,
        cur: Any,
        fresh: list[tuple[int, ledger_pb2.ByteReceipt, int]],
        raw: Sequence[ledger_pb2.SignedReceipt],
        rate: int,
        now: int,
        outcomes: list[Outcome | None],
    ) -> None:
        q = self._q
        ids = self.dialect.allocate_ids(cur, len(fresh))
        credit_rows, entry_rows = [], []
        deltas: dict[str, list[int]] = {}  # account -> [nano, bytes, entries]
        for credit_id, (index, r, delta) in zip(ids, fresh):
            nano = delta * rate
            # The signed bytes are kept as they came: evidence anyone can verify again later.
            credit_rows.append((credit_id, r.hub_key, r.session_id, r.seq, r.wallet, r.cumulative_bytes, delta, nano,
                                rate, r.issued_at_unix_ms, now, raw[index].receipt, raw[index].signature,
                                r.quarantined))
            account = pending_account(r.wallet)
            entry_rows += [(credit_id, account, nano), (credit_id, POOL_ACCOUNT, -nano)]
            for name, sign in ((account, 1), (POOL_ACCOUNT, -1)):
                d = deltas.setdefault(name, [0, 0, 0])
                d[0] += sign * nano
                d[1] += delta
                d[2] += 1
            outcomes[index] = Outcome(ledger_pb2.RECEIPT_STATUS_CREDITED, credit=CreditRecord(
                credit_id, r.wallet, r.hub_key, r.session_id, r.seq, r.cumulative_bytes, delta, nano, rate,
                r.issued_at_unix_ms, now, r.quarantined,
            ))
        cur.executemany(
            q(
                "INSERT INTO credits (credit_id, hub_key, session_id, seq, wallet, cumulative_bytes, bytes, nano_kvr,"
                " rate_nano_per_byte, issued_at_unix_ms, credited_at_unix_ms, receipt, signature, quarantined)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            ),
            credit_rows,
        )
        # Accounts last and sorted: the one global lock order, and the pool row held briefly.
        cur.executemany(
            q(
                "INSERT INTO accounts (account, balance_nano, bytes, entry_count) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (account) DO UPDATE SET balance_nano = accounts.balance_nano + excluded.balance_nano,"
                " bytes = accounts.bytes + excluded.bytes, entry_count = accounts.entry_count + excluded.entry_count"
            ),
            [(account, *deltas[account]) for account in sorted(deltas)],
        )
        cur.executemany(q("INSERT INTO entries (credit_id, account, amount_nano) VALUES (?, ?, ?)"), entry_rows)

    def _credit_by_seq(self, cur: Any, hub_key: str, session_id: str, seq: int) -> CreditRecord | None:
        cur.execute(
            self._q(f"SELECT {_CREDIT_COLUMNS} FROM credits WHERE hub_key = ? AND session_id = ? AND seq = ?"),
            (hub_key, session_id, seq),
        )
        row = cur.fetchone()
        return None if row is None else _credit(row)

    def _count(self, outcomes: Sequence[Outcome]) -> None:
        names: dict[int, str] = {
            ledger_pb2.RECEIPT_STATUS_CREDITED: "credited",
            ledger_pb2.RECEIPT_STATUS_DUPLICATE: "duplicate",
            ledger_pb2.RECEIPT_STATUS_STALE: "stale",
            ledger_pb2.RECEIPT_STATUS_REJECTED: "rejected",
        }
        with self._stats_lock:
            self._stats["batches"] += 1
            for o in outcomes:
                self._stats[names[o.status]] += 1
                if o.status == ledger_pb2.RECEIPT_STATUS_CREDITED and o.credit is not None:
                    self._stats["credited_nano"] += o.credit.nano_kvr
                    self._stats["credited_bytes"] += o.credit.bytes

    def statistics(self) -> StoreStatistics:
        """Counters of this process since the store was opened."""
        with self._stats_lock:
            return StoreStatistics(**self._stats)

    # -- reading ----------------------------------------------------------------------

    def balance(self, wallet: str) -> Balance:
        """A wallet's balance; zeros for a wallet never credited. The caller checks the format."""

        def read(cur: Any) -> Balance:
            cur.execute(
                self._q("SELECT balance_nano, bytes, entry_count FROM accounts WHERE account = ?"),
                (pending_account(wallet),),
            )
            row = cur.fetchone()
            if row is None:
                return Balance(wallet, 0, 0, 0)
            return Balance(wallet, int(row[0]), int(row[1]), int(row[2]))

        return self._transaction(read, write=False)

    def wallet_count(self) -> int:
        """How many wallets hold a pending-rewards account (were ever credited)."""

        def read(cur: Any) -> int:
            cur.execute(self._q("SELECT COUNT(*) FROM accounts WHERE account LIKE ?"), (pending_account("%"),))
            return int(cur.fetchone()[0])

        return self._transaction(read, write=False)

    def list_credits(self, wallet: str, *, after_id: int = 0, limit: int = 100) -> list[CreditRecord]:
        """Up to ``limit`` credits of ``wallet`` with ``credit_id > after_id``, oldest first."""

        def read(cur: Any) -> list[CreditRecord]:
            cur.execute(
                self._q(
                    f"SELECT {_CREDIT_COLUMNS} FROM credits WHERE wallet = ? AND credit_id > ?"
                    " ORDER BY credit_id LIMIT ?"
                ),
                (wallet, after_id, limit),
            )
            return [_credit(row) for row in cur.fetchall()]

        return self._transaction(read, write=False)

    def books(self) -> Books:
        """Audit the whole ledger in one consistent snapshot: totals, and every account whose
        balance is not the sum of its entries, every credit whose entries are not one +amount
        and one -amount, every session whose counters disagree with its credits."""

        def read(cur: Any) -> Books:
            def one(sql: str, params: tuple[Any, ...] = ()) -> tuple[int, ...]:
                cur.execute(self._q(sql), params)
                return tuple(int(v) for v in cur.fetchone())

            entries_total, entries = one("SELECT COALESCE(SUM(amount_nano), 0), COUNT(*) FROM entries")
            balances_total, _ = one("SELECT COALESCE(SUM(balance_nano), 0), COUNT(*) FROM accounts")
            cur.execute(self._q("SELECT balance_nano FROM accounts WHERE account = ?"), (POOL_ACCOUNT,))
            row = cur.fetchone()
            pool = int(row[0]) if row else 0
            credits, credited_nano, credited_bytes = one(
                "SELECT COUNT(*), COALESCE(SUM(nano_kvr), 0), COALESCE(SUM(bytes), 0) FROM credits"
            )
            problems: list[str] = []
            cur.execute(
                "SELECT a.account, a.balance_nano, COALESCE(e.total, 0) FROM accounts a LEFT JOIN"
                " (SELECT account, SUM(amount_nano) AS total FROM entries GROUP BY account) e"
                " ON a.account = e.account WHERE a.balance_nano <> COALESCE(e.total, 0)"
            )
            problems += [f"account {a}: balance {b} but entries sum to {t}" for a, b, t in cur.fetchall()]
            cur.execute(
                "SELECT c.credit_id, c.nano_kvr, c.wallet, COUNT(e.account), COALESCE(SUM(e.amount_nano), 0),"
                " COALESCE(SUM(CASE WHEN e.account = 'pending:' || c.wallet THEN e.amount_nano ELSE 0 END), 0)"
                " FROM credits c LEFT JOIN entries e ON e.credit_id = c.credit_id"
                " GROUP BY c.credit_id, c.nano_kvr, c.wallet"
                " HAVING COUNT(e.account) <> 2 OR COALESCE(SUM(e.amount_nano), 0) <> 0"
                " OR COALESCE(SUM(CASE WHEN e.account = 'pending:' || c.wallet THEN e.amount_nano ELSE 0 END), 0)"
                " <> c.nano_kvr"
            )
            problems += [
                f"credit {cid} of {nano} nano to {w[:16]}...: {n} entries summing to {s}, {p} to the wallet"
                for cid, nano, w, n, s, p in cur.fetchall()
            ]
            cur.execute(
                "SELECT s.hub_key, s.session_id, s.last_cumulative_bytes, COALESCE(SUM(c.bytes), 0),"
                " COALESCE(MAX(c.seq), 0), s.last_seq"
                " FROM sessions s LEFT JOIN credits c ON c.hub_key = s.hub_key AND c.session_id = s.session_id"
                " GROUP BY s.hub_key, s.session_id, s.last_cumulative_bytes, s.last_seq"
                " HAVING s.last_cumulative_bytes <> COALESCE(SUM(c.bytes), 0) OR s.last_seq <> COALESCE(MAX(c.seq), 0)"
            )
            problems += [
                f"session {h[:16]}.../{sid}: cumulative {cum} but credits sum to {b}; last seq {ls}, max credited {m}"
                for h, sid, cum, b, m, ls in cur.fetchall()
            ]
            # A quarantined session was closed by exactly one credit, its last; any other
            # session has no closing credit.
            cur.execute(
                "SELECT s.hub_key, s.session_id, s.quarantined, COUNT(c.credit_id), COALESCE(MAX(c.seq), 0), s.last_seq"
                " FROM sessions s LEFT JOIN credits c"
                " ON c.hub_key = s.hub_key AND c.session_id = s.session_id AND c.quarantined"
                " GROUP BY s.hub_key, s.session_id, s.quarantined, s.last_seq"
                " HAVING (s.quarantined AND (COUNT(c.credit_id) <> 1 OR COALESCE(MAX(c.seq), 0) <> s.last_seq))"
                " OR (NOT s.quarantined AND COUNT(c.credit_id) <> 0)"
            )
            problems += [
                f"session {h[:16]}.../{sid}: quarantined={bool(qu)} but {n} closing credits (last at seq {m}, "
                f"session at seq {ls})"
                for h, sid, qu, n, m, ls in cur.fetchall()
            ]
            return Books(
                entries_total_nano=entries_total, balances_total_nano=balances_total, pool_balance_nano=pool,
                credits=credits, entries=entries, credited_nano=credited_nano, credited_bytes=credited_bytes,
                problems=tuple(problems),
            )

        return self._transaction(read, write=False)


def _credit(row: Sequence[Any]) -> CreditRecord:
    return CreditRecord(
        int(row[0]), row[1], row[2], row[3], int(row[4]), int(row[5]), int(row[6]), int(row[7]), int(row[8]),
        int(row[9]), int(row[10]), bool(row[11]),
    )
