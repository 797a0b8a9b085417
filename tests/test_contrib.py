"""The hub's contribution store: work counted per (session, run) at its maximum, receipts that
pay work only, quarantine with one closing receipt, persistent bans, and databases of an older
hub opened and brought up to date."""

from __future__ import annotations

import pathlib
import sqlite3
import threading

import pytest

from kvasir_rpc import Wallet, ledger_pb2, open_receipt
from relay.hub._admission import WalletHistory
from relay.hub._contributions import ContributionStore, Settlement
from relay.hub._registry import SessionStats

HUB = Wallet.generate()
WALLET = Wallet.generate().address


def opened(store: ContributionStore, session_id: str) -> list[ledger_pb2.ByteReceipt]:
    """The receipts of a session as the ledger would read them."""
    return [open_receipt(ledger_pb2.SignedReceipt.FromString(p.signed), {HUB.address})
            for p in store.pending() if p.session_id == session_id]


def stats(session_id: str, to_worker: int, from_worker: int) -> SessionStats:
    return SessionStats(session_id=session_id, wallet=WALLET, slices={}, weights_digest=b"", device="cpu",
                        model_type="", connected_since_unix_ms=1, bytes_to_worker=to_worker,
                        bytes_from_worker=from_worker, target="", remote_address="")


@pytest.fixture
def store(hub_store: ContributionStore) -> ContributionStore:
    return hub_store


def test_work_keeps_the_maximum_per_run_and_sums_runs(store: ContributionStore) -> None:
    assert not store.add_work("run1", "s1", 100, 1, 2)  # unknown session, no wallet: nothing counted
    assert store.work_bytes("s1") == 0
    assert store.add_work("run1", "s1", 100, 1, 2, wallet=WALLET, started_unix_ms=5)
    assert store.add_work("run1", "s1", 100, 1, 2)  # a repeated report adds nothing
    assert store.add_work("run1", "s1", 60, 1, 1)  # an older one neither
    assert store.work_bytes("s1") == 100
    assert store.add_work("run1", "s1", 250, 3, 7)
    assert store.add_work("run2", "s1", 40, 1, 1)  # another backbone run adds its own
    assert store.work_bytes("s1") == 290
    with pytest.raises(ValueError):
        store.add_work("", "s1", 1, 1, 1)
    with pytest.raises(ValueError):
        store.add_work("run1", "s1", -1, 1, 1)


def test_receipts_pay_work_not_raw_bytes(store: ContributionStore) -> None:
    store.record([stats("s1", 5000, 7000)])
    assert store.issue_receipts(HUB) == 0  # raw tunnel bytes are for display only
    assert store.add_work("run1", "s1", 300, 2, 4)  # record() made the row, with its wallet
    assert store.issue_receipts(HUB) == 1
    assert store.issue_receipts(HUB) == 0  # nothing grew
    store.add_work("run1", "s1", 300, 2, 4)
    assert store.issue_receipts(HUB) == 0
    store.add_work("run2", "s1", 20, 1, 1)
    assert store.issue_receipts(HUB) == 1
    got = opened(store, "s1")
    assert [(r.seq, r.cumulative_bytes, r.quarantined, r.wallet) for r in got] == [
        (1, 300, False, WALLET), (2, 320, False, WALLET)]


def test_quarantine_closes_with_the_last_receipted_count_once(store: ContributionStore) -> None:
    store.add_work("run1", "s1", 1000, 1, 1, wallet=WALLET)
    store.issue_receipts(HUB)
    store.add_work("run1", "s1", 1500, 2, 2)  # done after the last check: forfeited
    assert store.quarantine("s1", HUB) == 2
    assert store.quarantine("s1", HUB) == 2  # idempotent: nothing more signed
    assert [(r.seq, r.cumulative_bytes, r.quarantined) for r in opened(store, "s1")] == [
        (1, 1000, False), (2, 1000, True)]
    assert not store.add_work("run1", "s1", 9000, 3, 3)
    assert not store.add_work("run9", "s1", 9000, 3, 3, wallet=WALLET)
    assert store.work_bytes("s1") == 1500
    assert store.issue_receipts(HUB) == 0
    assert [r.quarantined for r in store.receipts("s1")] == [False, True]
    with pytest.raises(KeyError, match="unknown"):
        store.quarantine("nobody", HUB)
    # A session quarantined before any work closes at seq 1 with nothing paid.
    assert store.quarantine("s2", HUB, wallet=WALLET) == 1
    assert [(r.seq, r.cumulative_bytes, r.quarantined) for r in opened(store, "s2")] == [(1, 0, True)]
    assert not store.add_work("run1", "s2", 10, 1, 1, wallet=WALLET)


def test_bans_persist_expire_and_never_shorten(tmp_path: pathlib.Path) -> None:
    with_db = tmp_path / "hub.sqlite"
    store = ContributionStore(with_db)
    assert store.banned_until(WALLET, 0) is None
    store.ban(WALLET, 2000, "audit mismatch at layer 3")
    store.ban(WALLET, 1500, "a shorter one")
    store.close()
    store = ContributionStore(with_db)
    assert store.banned_until(WALLET, 1000) == 2000
    assert store.banned_until(WALLET, 2000) is None  # expired
    store.ban(WALLET, 3000, "again")
    assert store.banned_until(WALLET, 2500) == 3000
    with sqlite3.connect(with_db) as db:
        assert db.execute("SELECT reason FROM bans").fetchone()[0] == "again"
    store.close()


def test_a_wallets_history_is_accepted_work_of_a_clean_session_and_its_last_ban(tmp_path: pathlib.Path) -> None:
    """What the hub prices a new session by (relay.hub._admission): work the backbone accepted
    from a session not quarantined, and when the wallet was last banned; kept across restarts."""
    path = tmp_path / "hub.sqlite"
    store = ContributionStore(path)
    other = Wallet.generate().address
    assert store.wallet_history(WALLET) == WalletHistory()  # never seen
    store.record([stats("s1", 5000, 7000)])
    assert store.wallet_history(WALLET) == WalletHistory()  # a session that did no work earns nothing
    store.add_work("run1", "s1", 0, 0, 0)
    assert not store.wallet_history(WALLET).accepted_work
    store.add_work("run1", "s1", 300, 1, 2)
    assert store.wallet_history(WALLET) == WalletHistory(accepted_work=True)
    # Work from a session later quarantined does not make its wallet returning.
    store.add_work("run1", "s2", 300, 1, 2, wallet=other)
    store.quarantine("s2", HUB)
    assert not store.wallet_history(other).accepted_work
    store.ban(WALLET, 2 ** 50, "audit mismatch")
    store.close()
    store = ContributionStore(path)
    history = store.wallet_history(WALLET)
    assert history.accepted_work and history.last_quarantined_unix_ms is not None
    with sqlite3.connect(path) as db:  # the hub looks it up at every hello: by index, not a scan
        plan = " ".join(str(row) for row in db.execute(
            "EXPLAIN QUERY PLAN SELECT 1 FROM sessions WHERE wallet = ?", (WALLET,)))
    assert "sessions_wallet" in plan, plan
    store.close()
    # A store that cannot answer makes the wallet new; it never fails the hello.
    assert store.wallet_history(WALLET) == WalletHistory()


def test_settle_keeps_refusals_that_can_change_pending(store: ContributionStore) -> None:
    for sid in ("a", "b", "c"):
        store.add_work("run1", sid, 10, 1, 1, wallet=WALLET)
    store.issue_receipts(HUB)
    a, b, c = store.pending()
    store.settle([Settlement(a, "acked", detail="RECEIPT_STATUS_CREDITED"),
                  Settlement(b, "pending", "REJECT_REASON_UNTRUSTED_KEY", "hub_key x is not trusted"),
                  Settlement(c, "rejected", "REJECT_REASON_CONFLICT", "seq 1 was credited with ...")])
    assert [p.session_id for p in store.pending()] == ["b"]
    assert [(r.state, r.reason) for sid in "abc" for r in store.receipts(sid)] == [
        ("acked", None), ("pending", "REJECT_REASON_UNTRUSTED_KEY"), ("rejected", "REJECT_REASON_CONFLICT")]
    with pytest.raises(ValueError):
        store.settle([Settlement(a, "lost")])


def test_concurrent_reports_count_the_maximum(store: ContributionStore) -> None:
    store.add_work("run1", "s1", 0, 0, 0, wallet=WALLET)

    def report(start: int) -> None:
        for n in range(start, 400, 4):
            store.add_work("run1", "s1", n, n, n)

    threads = [threading.Thread(target=report, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert store.work_bytes("s1") == 399


_OLD_SCHEMA = """
CREATE TABLE sessions (
    session_id TEXT PRIMARY KEY, wallet TEXT NOT NULL, started_unix_ms INTEGER NOT NULL, ended_unix_ms INTEGER,
    bytes_to_worker INTEGER NOT NULL DEFAULT 0, bytes_from_worker INTEGER NOT NULL DEFAULT 0,
    last_seq INTEGER NOT NULL DEFAULT 0, last_receipt_bytes INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE receipts (
    session_id TEXT NOT NULL REFERENCES sessions(session_id), seq INTEGER NOT NULL,
    cumulative_bytes INTEGER NOT NULL, signed BLOB NOT NULL, state TEXT NOT NULL DEFAULT 'pending',
    detail TEXT, PRIMARY KEY (session_id, seq)
);
CREATE INDEX receipts_pending ON receipts(state) WHERE state = 'pending';
"""


def test_a_database_of_an_older_hub_opens_and_its_untrusted_receipts_are_pending_again(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "hub.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(_OLD_SCHEMA)
        db.execute("INSERT INTO sessions VALUES ('old', ?, 1, 2, 500, 700, 3, 1200)", (WALLET,))
        for seq, state, detail in ((1, "acked", "RECEIPT_STATUS_CREDITED"),
                                   (2, "rejected", f"hub_key {HUB.address} is not trusted"),
                                   (3, "rejected", "seq 3 was credited with cumulative_bytes 1, not 1200")):
            db.execute("INSERT INTO receipts VALUES ('old', ?, ?, x'00', ?, ?)", (seq, seq * 400, state, detail))
    store = ContributionStore(path)
    try:
        assert [(r.seq, r.state) for r in store.receipts("old")] == [(1, "acked"), (2, "pending"), (3, "rejected")]
        assert [p.seq for p in store.pending()] == [2]
        # The old session keeps working with the new columns: it can be quarantined at seq 4.
        assert store.quarantine("old", HUB) == 4
        assert store.receipts("old")[-1].cumulative_bytes == 1200
    finally:
        store.close()
    ContributionStore(path).close()  # opening it again changes nothing
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM receipts WHERE state = 'pending'").fetchone()[0] == 2
