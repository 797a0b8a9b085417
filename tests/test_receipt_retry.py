"""The hub's receipts at a real ledger process: refused for an untrusted key they stay pending
and are credited exactly once when the ledger is restarted trusting the hub; a quarantined
session's closing receipt closes it at the ledger and its later work is never credited.
The hub side (ContributionStore + ReceiptSender) runs in-process under trio; every wait has
a deadline."""

from __future__ import annotations

import pathlib
import sqlite3
from collections.abc import Callable

import grpc
import pytest
import trio
from helpers import LedgerProcess
from structlog.testing import capture_logs

from kvasir_rpc import Wallet, ledger_pb2, ledger_pb2_grpc, sign_receipt
from ledger import open_store
from relay.hub._contributions import ContributionStore
from relay.hub._receipts import ReceiptSender
from relay.hub._registry import SessionRegistry

# Integration: a real ledger process and real gRPC servers.
pytestmark = pytest.mark.integration

RATE = 7
UNTRUSTED = "REJECT_REASON_UNTRUSTED_KEY"


async def until(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``predicate`` (without blocking trio) until it holds; fail naming ``what``."""
    try:
        with trio.fail_after(timeout):
            while not predicate():
                await trio.sleep(0.05)
    except trio.TooSlowError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


def balance(address: str, wallet: str) -> ledger_pb2.GetBalanceResponse:
    with grpc.insecure_channel(address) as ch:
        return ledger_pb2_grpc.LedgerServiceStub(ch).GetBalance(ledger_pb2.GetBalanceRequest(wallet=wallet), timeout=10)


def credits(address: str, wallet: str) -> list[ledger_pb2.Credit]:
    with grpc.insecure_channel(address) as ch:
        stub = ledger_pb2_grpc.LedgerServiceStub(ch)
        return list(stub.ListCredits(ledger_pb2.ListCreditsRequest(wallet=wallet), timeout=10).credits)


def test_untrusted_receipts_stay_pending_until_the_ledger_trusts_the_hub(
    tmp_path: pathlib.Path, hub_store: ContributionStore, ledger: LedgerProcess
) -> None:
    hub, wrong = Wallet.generate(), Wallet.generate()
    w1, w2 = Wallet.generate().address, Wallet.generate().address
    ledger.keys = [wrong.address]  # a typo in --trust-key
    port = ledger.start()
    hub_store.add_work("run1", "s1", 1000, 2, 8, wallet=w1, started_unix_ms=1)
    hub_store.add_work("run1", "s2", 2500, 3, 9, wallet=w2, started_unix_ms=1)
    sender = ReceiptSender(hub_store, SessionRegistry(), hub, ledger.address, interval_s=0.05, call_timeout_s=10,
                           max_backoff_s=0.4)

    def states(sid: str) -> list[tuple[str, str | None]]:
        return [(r.state, r.reason) for r in hub_store.receipts(sid)]

    async def main() -> None:
        # One flush: both receipts refused, kept, and one warning that says what to do.
        with capture_logs() as logs:
            assert await sender.flush() is False
        warnings = [e for e in logs if e["log_level"] == "warning"]
        assert len(warnings) == 1 and warnings[0]["reason"] == UNTRUSTED and warnings[0]["receipts"] == 2
        assert f"start the ledger with --trust-key {hub.address}" in warnings[0]["todo"]
        assert states("s1") == states("s2") == [("pending", UNTRUSTED)]
        stats = sender.statistics()  # what the hub's page shows of its ledger link
        assert (stats.ledger, stats.pending) == (ledger.address, 2) and stats.last_answer_unix_ms > 0
        assert stats.last_error == f"refused 2 receipts: {UNTRUSTED}"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.run)
            hub_store.add_work("run1", "s1", 1600, 3, 10)  # more work while refused: a second receipt
            await until(lambda: states("s1") == [("pending", UNTRUSTED)] * 2, "the second receipt to be refused")
            stats = sender.statistics()
            assert stats.rejected == 0 and stats.refused >= 3
            # The operator fixes --trust-key and restarts the ledger on its address.
            assert await trio.to_thread.run_sync(ledger.stop) == 0
            ledger.keys = [hub.address]
            await trio.to_thread.run_sync(lambda: ledger.start(port=port))
            await until(lambda: not hub_store.pending(), "the receipts to be credited", timeout=60)
            nursery.cancel_scope.cancel()
        assert [s for s, _ in states("s1") + states("s2")] == ["acked"] * 3
        assert await sender.flush() is True  # nothing more to send
        assert (sender.statistics().pending, sender.statistics().last_error) == (0, "")

    trio.run(main)
    for wallet, work in ((w1, 1600), (w2, 2500)):
        b = balance(ledger.address, wallet)
        assert (b.pending_nano_kvr, b.bytes_credited) == (work * RATE, work)
    assert [(c.seq, c.bytes) for c in credits(ledger.address, w1)] == [(1, 1000), (2, 600)]
    assert ledger.stop() == 0
    with open_store(ledger.db) as books_store:
        books = books_store.books()
        assert books.balanced and books.credits == 3 and books.credited_bytes == 4100, books.problems


def test_a_quarantined_session_closes_at_the_ledger_and_later_work_is_never_credited(
    tmp_path: pathlib.Path, hub_store: ContributionStore, ledger: LedgerProcess
) -> None:
    hub = Wallet.generate()
    w = Wallet.generate().address
    ledger.keys = [hub.address]
    ledger.start()
    sender = ReceiptSender(hub_store, SessionRegistry(), hub, ledger.address, call_timeout_s=10)
    hub_store.add_work("run1", "liar", 1000, 1, 4, wallet=w)
    assert trio.run(sender.flush) is True
    hub_store.add_work("run1", "liar", 1800, 2, 8)  # after its last check: forfeited
    assert hub_store.quarantine("liar", hub) == 2
    assert trio.run(sender.flush) is True
    got = credits(ledger.address, w)
    assert [(c.seq, c.cumulative_bytes, c.bytes, c.quarantined) for c in got] == [(1, 1000, 1000, False),
                                                                                (2, 1000, 0, True)]
    # The hub counts and signs nothing more for it.
    assert not hub_store.add_work("run2", "liar", 5000, 3, 9)
    assert trio.run(sender.flush) is True and hub_store.pending() == []
    # A later receipt that still reaches the ledger (an older copy of the hub's database, a
    # bug) is refused for good, and the sender drops it with the reason.
    late = sign_receipt(hub, ledger_pb2.ByteReceipt(hub_key=hub.address, session_id="liar", wallet=w, seq=3,
                                                    cumulative_bytes=1800, issued_at_unix_ms=1))
    with sqlite3.connect(hub_store.path) as db:
        db.execute("INSERT INTO receipts (session_id, seq, cumulative_bytes, signed) VALUES ('liar', 3, 1800, ?)",
                   (late.SerializeToString(),))
    with capture_logs() as logs:
        assert trio.run(sender.flush) is True
    assert [(r.seq, r.state, r.reason) for r in hub_store.receipts("liar")][-1] == (
        3, "rejected", "REJECT_REASON_SESSION_QUARANTINED")
    errors = [e for e in logs if e["log_level"] == "error"]
    assert len(errors) == 1 and "quarantined" in errors[0]["why"] and sender.statistics().rejected == 1
    b = balance(ledger.address, w)
    assert (b.pending_nano_kvr, b.bytes_credited, b.credit_count) == (1000 * RATE, 1000, 2)


class _Refusing(ledger_pb2_grpc.LedgerServiceServicer):
    """A ledger that answers every receipt REJECTED with one reason."""

    def __init__(self, reason: int) -> None:
        self.reason = reason

    def SubmitReceipts(self, request, context):  # type: ignore[no-untyped-def]
        result = ledger_pb2.ReceiptResult(status=ledger_pb2.RECEIPT_STATUS_REJECTED, reason=self.reason,
                                          detail="as told")
        return ledger_pb2.SubmitReceiptsResponse(results=[result] * len(request.receipts))


@pytest.mark.parametrize(
    ("reason", "state", "words"),
    [
        (ledger_pb2.REJECT_REASON_UNTRUSTED_KEY, "pending", "--trust-key"),
        (ledger_pb2.REJECT_REASON_MALFORMED, "pending", "older than this hub"),
        (99, "pending", "upgrade the hub"),  # a newer ledger's reason: kept, not guessed at
        (ledger_pb2.REJECT_REASON_INVALID_FIELD, "rejected", "hub bug"),
        (ledger_pb2.REJECT_REASON_BAD_SIGNATURE, "rejected", "does not verify"),
        (ledger_pb2.REJECT_REASON_WALLET_MISMATCH, "rejected", "another wallet"),
        (ledger_pb2.REJECT_REASON_CONFLICT, "rejected", "another count"),
        (ledger_pb2.REJECT_REASON_SESSION_QUARANTINED, "rejected", "quarantined"),
    ],
)
def test_only_refusals_that_can_never_change_drop_a_receipt(hub_store: ContributionStore, reason: int, state: str,
                                                            words: str) -> None:
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    ledger_pb2_grpc.add_LedgerServiceServicer_to_server(_Refusing(reason), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        for sid in ("a", "b"):
            hub_store.add_work("run1", sid, 10, 1, 1, wallet=Wallet.generate().address)
        sender = ReceiptSender(hub_store, SessionRegistry(), Wallet.generate(), f"127.0.0.1:{port}", call_timeout_s=10)
        with capture_logs() as logs:
            assert trio.run(sender.flush) is (state == "rejected")
    finally:
        server.stop(None)
    assert {(r.state, r.reason) for sid in "ab" for r in hub_store.receipts(sid)} == {
        (state, ledger_pb2.RejectReason.Name(reason) if reason != 99 else "99")}
    lines = [e for e in logs if e["log_level"] in ("warning", "error")]
    if state == "pending":  # one line for the whole flush
        assert len(lines) == 1 and lines[0]["log_level"] == "warning" and words in lines[0]["todo"]
        assert lines[0]["receipts"] == 2 and len(hub_store.pending()) == 2
    else:  # one line per dropped receipt
        assert len(lines) == 2 and all(e["log_level"] == "error" and words in e["why"] for e in lines)
        assert hub_store.pending() == []
