"""Opening a ledger by its URL: the one place that knows both dialects, so that the store
(``_store``) and each dialect (``_sqlite``, ``_postgres``) import one way only."""

from __future__ import annotations

from ledger._store import LedgerStore, StoreError

__all__ = ["open_store"]


def open_store(url: str, *, pool_size: int = 8) -> LedgerStore:
    """Open (creating its tables if needed) the ledger at ``url``:

    * ``sqlite:///PATH`` - a SQLite file (relative PATH, or absolute as ``sqlite:////abs``),
      WAL journal, synchronous=FULL;
    * ``postgresql://USER@HOST:PORT/DB`` (or ``postgres://``) - PostgreSQL through psycopg 3.

    Raises StoreError for an unsupported URL or schema, StoreUnavailable when the database
    cannot be reached. The store owns its connections: close it when done.
    """
    if url.startswith("sqlite://"):
        from ledger._sqlite import SqliteDialect

        return LedgerStore(SqliteDialect.from_url(url), pool_size=pool_size)
    if url.startswith(("postgresql://", "postgres://")):
        from ledger._postgres import PostgresDialect

        try:
            import psycopg  # noqa: F401
        except ImportError as exc:
            raise StoreError("a PostgreSQL ledger needs psycopg 3: pip install 'kvasir-rpc[postgres]'") from exc

        return LedgerStore(PostgresDialect(url), pool_size=pool_size)
    raise StoreError(f"unsupported database URL {url[:40]!r}: use sqlite:///PATH or postgresql://...")
