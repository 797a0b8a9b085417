"""The ledger's Prometheus metrics (``kvasir_ledger_*``): receipts by outcome and credits from
``LedgerStore.statistics()`` (this process's counters), rejections by reason and the
SubmitReceipts latency from the service, the number of wallets from the database."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from kvasir_rpc import StatsCollector, counter_family, gauge_family, latency_histogram, ledger_pb2
from ledger._store import LedgerStore, Outcome, StoreError

__all__ = ["LedgerMetrics"]


class LedgerMetrics:
    """The ledger's registry (``registry``) over ``store``; ``submitted`` is called by the
    service after each SubmitReceipts. Thread-safe."""

    def __init__(self, store: LedgerStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._rejected: dict[str, int] = {}
        self.registry = CollectorRegistry()
        self._submit_seconds = latency_histogram(
            "kvasir_ledger_submit_duration_seconds", "SubmitReceipts calls answered, from arrival to answer",
            self.registry)
        self.registry.register(StatsCollector(self._families))

    def submitted(self, seconds: float, outcomes: Sequence[Outcome]) -> None:
        """One SubmitReceipts answered in ``seconds`` with ``outcomes``."""
        self._submit_seconds.observe(seconds)
        rejected = [ledger_pb2.RejectReason.Name(o.reason) for o in outcomes
                    if o.status == ledger_pb2.RECEIPT_STATUS_REJECTED]
        if rejected:
            with self._lock:
                for name in rejected:
                    reason = name.removeprefix("REJECT_REASON_").lower()
                    self._rejected[reason] = self._rejected.get(reason, 0) + 1

    def _families(self) -> Iterator[Metric]:
        s = self._store.statistics()
        yield counter_family("kvasir_ledger_batches_total", "SubmitReceipts batches processed", s.batches)
        yield counter_family(
            "kvasir_ledger_receipts_total",
            "receipts submitted, by outcome: credited, duplicate (credited before), stale (an older counter), "
            "rejected (see kvasir_ledger_receipts_rejected_total)",
            labels={("credited",): s.credited, ("duplicate",): s.duplicate, ("stale",): s.stale,
                    ("rejected",): s.rejected}, labelnames=("outcome",))
        with self._lock:
            rejected: dict[tuple[str, ...], int] = {(why,): n for why, n in self._rejected.items()}
        yield counter_family("kvasir_ledger_receipts_rejected_total", "receipts rejected, by reason",
                             labels=rejected, labelnames=("reason",))
        yield counter_family("kvasir_ledger_credited_bytes_total", "bytes of work credited", s.credited_bytes)
        yield counter_family("kvasir_ledger_credited_nano_kvr_total", "rewards credited, in nano-KVR",
                             s.credited_nano)
        try:
            wallets = self._store.wallet_count()
        except StoreError:
            return  # the database is unavailable: the gauge is left out of this scrape
        yield gauge_family("kvasir_ledger_wallets", "wallets ever credited (holding pending rewards)", wallets)
