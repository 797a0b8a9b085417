"""The hub's receipt loop: every few seconds (and at once when a session ends) save the byte
counters, sign receipts for what grew, and deliver pending receipts to the ledger, retrying
until it answers. At least once here; the ledger credits each byte exactly once."""

from __future__ import annotations

import grpc
import trio

from kvasir_rpc import Wallet, get_logger
from relay._contrib import ContributionStore, PendingReceipt
from relay._registry import SessionRegistry

__all__ = ["ReceiptSender"]

log = get_logger("relay.receipts")


class ReceiptSender:
    def __init__(self, store: ContributionStore, registry: SessionRegistry, key: Wallet,
                 ledger_target: str | None, *, interval_s: float = 2.0, call_timeout_s: float = 10.0) -> None:
        self.store = store
        self.registry = registry
        self.key = key
        self.ledger_target = ledger_target
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self._wake = trio.Event()
        self._channel: grpc.Channel | None = None
        self.submitted = 0
        self.rejected = 0

    def session_ended(self, stats) -> None:  # type: ignore[no-untyped-def]
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
                backoff = self.interval_s if ok else min(backoff * 2, 30.0)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self.flush()
            if self._channel is not None:
                self._channel.close()

    async def flush(self) -> bool:
        """Save counters, issue receipts, deliver what is pending. False if the ledger failed."""
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
        return True

    def _submit(self, pending: list[PendingReceipt]) -> list[tuple[PendingReceipt, str, str]]:
        from kvasir_rpc._gen.kvasir.v1 import ledger_pb2, ledger_pb2_grpc

        if self._channel is None:
            self._channel = grpc.insecure_channel(self.ledger_target)  # type: ignore[arg-type]
        stub = ledger_pb2_grpc.LedgerServiceStub(self._channel)
        req = ledger_pb2.SubmitReceiptsRequest(
            receipts=[ledger_pb2.SignedReceipt.FromString(p.signed) for p in pending]
        )
        resp = stub.SubmitReceipts(req, timeout=self.call_timeout_s)
        out = []
        for p, r in zip(pending, resp.results, strict=True):
            if r.status == ledger_pb2.RECEIPT_STATUS_REJECTED:
                self.rejected += 1
                log.error("ledger rejected a receipt", session_id=p.session_id, seq=p.seq,
                          reason=ledger_pb2.RejectReason.Name(r.reason), detail=r.detail)
                out.append((p, "rejected", r.detail))
            elif r.status in (ledger_pb2.RECEIPT_STATUS_CREDITED, ledger_pb2.RECEIPT_STATUS_DUPLICATE,
                              ledger_pb2.RECEIPT_STATUS_STALE):
                out.append((p, "acked", ledger_pb2.ReceiptStatus.Name(r.status)))
        self.submitted += len(out)
        return out
