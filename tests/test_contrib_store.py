"""The hub's contribution store uses SQLite as the ledger does: trouble that may pass (the
write lock held elsewhere, disk I/O) is tried again a bounded number of times and then raised
as ContributionStoreUnavailable, anything else as ContributionStoreError, never a raw
sqlite3.Error; its schema is versioned, a database of the hub before versioning opens with
every row, one of a newer hub is refused; the work desk answers UNAVAILABLE or INTERNAL for
them, and the receipt loop outlives a locked database and then delivers.

Real SQLite files in tmp_path; a second sqlite3 connection holding ``BEGIN IMMEDIATE`` plays
the other program that keeps the database locked. Busy timeouts are cut to tenths of a second
so that every wait stays short."""

from __future__ import annotations

import pathlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import trio
from structlog.testing import capture_logs

from kvasir_rpc import HelloInfo, Wallet, session_pb2
from relay.hub import _contributions
from relay.hub._admission import WalletHistory
from relay.hub._contributions import (
    SCHEMA_VERSION,
    ContributionStore,
    ContributionStoreError,
    ContributionStoreUnavailable,
    PendingReceipt,
    Settlement,
)
from relay.hub._receipts import ReceiptSender
from relay.hub._registry import SessionRegistry, SessionStats
from relay.hub._work_desk import DeskError, WorkDesk

HUB = Wallet.generate()
WALLET = Wallet.generate().address
RUN = "run-0123456789abcdef"
BUSY_S = 0.1  # SQLite's own wait for the lock, per try, in these tests
ATTEMPTS = 3


def opened(path: pathlib.Path) -> ContributionStore:
    return ContributionStore(path, busy_timeout_s=BUSY_S, attempts=ATTEMPTS)


@pytest.fixture
def path(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "hub-contrib.sqlite"


@pytest.fixture
def store(path: pathlib.Path) -> Iterator[ContributionStore]:
    s = opened(path)
    yield s
    s.close()


class Blocker:
    """Another program's connection: ``hold`` takes the database's write lock, ``release``
    gives it back."""

    def __init__(self, path: pathlib.Path) -> None:
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)

    def hold(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")

    def close(self) -> None:
        self.release()
        self.db.close()


@pytest.fixture
def blocker(store: ContributionStore) -> Iterator[Blocker]:
    b = Blocker(store.path)
    yield b
    b.close()


def count_tries(store: ContributionStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the store's tries (each a turn with the connection): ``tries[0]``."""
    tries = [0]
    once = store._once

    def counted(*args: object) -> object:
        tries[0] += 1
        return once(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "_once", counted)
    return tries


def stats(session_id: str, to_worker: int) -> SessionStats:
    return SessionStats(session_id=session_id, wallet=WALLET, slices={}, weights_digest=b"", device="cpu",
                        model_type="", connected_since_unix_ms=1, bytes_to_worker=to_worker,
                        bytes_from_worker=to_worker, target="", remote_address="")


# -- classification ----------------------------------------------------------------------

# Every write of the store, on a session that exists.
WRITES: dict[str, Callable[[ContributionStore], object]] = {
    "add_work": lambda s: s.add_work(RUN, "s1", 500, 2, 3),
    "record": lambda s: s.record([stats("s1", 900)]),
    "record ended": lambda s: s.record([stats("s1", 900)], ended=True),
    "end_open_sessions": lambda s: s.end_open_sessions(),
    "issue_receipts": lambda s: s.issue_receipts(HUB),
    "quarantine": lambda s: s.quarantine("s1", HUB),
    "settle": lambda s: s.settle([Settlement(PendingReceipt("s1", 1, b""), "acked")]),
    "ban": lambda s: s.ban(WALLET, 2**50, "audit mismatch"),
}


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_write_lock_held_elsewhere_is_retried_then_unavailable(store: ContributionStore, blocker: Blocker,
                                                                 write: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store.add_work(RUN, "s1", 100, 1, 1, wallet=WALLET)
    blocker.hold()
    tries = count_tries(store, monkeypatch)
    started = time.monotonic()
    with pytest.raises(ContributionStoreUnavailable) as info:
        WRITES[write](store)
    elapsed = time.monotonic() - started
    assert tries[0] == ATTEMPTS
    # Every try waited SQLite's busy timeout, with the backoff between (0.05 s, then 0.1 s).
    assert ATTEMPTS * BUSY_S * 0.9 <= elapsed < ATTEMPTS * BUSY_S + 0.15 + 2.0, elapsed
    message = str(info.value)
    assert str(store.path) in message and "locked" in message and "Only this hub should write it" in message
    assert f"{ATTEMPTS} tries" in message and "may be made again" in message
    assert not isinstance(info.value, sqlite3.Error)
    assert isinstance(info.value.__cause__, sqlite3.OperationalError)
    # Reads still answer meanwhile (WAL: a reader never waits for the writer).
    assert store.work_totals("s1") == (100, 1, 1)
    blocker.release()
    WRITES[write](store)  # the next call goes through, on the same store


def test_a_lock_released_during_the_tries_lets_the_call_succeed(path: pathlib.Path, blocker: Blocker,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # More tries than the other tests, so that a slow timer still falls within them.
    store = ContributionStore(path, busy_timeout_s=BUSY_S, attempts=6)
    try:
        store.add_work(RUN, "s1", 100, 1, 1, wallet=WALLET)
        blocker.hold()
        tries = count_tries(store, monkeypatch)
        # Released after the first try gave up (BUSY_S), during a later one.
        release = threading.Timer(BUSY_S * 2, blocker.release)
        release.start()
        try:
            assert store.add_work(RUN, "s1", 700, 5, 9)
        finally:
            release.join()
        assert 2 <= tries[0] <= 6  # it got there by trying again
        assert store.work_totals("s1") == (700, 5, 9)
    finally:
        store.close()


def test_the_store_does_not_wait_on_itself_for_ever(store: ContributionStore, blocker: Blocker) -> None:
    """Threads of the hub queue on the store's one connection; each still ends within its own
    tries, since the lock is released between them."""
    store.add_work(RUN, "s1", 1, 1, 1, wallet=WALLET)
    blocker.hold()
    errors: list[BaseException] = []

    def report(n: int) -> None:
        try:
            store.add_work(RUN, "s1", n, n, n)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=report, args=(n,)) for n in range(2, 6)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 4 and all(isinstance(e, ContributionStoreUnavailable) for e in errors), errors
    assert time.monotonic() - started < 4 * (ATTEMPTS * BUSY_S + 0.15) + 3.0
    blocker.release()
    assert store.add_work(RUN, "s1", 9, 9, 9) and store.work_totals("s1") == (9, 9, 9)


def test_disk_trouble_that_passes_is_retried_on_a_fresh_connection(store: ContributionStore,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    store.add_work(RUN, "s1", 100, 1, 1, wallet=WALLET)
    real = store._connect
    failures = iter(range(ATTEMPTS - 1))

    def flaky() -> sqlite3.Connection:
        if next(failures, None) is not None:
            exc = sqlite3.OperationalError("disk I/O error")
            exc.sqlite_errorcode = sqlite3.SQLITE_IOERR_READ  # type: ignore[attr-defined]
            raise exc
        return real()

    store._drop()  # as after an earlier failure: the next call connects again
    monkeypatch.setattr(store, "_connect", flaky)
    assert store.add_work(RUN, "s1", 200, 2, 2)  # two failed connects, then the third try works
    store._drop()
    failures = iter(range(ATTEMPTS))
    with pytest.raises(ContributionStoreUnavailable, match="could not be read or written") as info:
        store.work_totals("s1")
    assert "check the disk" in str(info.value) and str(store.path) in str(info.value)
    monkeypatch.setattr(store, "_connect", real)
    assert store.work_totals("s1") == (200, 2, 2)


@pytest.mark.parametrize(("code", "transient"), [
    (sqlite3.SQLITE_BUSY, True), (sqlite3.SQLITE_LOCKED, True), (sqlite3.SQLITE_IOERR, True),
    (sqlite3.SQLITE_IOERR_SHORT_READ, True), (sqlite3.SQLITE_FULL, True), (sqlite3.SQLITE_CANTOPEN, True),
    (sqlite3.SQLITE_CORRUPT, False), (sqlite3.SQLITE_NOTADB, False), (sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY, False),
    (sqlite3.SQLITE_ERROR, False), (sqlite3.SQLITE_READONLY, False),
])
def test_which_sqlite_codes_may_pass(code: int, transient: bool) -> None:
    exc = sqlite3.OperationalError("x")
    exc.sqlite_errorcode = code  # type: ignore[attr-defined]
    assert _contributions._transient(exc) is transient


def test_errors_that_do_not_pass_are_store_errors_at_once(store: ContributionStore, path: pathlib.Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    store.add_work(RUN, "s1", 100, 1, 1, wallet=WALLET)
    with sqlite3.connect(path) as other:  # someone damaged the database
        other.execute("DROP TABLE work")
    tries = count_tries(store, monkeypatch)
    with pytest.raises(ContributionStoreError) as info:
        store.add_work(RUN, "s1", 200, 2, 2)
    assert tries[0] == 1  # not tried again: it would not pass
    assert not isinstance(info.value, ContributionStoreUnavailable)
    message = str(info.value)
    assert "no such table: work" in message and str(path) in message and "integrity_check" in message
    assert isinstance(info.value.__cause__, sqlite3.OperationalError)
    # The hub's hello never fails on the store's trouble: the wallet counts as new.
    assert store.wallet_history(WALLET) == WalletHistory()
    # Errors of the caller's own making stay what they were.
    with pytest.raises(ValueError):
        store.add_work("", "s1", 1, 1, 1)
    with pytest.raises(KeyError):
        store.quarantine("nobody", HUB)


def test_a_file_that_is_no_database_and_a_closed_store_are_store_errors(tmp_path: pathlib.Path,
                                                                        store: ContributionStore) -> None:
    junk = tmp_path / "notes.txt"
    junk.write_bytes(b"these are not the hub's books " * 200)
    with pytest.raises(ContributionStoreError, match="not a database") as info:
        opened(junk)
    assert not isinstance(info.value, ContributionStoreUnavailable) and str(junk) in str(info.value)
    with pytest.raises(ContributionStoreUnavailable, match="directory exists"):
        opened(tmp_path / "no" / "such" / "dir" / "hub.sqlite")
    store.close()
    with pytest.raises(ContributionStoreError, match="is closed"):
        store.work_totals("s1")
    store.close()  # twice is fine


# -- migrations --------------------------------------------------------------------------

# The schema of the hub before it kept a version (the CREATE statements of ec0df0e's
# relay/hub/_contributions.py, word for word): every hub database in use today has it.
_UNVERSIONED_SCHEMA = (
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
_TABLES = ("sessions", "receipts", "work", "bans")


def _unversioned_database(path: pathlib.Path) -> None:
    """A hub database as the hub before versioning left it: WAL, every table with rows."""
    other = Wallet.generate().address
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA journal_mode=WAL")
        for statement in _UNVERSIONED_SCHEMA:
            db.execute(statement)
        db.executemany("INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", [
            ("live", WALLET, 1000, None, 5000, 7000, 2, 900, 0),
            ("ended", WALLET, 1100, 2100, 300, 400, 1, 250, 0),
            ("liar", other, 1200, 2200, 80, 90, 2, 60, 2),
        ])
        db.executemany("INSERT INTO work VALUES (?, ?, ?, ?, ?)", [
            ("live", "run-aaaaaaaaaaaaaaaa", 600, 3, 12), ("live", "run-bbbbbbbbbbbbbbbb", 400, 2, 8),
            ("ended", "run-aaaaaaaaaaaaaaaa", 250, 1, 4), ("liar", "run-aaaaaaaaaaaaaaaa", 75, 1, 1),
        ])
        db.executemany("INSERT INTO receipts VALUES (?, ?, ?, ?, ?, ?, ?)", [
            ("live", 1, 500, b"\x01signed-1", "acked", "RECEIPT_STATUS_CREDITED", None),
            ("live", 2, 900, b"\x01signed-2", "pending", "hub_key x is not trusted", "REJECT_REASON_UNTRUSTED_KEY"),
            ("ended", 1, 250, b"\x02signed-1", "pending", None, None),
            ("liar", 1, 60, b"\x03signed-1", "acked", "RECEIPT_STATUS_CREDITED", None),
            ("liar", 2, 60, b"\x03signed-2", "rejected", "seq 2 was credited with ...", "REJECT_REASON_CONFLICT"),
        ])
        db.executemany("INSERT INTO bans VALUES (?, ?, ?, ?)", [(other, 2**50, "WRONG_PARTIAL: layer 3", 2200),
                                                                (WALLET, 5, "expired long ago", 4)])


def _rows(path: pathlib.Path) -> dict[str, list[tuple[object, ...]]]:
    with sqlite3.connect(path) as db:
        return {t: sorted(db.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in _TABLES}


def _shape(path: pathlib.Path) -> dict[str, object]:
    """Each table's columns (name, type, not null, default, key) and each index's columns."""
    with sqlite3.connect(path) as db:
        tables = {t: [row[1:] for row in db.execute(f"PRAGMA table_info({t})")] for t in _TABLES}
        indexes = {name: [row[2] for row in db.execute(f"PRAGMA index_info({name})")]
                   for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'"
                                             " AND name NOT LIKE 'sqlite_autoindex%'")}
    return {"tables": tables, "indexes": indexes}


def _version(path: pathlib.Path) -> str:
    with sqlite3.connect(path) as db:
        return str(db.execute("SELECT value FROM contrib_meta WHERE name = 'schema_version'").fetchone()[0])


def test_a_database_of_the_hub_before_versioning_opens_with_every_row(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "hub.sqlite"
    _unversioned_database(path)
    before = _rows(path)
    with capture_logs() as logs:
        store = opened(path)
    try:
        assert _rows(path) == before  # not a row lost or changed
        assert _version(path) == str(SCHEMA_VERSION)
        upgraded = [e for e in logs if e["event"] == "the hub's contribution store was brought up to date"]
        assert len(upgraded) == 1 and upgraded[0]["from_version"] == 0
        # ...and the store reads every one of them back.
        assert store.work_totals("live") == (1000, 5, 20) and store.work_bytes("ended") == 250
        assert store.work_totals("liar") == (75, 1, 1)
        assert [(r.seq, r.cumulative_bytes, r.state, r.reason, r.quarantined) for r in store.receipts("live")] == [
            (1, 500, "acked", None, False), (2, 900, "pending", "REJECT_REASON_UNTRUSTED_KEY", False)]
        assert [(r.seq, r.state, r.quarantined) for r in store.receipts("liar")] == [
            (1, "acked", False), (2, "rejected", True)]
        assert [(p.session_id, p.seq, p.signed) for p in store.pending()] == [
            ("ended", 1, b"\x02signed-1"), ("live", 2, b"\x01signed-2")]
        assert store.pending_count() == 2
        assert store.active_bans(1000) == {store.session_wallet("liar"): 2**50}
        assert (store.banned_until(WALLET, 1), store.banned_until(WALLET, 10)) == (5, None)
        assert store.session_wallet("ended") == WALLET
        assert store.wallet_history(WALLET).accepted_work
        # It goes on from where it stood: seq 3 for the live session, the liar stays closed.
        assert not store.add_work(RUN, "liar", 999, 9, 9)
        assert store.add_work(RUN, "live", 50, 1, 1)
        assert store.issue_receipts(HUB) == 1
        assert [r.seq for r in store.receipts("live")][-1] == 3
    finally:
        store.close()


def test_a_new_database_has_the_schema_of_the_hub_before_versioning(tmp_path: pathlib.Path) -> None:
    old, new = tmp_path / "old.sqlite", tmp_path / "new.sqlite"
    with sqlite3.connect(old) as db:
        for statement in _UNVERSIONED_SCHEMA:
            db.execute(statement)
    opened(new).close()
    assert _shape(new) == _shape(old)
    assert _version(new) == str(SCHEMA_VERSION)


def test_each_step_is_applied_once_in_order(path: pathlib.Path) -> None:
    opened(path).close()
    # A database at version 2 lacks what step 3 brings: opening it applies step 3 alone.
    with sqlite3.connect(path) as db:
        db.execute("DROP INDEX sessions_wallet")
        db.execute("UPDATE contrib_meta SET value = '2' WHERE name = 'schema_version'")
    with capture_logs() as logs:
        opened(path).close()
    assert "sessions_wallet" in _shape(path)["indexes"]  # type: ignore[operator]
    assert _version(path) == str(SCHEMA_VERSION)
    (upgraded,) = [e for e in logs if e["event"] == "the hub's contribution store was brought up to date"]
    assert (upgraded["from_version"], upgraded["steps"]) == (2, ["the index of sessions by wallet"])
    # At the current version no step runs again (what an operator removed stays removed).
    with sqlite3.connect(path) as db:
        db.execute("DROP INDEX sessions_wallet")
    with capture_logs() as logs:
        opened(path).close()
    assert "sessions_wallet" not in _shape(path)["indexes"]  # type: ignore[operator]
    assert not [e for e in logs if "brought up to date" in e["event"]]


def test_a_database_of_a_newer_hub_is_refused(path: pathlib.Path) -> None:
    s = opened(path)
    s.add_work(RUN, "s1", 100, 1, 1, wallet=WALLET)
    s.close()
    newer = SCHEMA_VERSION + 1
    with sqlite3.connect(path) as db:
        db.execute("UPDATE contrib_meta SET value = ? WHERE name = 'schema_version'", (str(newer),))
    before = _rows(path)
    with pytest.raises(ContributionStoreError) as info:
        opened(path)
    assert not isinstance(info.value, ContributionStoreUnavailable)
    message = str(info.value)
    assert f"holds schema {newer}" in message and f"up to {SCHEMA_VERSION}" in message and str(path) in message
    assert "run the newer hub" in message
    assert _rows(path) == before and _version(path) == str(newer)  # left as it was
    with sqlite3.connect(path) as db:
        db.execute("UPDATE contrib_meta SET value = 'two' WHERE name = 'schema_version'")
    with pytest.raises(ContributionStoreError, match="'two', not a number"):
        opened(path)


def test_two_hubs_opening_an_old_database_at_once_migrate_it_once(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "hub.sqlite"
    _unversioned_database(path)
    before = _rows(path)
    stores: list[ContributionStore] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            stores.append(ContributionStore(path, busy_timeout_s=5.0))
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for s in stores:
        s.close()
    assert not errors and len(stores) == 4
    assert _rows(path) == before and _version(path) == str(SCHEMA_VERSION)


# -- the work desk -----------------------------------------------------------------------


def hello() -> HelloInfo:
    return HelloInfo(wallet=WALLET, slices={0: (1, 2)}, weights_digest=b"d" * 32, device="cpu",
                     model_type="qwen3_moe", worker_version="test")


@pytest.fixture
def desk(store: ContributionStore) -> WorkDesk:
    registry = SessionRegistry()
    registry.add("s1", hello(), target="127.0.0.1:1", remote="127.0.0.1:2")
    return WorkDesk(registry, store, HUB, quarantine_s=60)


def report(cumulative: int) -> session_pb2.ReportWorkRequest:
    return session_pb2.ReportWorkRequest(run_id=RUN, reports=[
        session_pb2.WorkReport(session_id="s1", cumulative_bytes=cumulative, calls=1, rows=2)])


def test_the_desk_answers_unavailable_while_the_database_is_locked(desk: WorkDesk, blocker: Blocker) -> None:
    assert not desk.report(report(100)).refused_session_ids
    blocker.hold()
    with pytest.raises(DeskError) as info:
        desk.report(report(300))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "locked" in info.value.message and "retry: send the report again" in info.value.message
    with pytest.raises(DeskError) as info:
        desk.quarantine(session_pb2.QuarantineRequest(session_id="s1", violation=session_pb2.VIOLATION_AUDIT_MISMATCH,
                                                      detail="layer 3"))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "send the quarantine again" in info.value.message
    blocker.release()
    # Sent again, the report counts once.
    desk.report(report(300))
    desk.report(report(300))
    assert desk.store.work_totals("s1") == (300, 1, 2)
    assert desk.statistics().work_bytes == 300


def test_the_desk_answers_internal_for_a_damaged_database(desk: WorkDesk, path: pathlib.Path) -> None:
    with sqlite3.connect(path) as other:
        other.execute("DROP TABLE work")
    with pytest.raises(DeskError) as info:
        desk.report(report(100))
    assert info.value.code == grpc.StatusCode.INTERNAL
    assert "no such table: work" in info.value.message and str(path) in info.value.message
    # Its own refusals are still its own.
    with pytest.raises(DeskError) as info:
        desk.quarantine(session_pb2.QuarantineRequest(session_id="nobody"))
    assert info.value.code == grpc.StatusCode.NOT_FOUND


# -- the receipt loop ----------------------------------------------------------------------


class FakeLedger(ReceiptSender):
    """A sender whose ledger credits every receipt it is sent (no server)."""

    delivered: list[tuple[str, int]]

    def _submit(self, pending: list[PendingReceipt]) -> list[Settlement]:
        self.delivered += [(p.session_id, p.seq) for p in pending]
        return [Settlement(p, "acked", detail="RECEIPT_STATUS_CREDITED") for p in pending]


async def until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    try:
        with trio.fail_after(timeout):
            while not predicate():
                await trio.sleep(0.02)
    except trio.TooSlowError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


def test_the_receipt_loop_outlives_a_locked_database_then_delivers(store: ContributionStore,
                                                                   blocker: Blocker) -> None:
    store.add_work(RUN, "s1", 1000, 2, 4, wallet=WALLET)
    registry = SessionRegistry()
    sender = FakeLedger(store, registry, HUB, "fake-ledger", interval_s=0.02, max_backoff_s=0.1)
    sender.delivered = []
    registry.on_removed.append(sender.session_ended)

    async def main() -> None:
        blocker.hold()
        with capture_logs() as logs:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender.run)
                await until(lambda: sender.statistics().store_errors >= 3, "three passes failing on the lock")
                # A session that ends meanwhile: its final counters wait in the queue.
                registry.add("s2", hello(), target="127.0.0.1:1", remote="127.0.0.1:2")
                registry.count_bytes("s2", to_worker=77, from_worker=7)
                registry.remove("s2")
                stats = sender.statistics()
                assert sender.delivered == [] and stats.last_error.startswith("contribution store: ")
                assert "locked" in stats.last_error
                blocker.release()
                await until(lambda: sender.delivered == [("s1", 1)], "the receipt delivered")
                await until(lambda: store.pending_count() == 0, "the receipt settled")
                await until(lambda: sender.statistics().ended_recorded == 1, "the ended session saved")
                nursery.cancel_scope.cancel()
        warnings = [e for e in logs if e["event"] == "contribution store unavailable; the pass is tried again"]
        assert len(warnings) >= 3 and all("locked" in e["error"] for e in warnings)

    trio.run(main)
    stats = sender.statistics()
    assert stats.acked == 1 and stats.last_error == "" and stats.ended_queued == 0
    assert [(r.seq, r.state) for r in store.receipts("s1")] == [(1, "acked")]


def test_the_receipt_loop_still_stops_on_a_store_error_that_does_not_pass(store: ContributionStore,
                                                                          path: pathlib.Path) -> None:
    sender = ReceiptSender(store, SessionRegistry(), HUB, None, interval_s=0.02)
    with sqlite3.connect(path) as other:
        other.execute("DROP TABLE work")
    with capture_logs() as logs, pytest.raises(ContributionStoreError, match="no such table: work"):
        trio.run(sender.run)
    # Its last pass failed the same way: logged, not raised over the first error.
    assert any(e["event"].startswith("last pass of the receipt loop failed") for e in logs)


def test_closing_the_sender_on_a_locked_database_logs_and_keeps_the_counters(store: ContributionStore,
                                                                            blocker: Blocker) -> None:
    registry = SessionRegistry()
    sender = ReceiptSender(store, registry, HUB, None)
    registry.on_removed.append(sender.session_ended)
    registry.add("s1", hello(), target="127.0.0.1:1", remote="127.0.0.1:2")
    registry.remove("s1")
    blocker.hold()
    with capture_logs() as logs:
        sender.close()
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["final counters of ended sessions not saved"]
    assert sender.statistics().ended_queued == 1


# -- a real ledger -------------------------------------------------------------------------


@pytest.mark.integration
def test_receipts_reach_a_real_ledger_once_the_lock_is_gone(store: ContributionStore, blocker: Blocker,
                                                            tmp_path: pathlib.Path) -> None:
    from ledger import create_server, open_store

    ledger_store = open_store(f"sqlite:///{tmp_path / 'ledger.db'}")
    server, port = create_server("127.0.0.1:0", ledger_store, [HUB.address], 7)
    store.add_work(RUN, "s1", 1000, 2, 4, wallet=WALLET)
    sender = ReceiptSender(store, SessionRegistry(), HUB, f"127.0.0.1:{port}", interval_s=0.02, max_backoff_s=0.1)

    async def main() -> None:
        blocker.hold()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.run)
            await until(lambda: sender.statistics().store_errors >= 3, "three passes failing on the lock")
            assert ledger_store.balance(WALLET).pending_nano_kvr == 0
            blocker.release()
            await until(lambda: ledger_store.balance(WALLET).pending_nano_kvr == 7000, "the credit")
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        assert [(r.seq, r.state) for r in store.receipts("s1")] == [(1, "acked")]
        assert sender.statistics().credited_nano_kvr == 7000
    finally:
        sender.close()
        server.stop(None)
        ledger_store.close()

