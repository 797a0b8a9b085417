"""SQLite for the ledger: a WAL-mode file with synchronous=FULL, one writer at a time.

Writers take the database's write lock at BEGIN IMMEDIATE (not at their first write), so
a batch never fails half-way on a lock; they queue for it up to ``busy_timeout_s``.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sqlite3
from collections.abc import Sequence

from ledger._store import StoreError

__all__ = ["SqliteDialect"]


@dataclasses.dataclass(frozen=True)
class SqliteDialect:
    """Connections to one SQLite file; see ledger._store.Dialect."""

    path: pathlib.Path
    busy_timeout_s: float = 10.0

    name = "sqlite"
    id_column = "INTEGER PRIMARY KEY"  # the rowid: ascending, never reused since we never delete
    blob_type = "BLOB"
    begin_write = "BEGIN IMMEDIATE"
    # Deferred: a read transaction in WAL mode sees one snapshot and blocks no writer.
    begin_read = "BEGIN"
    lock_suffix = ""  # BEGIN IMMEDIATE already holds the only write lock

    @classmethod
    def from_url(cls, url: str) -> SqliteDialect:
        """``sqlite:///relative/path`` or ``sqlite:////absolute/path``. Raises StoreError."""
        prefix = "sqlite:///"
        if not url.startswith(prefix) or len(url) == len(prefix):
            raise StoreError(f"expected sqlite:///PATH, got {url[:60]!r}")
        path = url[len(prefix):]
        if path == ":memory:" or path.startswith("file:"):
            raise StoreError("the ledger needs a SQLite file that outlives the process, not " + repr(path))
        return cls(pathlib.Path(path))

    def connect(self) -> sqlite3.Connection:
        try:
            # isolation_level=None: no implicit transactions; the store sends BEGIN/COMMIT.
            conn = sqlite3.connect(
                self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            (mode,) = conn.execute("PRAGMA journal_mode = WAL").fetchone()
            # FULL: a commit is on disk (WAL fsynced) before SubmitReceipts answers, so an
            # acknowledged credit survives a power cut, not only a crash of the process.
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open SQLite ledger {self.path}: {exc}") from exc
        if str(mode).lower() != "wal":
            conn.close()
            raise StoreError(f"{self.path}: SQLite refused WAL mode (journal_mode is {mode})")
        return conn

    def sql(self, text: str) -> str:
        return text

    def allocate_ids(self, cur: sqlite3.Cursor, n: int) -> list[int]:
        # BEGIN IMMEDIATE makes this transaction the only writer: max + 1 is ours.
        cur.execute("SELECT COALESCE(MAX(credit_id), 0) FROM credits")
        (top,) = cur.fetchone()
        return list(range(int(top) + 1, int(top) + 1 + n))

    def init_schema(self, cur: sqlite3.Cursor, statements: Sequence[str]) -> None:
        for statement in statements:
            cur.execute(statement)

    def columns(self, cur: sqlite3.Cursor, table: str) -> set[str]:
        cur.execute(f"PRAGMA table_info({table})")
        return {str(row[1]) for row in cur.fetchall()}

    def classify(self, exc: BaseException) -> str | None:
        # The write lock still held by another writer after busy_timeout, I/O trouble, a full
        # disk: nothing was committed and the caller may try again later. Any other error
        # (a malformed statement, a violated constraint) is a bug and propagates.
        if isinstance(exc, sqlite3.OperationalError) and any(
            words in str(exc) for words in ("locked", "busy", "disk", "I/O", "unable to open")
        ):
            return "unavailable"
        return None
