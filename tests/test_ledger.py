"""The ledger on real databases: a SQLite file and a throwaway PostgreSQL cluster (started
once per session), its gRPC service in-process, and real ledger processes driven by grpcurl
and killed with SIGKILL mid-storm. Every wait is bounded."""

from __future__ import annotations

import glob
import itertools
import json
import os
import pathlib
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from helpers import LedgerProcess, grpcurl_path

from kvasir_rpc import Wallet, ledger_pb2, ledger_pb2_grpc, sign_receipt
from ledger import LedgerStore, StoreError, StoreUnavailable, create_server, open_store

ROOT = pathlib.Path(__file__).resolve().parent.parent
RATE = 7
CREDITED = ledger_pb2.RECEIPT_STATUS_CREDITED
DUPLICATE = ledger_pb2.RECEIPT_STATUS_DUPLICATE
STALE = ledger_pb2.RECEIPT_STATUS_STALE
REJECTED = ledger_pb2.RECEIPT_STATUS_REJECTED


# -- a throwaway PostgreSQL cluster ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgCluster:
    """initdb + pg_ctl on 127.0.0.1, trust auth, its socket and data in a temporary folder.
    As root, everything runs as the ``postgres`` system user (PostgreSQL refuses root)."""

    def __init__(self, bindir: pathlib.Path, base: pathlib.Path, as_user: list[str]) -> None:
        self.bindir, self.base, self.as_user = bindir, base, as_user
        self.data = base / "data"
        self.port = 0
        self._ids = itertools.count(1)

    def _run(self, *args: str, timeout: float = 60) -> None:
        out = subprocess.run([*self.as_user, *args], capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            log = (self.base / "server.log").read_text(errors="replace")[-2000:] if (self.base / "server.log").exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}\n{log}")

    def start(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                  "--no-sync", "-E", "UTF8", "--locale=C")
        for attempt in range(3):  # a free port can be taken between our probe and the bind
            self.port = _free_port()
            opts = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.base} -c max_connections=200"
                    " -c shared_buffers=32MB")
            try:
                self._run(str(self.bindir / "pg_ctl"), "start", "-D", str(self.data), "-w", "-t", "30",
                          "-l", str(self.base / "server.log"), "-o", opts, timeout=60)
                return
            except RuntimeError:
                if attempt == 2:
                    raise

    def stop(self) -> None:
        self._run(str(self.bindir / "pg_ctl"), "stop", "-D", str(self.data), "-m", "immediate", "-t", "30")

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        name = f"ledger_{os.getpid()}_{next(self._ids)}"
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql)


def _postgres_bindir() -> pathlib.Path:
    found = glob.glob("/usr/lib/postgresql/*/bin/initdb")
    if not found:
        pytest.fail(
            "PostgreSQL is not installed: no /usr/lib/postgresql/*/bin/initdb. Install Debian's package "
            "(apt-get install -y --no-install-recommends postgresql); .ci/run does this.",
            pytrace=False,
        )
    newest = max(found, key=lambda p: [int(x) for x in re.findall(r"\d+", pathlib.Path(p).parts[-3])])
    return pathlib.Path(newest).parent


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    bindir = _postgres_bindir()
    # Not under pytest's tmp dir: that is private to root, and the server runs as postgres.
    base = pathlib.Path(tempfile.mkdtemp(prefix="kvasir-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.fail("no `postgres` system user (Debian's postgresql package creates it)", pytrace=False)
        os.chown(base, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    cluster = PgCluster(bindir, base, as_user)
    try:
        cluster.start()
        yield cluster
    finally:
        try:
            if (cluster.data / "postmaster.pid").exists():
                cluster.stop()
        finally:
            shutil.rmtree(base, ignore_errors=True)


# PostgreSQL runs a real server (initdb, pg_ctl): integration.
@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def db_url(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> str:
    """A fresh ledger database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return request.getfixturevalue("pg_cluster").new_database()


@pytest.fixture
def store(db_url: str) -> Iterator[LedgerStore]:
    with open_store(db_url) as s:
        yield s


# -- helpers ----------------------------------------------------------------------------


HUB = Wallet.generate()
HUB2 = Wallet.generate()
TRUSTED = frozenset({HUB.address, HUB2.address})


def receipt(hub: Wallet, session: str, wallet: str, seq: int, cumulative: int, *,
            quarantined: bool = False) -> ledger_pb2.SignedReceipt:
    return sign_receipt(hub, ledger_pb2.ByteReceipt(
        hub_key=hub.address, session_id=session, wallet=wallet, seq=seq, cumulative_bytes=cumulative,
        issued_at_unix_ms=1_700_000_000_000 + seq, quarantined=quarantined,
    ))


def statuses(outcomes: list) -> list[int]:  # type: ignore[type-arg]
    return [o.status for o in outcomes]


# -- money rules, on both databases --------------------------------------------------


def test_credit_is_delta_times_rate_in_exact_integers(store: LedgerStore) -> None:
    w = Wallet.generate().address
    out = store.submit([receipt(HUB, "s1-a", w, 1, 1_277_952)], TRUSTED, RATE)
    assert statuses(out) == [CREDITED]
    credit = out[0].credit
    assert credit is not None and credit.bytes == 1_277_952 and credit.nano_kvr == 8_945_664
    b = store.balance(w)
    assert (b.pending_nano_kvr, b.bytes_credited, b.credit_count) == (8_945_664, 1_277_952, 1)
    out = store.submit([receipt(HUB, "s1-a", w, 2, 2_000_000), receipt(HUB, "s1-a", w, 3, 2_000_000)], TRUSTED, RATE)
    assert statuses(out) == [CREDITED, CREDITED]
    assert [o.credit.bytes for o in out] == [722_048, 0]  # type: ignore[union-attr]
    assert store.balance(w).pending_nano_kvr == 14_000_000
    books = store.books()
    assert books.balanced, books.problems
    assert books.pool_balance_nano == -14_000_000 and books.credits == 3 and books.entries == 6


def test_replays_reorders_conflicts_and_wallet_changes_credit_nothing(store: LedgerStore) -> None:
    w, other = Wallet.generate().address, Wallet.generate().address
    r1, r2, r3 = (receipt(HUB, "s", w, i, 1000 * i) for i in (1, 2, 3))
    assert statuses(store.submit([r1, r3], TRUSTED, RATE)) == [CREDITED, CREDITED]
    out = store.submit([
        r1, r3,  # replays
        r2,  # older seq, never credited
        receipt(HUB, "s", w, 4, 2999),  # newer seq, lower count
        receipt(HUB, "s", w, 3, 3001),  # seq 3 again with another count
        receipt(HUB, "s", other, 5, 9000),  # the session belongs to w
        receipt(Wallet.generate(), "s", w, 5, 9000),  # an untrusted hub
    ], TRUSTED, RATE)
    assert statuses(out) == [DUPLICATE, DUPLICATE, STALE, STALE, REJECTED, REJECTED, REJECTED]
    assert [o.reason for o in out[4:]] == [
        ledger_pb2.REJECT_REASON_CONFLICT, ledger_pb2.REJECT_REASON_WALLET_MISMATCH,
        ledger_pb2.REJECT_REASON_UNTRUSTED_KEY,
    ]
    assert out[0].credit is not None and out[0].credit.seq == 1 and out[0].credit.nano_kvr == 7000
    assert all(o.detail for o in out)
    assert store.balance(w).pending_nano_kvr == 3000 * RATE and store.balance(other).pending_nano_kvr == 0
    # The same session id at another hub is another session.
    assert statuses(store.submit([receipt(HUB2, "s", other, 1, 10)], TRUSTED, RATE)) == [CREDITED]
    assert store.books().balanced


def test_a_quarantined_receipt_credits_its_delta_then_closes_the_session(db_url: str) -> None:
    w = Wallet.generate().address
    closing = receipt(HUB, "q", w, 2, 1500, quarantined=True)
    with open_store(db_url) as store:
        assert statuses(store.submit([receipt(HUB, "q", w, 1, 1000)], TRUSTED, RATE)) == [CREDITED]
        out = store.submit([closing], TRUSTED, RATE)
        assert statuses(out) == [CREDITED]
        assert out[0].credit is not None and out[0].credit.quarantined and out[0].credit.bytes == 500
        assert out[0].to_proto().credit.quarantined
        out = store.submit([
            receipt(HUB, "q", w, 3, 2000),  # later work: never paid
            closing,  # a replay of the closing receipt
            receipt(HUB, "q", w, 2, 1500),  # seq 2 again, not closing: another statement
            receipt(HUB, "q", w, 4, 9000, quarantined=True),  # closing twice earns nothing either
        ], TRUSTED, RATE)
        assert statuses(out) == [REJECTED, DUPLICATE, REJECTED, REJECTED]
        assert [o.reason for o in out] == [
            ledger_pb2.REJECT_REASON_SESSION_QUARANTINED, 0, ledger_pb2.REJECT_REASON_CONFLICT,
            ledger_pb2.REJECT_REASON_SESSION_QUARANTINED,
        ]
        assert "quarantined" in out[0].detail and "seq 2" in out[0].detail and "stop issuing" in out[0].detail
        assert out[1].credit is not None and out[1].credit.quarantined and out[1].credit.seq == 2
        # In one batch: the closing receipt is credited, what follows it is not.
        out = store.submit([receipt(HUB, "q2", w, 1, 100), receipt(HUB, "q2", w, 2, 300, quarantined=True),
                            receipt(HUB, "q2", w, 3, 700), receipt(HUB2, "q", w, 1, 50)], TRUSTED, RATE)
        assert statuses(out) == [CREDITED, CREDITED, REJECTED, CREDITED]  # HUB2's "q" is another session
        assert store.balance(w).pending_nano_kvr == (1500 + 300 + 50) * RATE
        assert [c.quarantined for c in store.list_credits(w)] == [False, True, False, True, False]
        books = store.books()
        assert books.balanced, books.problems
    with open_store(db_url) as store:  # the marker is in the database, not in the process
        assert store.submit([receipt(HUB, "q", w, 5, 9999)], TRUSTED, RATE)[0].reason == (
            ledger_pb2.REJECT_REASON_SESSION_QUARANTINED)
        # The audit sees a marker that no credit explains.
        store._transaction(lambda cur: cur.execute(
            "UPDATE sessions SET quarantined = TRUE WHERE session_id = 'q' AND hub_key = '%s'" % HUB2.address),
            write=True)
        books = store.books()
        assert not books.balanced and any("quarantined=True but 0 closing credits" in p for p in books.problems)


def test_a_version_1_database_is_migrated_and_keeps_its_credits(db_url: str) -> None:
    w = Wallet.generate().address
    with open_store(db_url) as store:
        assert statuses(store.submit([receipt(HUB, "old", w, 1, 1000)], TRUSTED, RATE)) == [CREDITED]

        def make_version_1(cur) -> None:  # type: ignore[no-untyped-def]
            # Exactly what a version-1 ledger made: no quarantine columns.
            cur.execute("ALTER TABLE credits DROP COLUMN quarantined")
            cur.execute("ALTER TABLE sessions DROP COLUMN quarantined")
            cur.execute("UPDATE ledger_meta SET value = '1' WHERE name = 'schema_version'")

        store._transaction(make_version_1, write=True)
        assert "quarantined" not in store._transaction(lambda cur: store.dialect.columns(cur, "sessions"), write=False)
    with open_store(db_url) as store:
        assert store._transaction(lambda cur: store.dialect.columns(cur, "credits"), write=False) >= {"quarantined"}
        out = store.submit([receipt(HUB, "old", w, 1, 1000), receipt(HUB, "old", w, 2, 1200, quarantined=True),
                            receipt(HUB, "old", w, 3, 5000)], TRUSTED, RATE)
        assert statuses(out) == [DUPLICATE, CREDITED, REJECTED]
        assert out[0].credit is not None and not out[0].credit.quarantined
        assert store.balance(w).pending_nano_kvr == 1200 * RATE
        assert store.books().balanced
    with open_store(db_url) as store:  # opening a migrated database again changes nothing
        assert store.books().balanced and store.books().credits == 2
        version = store._transaction(lambda cur: (cur.execute(
            "SELECT value FROM ledger_meta WHERE name = 'schema_version'"), cur.fetchone()[0])[1], write=False)
        assert version == "2"


def test_one_bad_receipt_never_fails_the_batch(store: LedgerStore) -> None:
    w = Wallet.generate().address
    good = receipt(HUB, "s", w, 1, 500)
    forged = receipt(HUB, "s", w, 2, 10**9)
    forged.signature = bytes([forged.signature[0] ^ 1]) + forged.signature[1:]
    garbage = ledger_pb2.SignedReceipt(receipt=b"\xff" * 40, signature=b"\x00" * 64)
    out = store.submit([garbage, good, forged, ledger_pb2.SignedReceipt()], TRUSTED, RATE)
    assert statuses(out) == [REJECTED, CREDITED, REJECTED, REJECTED]
    assert [o.reason for o in out] == [
        ledger_pb2.REJECT_REASON_MALFORMED, 0, ledger_pb2.REJECT_REASON_BAD_SIGNATURE,
        ledger_pb2.REJECT_REASON_BAD_SIGNATURE,
    ]
    assert store.balance(w).pending_nano_kvr == 3500


def test_books_sum_to_zero_across_wallets_and_survive_reopen(db_url: str) -> None:
    rng = random.Random(5)
    wallets = [Wallet.generate().address for _ in range(4)]
    expected = dict.fromkeys(wallets, 0)
    with open_store(db_url) as store:
        for s in range(8):
            w = wallets[s % 4]
            cum = 0
            batch = []
            for seq in range(1, 6):
                cum += rng.randrange(0, 100_000)
                batch.append(receipt(HUB if s % 2 else HUB2, f"s{s}", w, seq, cum))
            expected[w] += cum
            assert set(statuses(store.submit(batch, TRUSTED, RATE))) == {CREDITED}
        first = store.books()
    with open_store(db_url) as store:
        assert store.books() == first and first.balanced, first.problems
        assert first.credited_bytes == sum(expected.values())
        for w, nbytes in expected.items():
            assert store.balance(w).pending_nano_kvr == nbytes * RATE
        assert [c.seq for c in store.list_credits(wallets[0], limit=3)] == [1, 2, 3]
        page = store.list_credits(wallets[0], limit=100)
        assert len(page) == 10 and page == sorted(page, key=lambda c: c.credit_id)
        assert store.list_credits(wallets[0], after_id=page[-1].credit_id) == []


def test_concurrent_hubs_and_racing_resubmissions_credit_once(store: LedgerStore) -> None:
    """Four hubs at once, each batch sent twice by two threads in parallel: every receipt is
    credited exactly once, whichever transaction wins."""
    hubs = [Wallet.generate() for _ in range(4)]
    trusted = frozenset(h.address for h in hubs)
    wallets = [Wallet.generate().address for _ in range(3)]
    shared_wallet = wallets[0]  # every hub pays this one: contention on its account row
    plans = []
    for h in hubs:
        batches = []
        for b in range(6):
            batches.append([receipt(h, f"sess{s}", shared_wallet if s == 0 else wallets[1 + hubs.index(h) % 2],
                                    b + 1, (b + 1) * 1000 + s) for s in range(3)])
        plans.append(batches)
    results: list[list[int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(batches: list[list[ledger_pb2.SignedReceipt]]) -> None:
        try:
            for batch in batches:
                out = store.submit(batch, trusted, RATE)
                with lock:
                    results.append(statuses(out))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in plans for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    flat = [s for r in results for s in r]
    assert flat.count(CREDITED) == 4 * 6 * 3 and set(flat) <= {CREDITED, DUPLICATE}
    books = store.books()
    assert books.balanced, books.problems
    assert books.credits == 72
    assert store.balance(shared_wallet).pending_nano_kvr == 4 * 6000 * RATE


def test_newer_schema_and_bad_urls_are_refused(tmp_path: pathlib.Path) -> None:
    url = f"sqlite:///{tmp_path / 'l.db'}"
    open_store(url).close()
    import sqlite3

    with sqlite3.connect(tmp_path / "l.db") as conn:
        conn.execute("UPDATE ledger_meta SET value = '99' WHERE name = 'schema_version'")
    with pytest.raises(StoreError, match="schema 99"):
        open_store(url)
    for bad in ("sqlite://", "sqlite:///:memory:", "mysql://x", "ledger.db"):
        with pytest.raises(StoreError):
            open_store(bad)


def test_sqlite_write_lock_held_elsewhere_answers_unavailable(tmp_path: pathlib.Path) -> None:
    import sqlite3

    from ledger._sqlite import SqliteDialect

    path = tmp_path / "l.db"
    store = LedgerStore(SqliteDialect(path, busy_timeout_s=0.2))
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreUnavailable, match="locked"):
            store.submit([receipt(HUB, "s", HUB2.address, 1, 1)], TRUSTED, RATE)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert statuses(store.submit([receipt(HUB, "s", HUB2.address, 1, 1)], TRUSTED, RATE)) == [CREDITED]
    store.close()


@pytest.mark.integration
def test_postgres_dropped_connections_are_replaced(pg_cluster: PgCluster) -> None:
    url = pg_cluster.new_database()
    w = Wallet.generate().address
    with open_store(url) as store:
        assert statuses(store.submit([receipt(HUB, "s", w, 1, 10)], TRUSTED, RATE)) == [CREDITED]
        db = url.rsplit("/", 1)[1]
        pg_cluster.admin(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{db}'")
        assert statuses(store.submit([receipt(HUB, "s", w, 2, 20)], TRUSTED, RATE)) == [CREDITED]
        assert store.balance(w).pending_nano_kvr == 140


@pytest.mark.integration
def test_ledger_starts_without_torch_or_psycopg_until_asked() -> None:
    # The ledger runs on small machines: it must not pull torch, nor psycopg for SQLite.
    code = "import sys, ledger, ledger.__main__, ledger._bench; print('torch' in sys.modules, 'psycopg' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "False False", out.stderr


def test_unreachable_postgres_is_unavailable() -> None:
    with pytest.raises(StoreUnavailable, match="cannot connect"):
        open_store(f"postgresql://postgres@127.0.0.1:{_free_port()}/nothing")


def test_bench_receipts_measures_credited_receipts(db_url: str) -> None:
    from ledger._bench import bench_receipts

    assert bench_receipts(db_url, 120, batch_size=40, submitters=2) > 0
    with open_store(db_url) as store:
        books = store.books()
        assert books.credits == 120 and books.balanced, books.problems


# -- the gRPC service, in-process ---------------------------------------------------------


@pytest.fixture
def service(tmp_path: pathlib.Path) -> Iterator[tuple[ledger_pb2_grpc.LedgerServiceStub, LedgerStore]]:
    with open_store(f"sqlite:///{tmp_path / 'ledger.db'}") as store:
        server, port = create_server("127.0.0.1:0", store, TRUSTED, RATE)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                grpc.channel_ready_future(channel).result(timeout=10)
                yield ledger_pb2_grpc.LedgerServiceStub(channel), store
        finally:
            server.stop(None)


@pytest.mark.integration
def test_service_balance_units_and_paging(service) -> None:  # type: ignore[no-untyped-def]
    stub, _ = service
    w = Wallet.generate().address
    batch = [receipt(HUB, "s1-abc", w, seq, seq * 255_590 + (seq == 5) * 2) for seq in range(1, 6)]
    resp = stub.SubmitReceipts(ledger_pb2.SubmitReceiptsRequest(receipts=batch), timeout=10)
    assert [r.status for r in resp.results] == [CREDITED] * 5
    assert resp.results[0].credit.wallet == w and resp.results[0].credit.rate_nano_per_byte == RATE
    bal = stub.GetBalance(ledger_pb2.GetBalanceRequest(wallet=w), timeout=10)
    assert bal.bytes_credited == 1_277_952 and bal.pending_nano_kvr == 8_945_664
    assert (bal.pending_kvr, bal.units, bal.credit_count) == ("0.008945664", "1.277952", 5)
    seen, token = [], ""
    for _ in range(5):
        page = stub.ListCredits(ledger_pb2.ListCreditsRequest(wallet=w, page_size=2, page_token=token), timeout=10)
        seen += [c.seq for c in page.credits]
        token = page.next_page_token
        if not token:
            break
    assert seen == [1, 2, 3, 4, 5]
    unknown = stub.GetBalance(ledger_pb2.GetBalanceRequest(wallet="0" * 64), timeout=10)
    assert (unknown.pending_nano_kvr, unknown.pending_kvr, unknown.units) == (0, "0.000000000", "0.000000")


@pytest.mark.integration
@pytest.mark.parametrize(
    ("call", "request_", "code"),
    [
        ("GetBalance", ledger_pb2.GetBalanceRequest(wallet="ABC"), grpc.StatusCode.INVALID_ARGUMENT),
        ("GetBalance", ledger_pb2.GetBalanceRequest(wallet="A" * 64), grpc.StatusCode.INVALID_ARGUMENT),
        ("GetBalance", ledger_pb2.GetBalanceRequest(), grpc.StatusCode.INVALID_ARGUMENT),
        ("ListCredits", ledger_pb2.ListCreditsRequest(wallet="x" * 5000), grpc.StatusCode.INVALID_ARGUMENT),
        ("ListCredits", ledger_pb2.ListCreditsRequest(wallet="0" * 64, page_size=-1), grpc.StatusCode.INVALID_ARGUMENT),
        ("ListCredits", ledger_pb2.ListCreditsRequest(wallet="0" * 64, page_token="nope"),
         grpc.StatusCode.INVALID_ARGUMENT),
        ("SubmitReceipts", ledger_pb2.SubmitReceiptsRequest(receipts=[ledger_pb2.SignedReceipt()] * 1001),
         grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_service_answers_bad_requests_precisely(service, call, request_, code) -> None:  # type: ignore[no-untyped-def]
    stub, _ = service
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, call)(request_, timeout=10)
    assert info.value.code() == code and info.value.details()
    assert len(info.value.details()) < 300  # a stranger's 5000 characters are not echoed back


@pytest.mark.integration
def test_service_answers_a_closed_session_with_its_reason(service) -> None:  # type: ignore[no-untyped-def]
    stub, _ = service
    w = Wallet.generate().address
    batch = [receipt(HUB, "s", w, 1, 10), receipt(HUB, "s", w, 2, 20, quarantined=True), receipt(HUB, "s", w, 3, 30)]
    resp = stub.SubmitReceipts(ledger_pb2.SubmitReceiptsRequest(receipts=batch), timeout=10)
    assert [r.status for r in resp.results] == [CREDITED, CREDITED, REJECTED]
    assert resp.results[1].credit.quarantined and not resp.results[0].credit.quarantined
    assert resp.results[2].reason == ledger_pb2.REJECT_REASON_SESSION_QUARANTINED and resp.results[2].detail
    listed = stub.ListCredits(ledger_pb2.ListCreditsRequest(wallet=w), timeout=10)
    assert [c.quarantined for c in listed.credits] == [False, True]


@pytest.mark.integration
def test_service_page_token_is_bound_to_its_wallet(service) -> None:  # type: ignore[no-untyped-def]
    stub, _ = service
    w = Wallet.generate().address
    stub.SubmitReceipts(ledger_pb2.SubmitReceiptsRequest(receipts=[receipt(HUB, "s", w, i, i) for i in (1, 2)]),
                        timeout=10)
    token = stub.ListCredits(ledger_pb2.ListCreditsRequest(wallet=w, page_size=1), timeout=10).next_page_token
    assert token
    with pytest.raises(grpc.RpcError) as info:
        stub.ListCredits(ledger_pb2.ListCreditsRequest(wallet="0" * 64, page_token=token), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.integration
def test_service_database_trouble_is_unavailable_not_unknown(tmp_path: pathlib.Path) -> None:
    import sqlite3

    from ledger._sqlite import SqliteDialect

    path = tmp_path / "l.db"
    store = LedgerStore(SqliteDialect(path, busy_timeout_s=0.2))
    server, port = create_server("127.0.0.1:0", store, TRUSTED, RATE)
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ledger_pb2_grpc.LedgerServiceStub(channel)
            blocker.execute("BEGIN IMMEDIATE")
            req = ledger_pb2.SubmitReceiptsRequest(receipts=[receipt(HUB, "s", HUB2.address, 1, 1)])
            with pytest.raises(grpc.RpcError) as info:
                stub.SubmitReceipts(req, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "retry" in info.value.details()
            blocker.execute("ROLLBACK")
            assert stub.SubmitReceipts(req, timeout=10).results[0].status == CREDITED
    finally:
        blocker.close()
        server.stop(None)
        store.close()


def test_create_server_refuses_bad_configuration(tmp_path: pathlib.Path) -> None:
    with open_store(f"sqlite:///{tmp_path / 'l.db'}") as store:
        for keys, rate in (([], RATE), (["A" * 64], RATE), ([HUB.address], 0), ([HUB.address], 1001)):
            with pytest.raises(ValueError):
                create_server("127.0.0.1:0", store, keys, rate)


# -- real ledger processes -------------------------------------------------------------------


@pytest.fixture
def ledger_proc(ledger: LedgerProcess) -> LedgerProcess:
    ledger.keys = [HUB.address]
    ledger.start()
    return ledger


@pytest.mark.integration
def test_grpcurl_lists_and_calls_the_ledger_through_reflection(ledger_proc: LedgerProcess) -> None:
    grpcurl = grpcurl_path()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([grpcurl, "-plaintext", "-max-time", "10", *args], capture_output=True, text=True,
                              timeout=30, stdin=subprocess.DEVNULL)

    listed = run(ledger_proc.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert {"kvasir.v1.LedgerService", "grpc.health.v1.Health"} <= set(listed.stdout.split())
    described = run(ledger_proc.address, "describe", "kvasir.v1.LedgerService")
    assert "rpc SubmitReceipts" in described.stdout and "rpc GetBalance" in described.stdout
    w = Wallet.generate().address
    with grpc.insecure_channel(ledger_proc.address) as ch:
        stub = ledger_pb2_grpc.LedgerServiceStub(ch)
        resp = stub.SubmitReceipts(ledger_pb2.SubmitReceiptsRequest(receipts=[receipt(HUB, "s1", w, 1, 1_277_952)]),
                                   timeout=10)
        assert resp.results[0].status == CREDITED
    got = run("-d", json.dumps({"wallet": w}), ledger_proc.address, "kvasir.v1.LedgerService/GetBalance")
    assert got.returncode == 0, got.stderr
    balance = json.loads(got.stdout)
    # grpcurl prints 64-bit integers as JSON strings, as proto3's JSON mapping says.
    assert balance["pending_kvr"] == "0.008945664" and int(balance["pending_nano_kvr"]) == 8_945_664
    assert balance["units"] == "1.277952" and int(balance["bytes_credited"]) == 1_277_952
    bad = run("-d", '{"wallet": "not-a-wallet"}', ledger_proc.address, "kvasir.v1.LedgerService/GetBalance")
    assert bad.returncode != 0 and "InvalidArgument" in bad.stderr and "64 lowercase hex" in bad.stderr
    health = run("-d", '{"service": "kvasir.v1.LedgerService"}', ledger_proc.address, "grpc.health.v1.Health/Check")
    assert json.loads(health.stdout)["status"] == "SERVING"


@pytest.mark.integration
def test_ledger_cli_refuses_bad_arguments_and_stops_on_sigterm(ledger_proc: LedgerProcess, tmp_path: pathlib.Path) -> None:
    for args, message in (
        (["--trust-key", "A" * 64], "64 lowercase hex"),
        ([], "--trust-key"),
        (["--trust-key", HUB.address, "--rate-nano-per-byte", "0"], "1 to 1000"),
    ):
        out = subprocess.run([sys.executable, "-m", "ledger", "serve", "--db", f"sqlite:///{tmp_path / 'x.db'}", *args],
                             capture_output=True, text=True, timeout=30, cwd=ROOT, stdin=subprocess.DEVNULL)
        assert out.returncode == 2 and message in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "ledger", "serve", "--db", "mysql://x", "--trust-key", HUB.address],
                         capture_output=True, text=True, timeout=30, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and "unsupported database URL" in out.stderr
    assert ledger_proc.stop(signal.SIGTERM) == 0
    assert "ledger stopped" in ledger_proc.log()


def _storm_plan(hubs: list[Wallet], sessions: int, receipts: int, rng: random.Random):  # type: ignore[no-untyped-def]
    """Per hub: batches of signed receipts (sessions interleaved, seq rising), and the bytes
    each wallet is owed in the end."""
    owed: dict[str, int] = {}
    plans = []
    for h in hubs:
        per_session = []
        for s in range(sessions):
            wallet = Wallet.generate().address
            cum = 0
            rs = []
            for seq in range(1, receipts + 1):
                cum += rng.randrange(1, 200_000)
                rs.append(receipt(h, f"s{s}-{h.address[:6]}", wallet, seq, cum))
            owed[wallet] = cum
            per_session.append(rs)
        flat = [r for group in zip(*per_session) for r in group]
        batches = []
        while flat:
            n = rng.randrange(1, 9)
            batches.append(flat[:n])
            flat = flat[n:]
        plans.append(batches)
    return plans, owed


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_sigkill_mid_storm_loses_and_doubles_nothing(kind: str, tmp_path: pathlib.Path,
                                                     request: pytest.FixtureRequest) -> None:
    db = (f"sqlite:///{tmp_path / 'ledger.db'}" if kind == "sqlite"
          else request.getfixturevalue("pg_cluster").new_database())
    rng = random.Random(11)
    hubs = [Wallet.generate() for _ in range(3)]
    plans, owed = _storm_plan(hubs, sessions=6, receipts=40, rng=rng)
    total = 3 * 6 * 40
    ledger = LedgerProcess(tmp_path, db, [h.address for h in hubs])
    ledger.start()
    target = {"address": ledger.address}
    lock = threading.Lock()
    acked: dict[tuple[str, str, int], int] = {}
    retries = [0]
    errors: list[BaseException] = []
    deadline = time.monotonic() + 90

    def submitter(batches: list[list[ledger_pb2.SignedReceipt]]) -> None:
        address, channel = "", None
        try:
            for batch in batches:
                req = ledger_pb2.SubmitReceiptsRequest(receipts=batch)
                while True:  # retry this batch until acknowledged, as a hub does
                    if time.monotonic() > deadline:
                        raise TimeoutError("storm did not finish in time")
                    if target["address"] != address:
                        if channel is not None:
                            channel.close()
                        address = target["address"]
                        channel = grpc.insecure_channel(address)
                    stub = ledger_pb2_grpc.LedgerServiceStub(channel)
                    try:
                        resp = stub.SubmitReceipts(req, timeout=2)
                    except grpc.RpcError as exc:
                        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc
                        with lock:
                            retries[0] += 1
                        time.sleep(0.02)
                        continue
                    with lock:
                        for signed, result in zip(batch, resp.results):
                            r = ledger_pb2.ByteReceipt.FromString(signed.receipt)
                            acked[(r.hub_key, r.session_id, r.seq)] = result.status
                    break
        except BaseException as exc:
            errors.append(exc)
        finally:
            if channel is not None:
                channel.close()

    threads = [threading.Thread(target=submitter, args=(p,), daemon=True) for p in plans]
    for t in threads:
        t.start()
    wait_until = time.monotonic() + 30
    while len(acked) < total // 4 and time.monotonic() < wait_until and not errors:
        time.sleep(0.001)
    assert ledger.stop(signal.SIGKILL) == -signal.SIGKILL
    with lock:
        before_kill = dict(acked)
    assert 0 < len(before_kill) < total, "the kill must land mid-storm"

    # Every acknowledged receipt is in the books already, once; nothing else is half-done.
    with open_store(db) as store:
        books = store.books()
        assert books.balanced, books.problems
        credited = {(c.hub_key, c.session_id, c.seq)
                    for w in owed for c in store.list_credits(w, limit=1000)}
        assert len(credited) == books.credits
        assert set(before_kill) <= credited

    ledger.start()
    target["address"] = ledger.address
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()))
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    assert ledger.stop(signal.SIGTERM) == 0, ledger.log()
    assert set(acked.values()) <= {CREDITED, DUPLICATE} and len(acked) == total
    assert retries[0] > 0, "the kill must have interrupted submitters"
    print(f"acknowledged before the kill: {len(before_kill)}/{total}, retried calls: {retries[0]}, "
          f"duplicates: {list(acked.values()).count(DUPLICATE)}")

    with open_store(db) as store:
        books = store.books()
        assert books.balanced, books.problems
        assert books.credits == total and books.credited_bytes == sum(owed.values())
        assert books.pool_balance_nano == -sum(owed.values()) * RATE
        for w, nbytes in owed.items():
            b = store.balance(w)
            assert (b.pending_nano_kvr, b.bytes_credited, b.credit_count) == (nbytes * RATE, nbytes, 40)
