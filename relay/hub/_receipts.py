"""The hub's receipt loop: every few seconds (and at once when a session ends) save the raw
counters, sign receipts for the work that grew, and deliver pending receipts to the ledger,
retrying until it answers. At least once here; the ledger credits each byte exactly once.

Every database write runs in a worker thread (``trio.to_thread``), never on the hub's event
loop: a SQLite commit with full sync takes milliseconds to seconds on a busy disk, and every
tunnel of the hub would wait for it. A session that ends only queues its final counters; the
loop saves them, and ``close`` saves what is still queued once the loop has stopped.

A receipt the ledger refuses for a reason that can change stays pending and is sent again
with the loop's backoff: an untrusted key (the ledger's ``--trust-key`` can be fixed) or a
receipt the ledger cannot read (a ledger older than this hub). Only a receipt that can never
become valid is dropped.

A pass the contribution store cannot serve for now (``ContributionStoreUnavailable``: its file
locked by another program, its disk failing or full) is logged and tried again with the same
backoff; the loop lives on. Any other store error ends the loop as any error did before (and
the hub with it): waiting does not mend a damaged or foreign database."""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import trio

from kvasir_rpc import Wallet, get_logger, ledger_pb2, ledger_pb2_grpc
from relay.hub._contributions import (
    ContributionStore,
    ContributionStoreError,
    ContributionStoreUnavailable,
    PendingReceipt,
    Settlement,
)
from relay.hub._registry import SessionRegistry, SessionStats

__all__ = ["ReceiptSender", "ReceiptSenderStats"]

log = get_logger("relay.receipts")

_R = ledger_pb2

# Refusals that can change, and what a person does about each: the receipts stay pending.
_RETRYABLE: dict[int, str] = {
    _R.REJECT_REASON_UNTRUSTED_KEY: "start the ledger with --trust-key {hub}",
    _R.REJECT_REASON_MALFORMED: "upgrade the ledger: it is older than this hub and cannot read its receipts",
}
# Refusals that never change: the receipt is dropped, and why is logged.
_FINAL: dict[int, str] = {
    _R.REJECT_REASON_INVALID_FIELD: "the hub signed a field the ledger refuses (a hub bug)",
    _R.REJECT_REASON_BAD_SIGNATURE: "its signature does not verify (the hub's store or key file was altered)",
    _R.REJECT_REASON_WALLET_MISMATCH: "the ledger holds this session under another wallet",
    _R.REJECT_REASON_CONFLICT: "the ledger credited another count for this seq (was the hub's --contrib-db reset?)",
    _R.REJECT_REASON_SESSION_QUARANTINED: "the session was quarantined: it earns nothing after its closing receipt",
    _R.REJECT_REASON_LEDGER_LIMIT: "its count would take the ledger's total credited past its bound (a hub bug)",
}
_ANSWERED = (_R.RECEIPT_STATUS_CREDITED, _R.RECEIPT_STATUS_DUPLICATE, _R.RECEIPT_STATUS_STALE)
_CREDITED = _R.ReceiptStatus.Name(_R.RECEIPT_STATUS_CREDITED)
_STORE_TROUBLE = "contribution store: "


@dataclasses.dataclass(frozen=True)
class ReceiptSenderStats:
    """The receipt loop's counters since the hub started (see ``ReceiptSender.statistics``).

    ``submitted``: receipts answered for good (``acked`` + ``rejected``); ``acked``: credited,
    duplicate or stale at the ledger (nothing more to send); ``rejected``: dropped as never
    valid; ``refused``: refusals that left a receipt pending (each resend counts again);
    ``flushes``: passes of the loop; ``ledger_errors``: passes where the ledger could not be
    reached; ``store_errors``: passes the contribution store could not serve for now (tried
    again); ``ended_recorded``: final counters of ended sessions saved; ``ended_queued``:
    those waiting for the next pass."""

    submitted: int
    acked: int
    rejected: int
    refused: int
    flushes: int
    ledger_errors: int
    ended_recorded: int
    ended_queued: int
    # What the ledger credited for receipts it newly credited while this hub ran.
    credited_bytes: int = 0
    credited_nano_kvr: int = 0
    # The link to the ledger: its address (None: receipts are signed and kept), receipts
    # waiting for its answer after the last pass, when it last answered (unix ms, 0: not
    # yet) and why the last pass that failed did ("" after a good one).
    ledger: str | None = None
    pending: int = 0
    last_answer_unix_ms: int = 0
    last_error: str = ""
    store_errors: int = 0


class ReceiptSender:
    """Delivers ``store``'s receipts signed with ``key`` to the LedgerService at
    ``ledger_target`` (none: receipts are signed and kept). ``run`` is the loop: a flush every
    ``interval_s``, backing off to ``max_backoff_s`` while the ledger fails or refuses
    receipts for a reason that can change."""

    def __init__(self, store: ContributionStore, registry: SessionRegistry, key: Wallet,
                 ledger_target: str | None, *, interval_s: float = 2.0, call_timeout_s: float = 10.0,
                 max_backoff_s: float = 30.0) -> None:
        self.store = store
        self.registry = registry
        self.key = key
        self.ledger_target = ledger_target
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self.max_backoff_s = max_backoff_s
        self._wake = trio.Event()
        self._channel: grpc.Channel | None = None
        # Final counters of ended sessions, saved by the next flush (or ``close``), once each.
        self._ended: list[SessionStats] = []
        self._ended_lock = threading.Lock()
        self._acked = 0
        self._rejected = 0
        self._refused = 0
        self._flushes = 0
        self._ledger_errors = 0
        self._store_errors = 0
        self._ended_recorded = 0
        self._credited_bytes = 0
        self._credited_nano_kvr = 0
        self._pending = 0
        self._last_answer_ms = 0
        self._last_error = ""

    def statistics(self) -> ReceiptSenderStats:
        """A frozen snapshot of the loop's counters."""
        with self._ended_lock:
            queued = len(self._ended)
        return ReceiptSenderStats(submitted=self._acked + self._rejected, acked=self._acked, rejected=self._rejected,
                                  refused=self._refused, flushes=self._flushes, ledger_errors=self._ledger_errors,
                                  ended_recorded=self._ended_recorded, ended_queued=queued,
                                  credited_bytes=self._credited_bytes, credited_nano_kvr=self._credited_nano_kvr,
                                  ledger=self.ledger_target, pending=self._pending,
                                  last_answer_unix_ms=self._last_answer_ms, last_error=self._last_error,
                                  store_errors=self._store_errors)

    def session_ended(self, stats: SessionStats) -> None:
        """Registry hook (trio thread): queue the session's final counters and wake the loop,
        which saves them in a worker thread and sends a receipt soon. Never touches the
        database here: this runs on the hub's event loop."""
        with self._ended_lock:
            self._ended.append(stats)
        self._wake.set()

    def close(self) -> None:
        """After ``run`` has returned (no event loop needed): save the final counters of
        sessions that ended after the loop's last flush, and close the ledger channel. A store
        that cannot save them is logged: raw counters are for display, receipts pay work."""
        try:
            self._record_ended(self._take_ended())
        except ContributionStoreError as exc:
            log.error("final counters of ended sessions not saved", error=str(exc))
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _take_ended(self) -> list[SessionStats]:
        with self._ended_lock:
            ended, self._ended = self._ended, []
        return ended

    def _record_ended(self, ended: list[SessionStats]) -> None:
        """Save ``ended`` (any thread but the event loop's). On failure they go back in the
        queue, ahead of later ones, so the next flush tries again."""
        if not ended:
            return
        try:
            self.store.record(ended, ended=True)
        except BaseException:
            with self._ended_lock:
                self._ended[:0] = ended
            raise
        self._ended_recorded += len(ended)

    async def run(self) -> None:
        backoff = self.interval_s
        try:
            while True:
                with trio.move_on_after(backoff):
                    await self._wake.wait()
                self._wake = trio.Event()
                try:
                    ok = await self.flush()
                except ContributionStoreUnavailable as exc:
                    # Locked by another program, a failing or full disk: it may pass. What the
                    # pass did not save is saved by a later one (ended sessions stay queued).
                    self._store_errors += 1
                    self._last_error = f"{_STORE_TROUBLE}{exc}"[:300]
                    log.warning("contribution store unavailable; the pass is tried again", error=str(exc),
                                retry_in_s=min(backoff * 2, self.max_backoff_s))
                    ok = False
                else:
                    if self._last_error.startswith(_STORE_TROUBLE):
                        self._last_error = ""  # the store answers again
                backoff = self.interval_s if ok else min(backoff * 2, self.max_backoff_s)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                try:
                    await self.flush()
                except ContributionStoreError as exc:
                    log.error("last pass of the receipt loop failed; the next start sends what is pending",
                              error=str(exc))
            if self._channel is not None:
                self._channel.close()
                self._channel = None

    async def flush(self) -> bool:
        """Save counters, issue receipts, deliver what is pending. False when the ledger
        failed or refused a receipt for a reason that can change (back off, then retry)."""
        self._flushes += 1
        live = self.registry.statistics()
        await trio.to_thread.run_sync(self.store.record, live)
        # Not cancellable once started (to_thread's default): a batch is saved whole, once.
        await trio.to_thread.run_sync(self._record_ended, self._take_ended())
        await trio.to_thread.run_sync(self.store.issue_receipts, self.key)
        self._pending = await trio.to_thread.run_sync(self.store.pending_count)
        if not self.ledger_target:
            return True
        pending = await trio.to_thread.run_sync(self.store.pending)
        if not pending:
            return True
        try:
            results = await trio.to_thread.run_sync(self._submit, pending)
        except grpc.RpcError as exc:
            self._ledger_errors += 1
            self._last_error = f"{exc.code()}: {exc.details()}"[:300]
            log.warning("ledger unreachable; receipts stay pending", ledger=self.ledger_target,
                        code=str(exc.code()), pending=len(pending))
            return False
        # Counted on the event loop's thread (never in ``_submit``'s worker thread), before the
        # store shows the answers, so whoever sees a settled receipt sees it counted.
        kept = [s for s in results if s.state == "pending"]
        self._acked += sum(s.state == "acked" for s in results)
        self._rejected += sum(s.state == "rejected" for s in results)
        self._refused += len(kept)
        for s in results:
            if s.credit is None:
                continue
            if s.detail == _CREDITED:
                self._credited_bytes += s.credit.bytes
                self._credited_nano_kvr += s.credit.nano_kvr
            self.registry.credit(s.receipt.session_id, s.credit.seq, s.credit.cumulative_bytes, s.credit.nano_kvr)
        await trio.to_thread.run_sync(self.store.settle, results)
        self._last_answer_ms = time.time_ns() // 1_000_000
        self._last_error = f"refused {len(kept)} receipts: {kept[0].reason}" if kept else ""
        self._pending -= len(results) - len(kept)  # what the ledger answered for good left the store's pending
        return not kept

    def _submit(self, pending: list[PendingReceipt]) -> list[Settlement]:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.ledger_target)  # type: ignore[arg-type]
        stub = ledger_pb2_grpc.LedgerServiceStub(self._channel)
        req = _R.SubmitReceiptsRequest(receipts=[_R.SignedReceipt.FromString(p.signed) for p in pending])
        resp = stub.SubmitReceipts(req, timeout=self.call_timeout_s)
        out = []
        refused: dict[int, list[ledger_pb2.ReceiptResult]] = {}
        for p, r in zip(pending, resp.results, strict=True):
            if r.status in _ANSWERED:
                out.append(Settlement(p, "acked", detail=_R.ReceiptStatus.Name(r.status),
                                      credit=r.credit if r.HasField("credit") else None))
                continue
            reason = _R.RejectReason.Name(r.reason) if r.reason in _R.RejectReason.values() else str(r.reason)
            if r.status == _R.RECEIPT_STATUS_REJECTED and r.reason in _FINAL:
                log.error("ledger rejected a receipt for good; it is dropped", session_id=p.session_id, seq=p.seq,
                          reason=reason, why=_FINAL[r.reason], detail=r.detail)
                out.append(Settlement(p, "rejected", reason, r.detail))
            else:
                # Retryable, or an answer this hub does not know (a newer ledger): keep it.
                refused.setdefault(r.reason, []).append(r)
                out.append(Settlement(p, "pending", reason, r.detail))
        for code, results in sorted(refused.items()):
            todo = _RETRYABLE.get(code, "upgrade the hub: it does not know this answer of the ledger")
            log.warning("ledger refused receipts; they stay pending and are sent again", ledger=self.ledger_target,
                        reason=_R.RejectReason.Name(code) if code in _R.RejectReason.values() else str(code),
                        receipts=len(results), todo=todo.format(hub=self.key.address), detail=results[0].detail)
        return out
