"""The hub's receipt loop: every few seconds (and at once when a session ends) save the raw
counters, sign receipts for the work that grew, and deliver pending receipts to the ledger,
retrying until it answers. At least once here; the ledger credits each byte exactly once.

A receipt the ledger refuses for a reason that can change stays pending and is sent again
with the loop's backoff: an untrusted key (the ledger's ``--trust-key`` can be fixed) or a
receipt the ledger cannot read (a ledger older than this hub). Only a receipt that can never
become valid is dropped."""

from __future__ import annotations

import grpc
import trio

from kvasir_rpc import Wallet, get_logger, ledger_pb2, ledger_pb2_grpc
from relay._contrib import ContributionStore, PendingReceipt, Settlement
from relay._registry import SessionRegistry, SessionStats

__all__ = ["ReceiptSender"]

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
}
_ANSWERED = (_R.RECEIPT_STATUS_CREDITED, _R.RECEIPT_STATUS_DUPLICATE, _R.RECEIPT_STATUS_STALE)


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
        self.submitted = 0  # receipts answered for good (acked or dropped)
        self.rejected = 0  # receipts dropped as never valid
        self.refused = 0  # refusals that left a receipt pending

    def session_ended(self, stats: SessionStats) -> None:
        """Registry hook (trio thread): save the final counters now and send a receipt soon."""
        self.store.record([stats], ended=True)
        self._wake.set()

    async def run(self) -> None:
        backoff = self.interval_s
        try:
            while True:
                with trio.move_on_after(backoff):
                    await self._wake.wait()
                self._wake = trio.Event()
                ok = await self.flush()
                backoff = self.interval_s if ok else min(backoff * 2, self.max_backoff_s)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self.flush()
            if self._channel is not None:
                self._channel.close()

    async def flush(self) -> bool:
        """Save counters, issue receipts, deliver what is pending. False when the ledger
        failed or refused a receipt for a reason that can change (back off, then retry)."""
        live = self.registry.statistics()
        await trio.to_thread.run_sync(self.store.record, live)
        await trio.to_thread.run_sync(self.store.issue_receipts, self.key)
        if not self.ledger_target:
            return True
        pending = await trio.to_thread.run_sync(self.store.pending)
        if not pending:
            return True
        try:
            results = await trio.to_thread.run_sync(self._submit, pending)
        except grpc.RpcError as exc:
            log.warning("ledger unreachable; receipts stay pending", ledger=self.ledger_target,
                        code=str(exc.code()), pending=len(pending))
            return False
        await trio.to_thread.run_sync(self.store.settle, results)
        return all(s.state != "pending" for s in results)

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
                out.append(Settlement(p, "acked", detail=_R.ReceiptStatus.Name(r.status)))
                continue
            reason = _R.RejectReason.Name(r.reason) if r.reason in _R.RejectReason.values() else str(r.reason)
            if r.status == _R.RECEIPT_STATUS_REJECTED and r.reason in _FINAL:
                self.rejected += 1
                log.error("ledger rejected a receipt for good; it is dropped", session_id=p.session_id, seq=p.seq,
                          reason=reason, why=_FINAL[r.reason], detail=r.detail)
                out.append(Settlement(p, "rejected", reason, r.detail))
            else:
                # Retryable, or an answer this hub does not know (a newer ledger): keep it.
                refused.setdefault(r.reason, []).append(r)
                out.append(Settlement(p, "pending", reason, r.detail))
        for code, results in sorted(refused.items()):
            self.refused += len(results)
            todo = _RETRYABLE.get(code, "upgrade the hub: it does not know this answer of the ledger")
            log.warning("ledger refused receipts; they stay pending and are sent again", ledger=self.ledger_target,
                        reason=_R.RejectReason.Name(code) if code in _R.RejectReason.values() else str(code),
                        receipts=len(results), todo=todo.format(hub=self.key.address), detail=results[0].detail)
        self.submitted += sum(s.state != "pending" for s in out)
        return out
