"""The hub's side of paid work: the backbone's ReportWork and Quarantine calls.

Runs on the SessionService's gRPC threads. The backbone is the authority on the work it
accepted; the hub counts it per session (cumulative per backbone run, so a report sent
twice adds nothing) in its contribution store, which signs receipts for it. A quarantine
ends the session at once, issues its closing receipt (``quarantined``: the ledger credits
nothing more for it) and refuses the wallet for ``quarantine_s``.

When the store cannot answer, the backbone is told so: UNAVAILABLE, with what to retry, while
the database is locked or its disk fails (it may pass; the backbone sends the report or the
quarantine again, and neither counts twice); INTERNAL, with the store's message, for anything
else.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from kvasir_rpc import MAX_CUMULATIVE_BYTES, CloseCode, Wallet, get_logger, session_pb2
from kvasir_rpc.protocol import MAX_EXPERTS_PER_LAYER, MAX_LAYERS
from relay.hub._contributions import ContributionStore, ContributionStoreError, ContributionStoreUnavailable
from relay.hub._registry import SessionRegistry

__all__ = ["DeskError", "QuarantineNote", "WorkDesk", "WorkDeskStats"]

log = get_logger("relay.work")

_RUN_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")
MAX_REPORTS = 10_000
RECENT_QUARANTINES = 20


class DeskError(Exception):
    """A call to refuse: the gRPC status and a message a person can act on."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# What the backbone is told to do when the store may answer again later, per call.
_RETRY_HINTS = {
    "ReportWork": "send the report again: its counts are cumulative, so nothing is counted twice",
    "Quarantine": "send the quarantine again: a session is closed once, however often it is asked",
}


@contextmanager
def _store_answers(call: str) -> Iterator[None]:
    """The contribution store's trouble as the call's answer: UNAVAILABLE with a retry hint
    when it may pass, INTERNAL with the store's message otherwise."""
    try:
        yield
    except ContributionStoreUnavailable as exc:
        log.warning("contribution store unavailable; the backbone is told to retry", call=call, error=str(exc))
        raise DeskError(grpc.StatusCode.UNAVAILABLE, f"{exc}; retry: {_RETRY_HINTS[call]}") from exc
    except ContributionStoreError as exc:
        log.error("contribution store failed; the call is refused", call=call, error=str(exc))
        raise DeskError(grpc.StatusCode.INTERNAL, f"the hub could not record this {call}: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class QuarantineNote:
    """One quarantine as the status page shows it: whose session, why, and until when."""

    session_id: str
    wallet: str
    violation: str
    layer: int
    expert: int
    detail: str
    at_unix_ms: int
    until_unix_ms: int


@dataclasses.dataclass(frozen=True)
class WorkDeskStats:
    """The desk's counters since the hub started (``WorkDesk.statistics``): work the backbone
    reported and the hub counted (bytes, calls, rows: what the counts grew by), reports
    refused (unknown or quarantined sessions), and quarantines by violation name. Audits
    themselves are the backbone's; the hub hears only of the ones that failed."""

    reports: int
    work_bytes: int
    work_calls: int
    work_rows: int
    refused: int
    quarantines: dict[str, int]
    # The latest quarantines, newest last (at most RECENT_QUARANTINES): what the page lists.
    recent_quarantines: tuple[QuarantineNote, ...] = ()


class WorkDesk:
    def __init__(self, registry: SessionRegistry, store: ContributionStore, key: Wallet, *,
                 quarantine_s: float) -> None:
        self.registry = registry
        self.store = store
        self.key = key
        self.quarantine_s = quarantine_s
        # Counters bumped by the gRPC threads, read by metrics.
        self._lock = threading.Lock()
        self._reports = 0
        self._grown = [0, 0, 0]  # bytes, calls, rows
        self._refused = 0
        self._quarantines: dict[str, int] = {}
        self._recent: collections.deque[QuarantineNote] = collections.deque(maxlen=RECENT_QUARANTINES)
        # Bans outlive the hub: a restart frees no quarantined wallet.
        for wallet, until in store.active_bans(time.time_ns() // 1_000_000).items():
            registry.ban(wallet, until)

    def statistics(self) -> WorkDeskStats:
        """A frozen snapshot of the desk's counters."""
        with self._lock:
            return WorkDeskStats(reports=self._reports, work_bytes=self._grown[0], work_calls=self._grown[1],
                                 work_rows=self._grown[2], refused=self._refused,
                                 quarantines=dict(self._quarantines), recent_quarantines=tuple(self._recent))

    def report(self, request: session_pb2.ReportWorkRequest) -> session_pb2.ReportWorkResponse:
        if not _RUN_ID.fullmatch(request.run_id):
            raise DeskError(grpc.StatusCode.INVALID_ARGUMENT,
                            "run_id must be 16 to 64 characters of [A-Za-z0-9_-], fresh per backbone run")
        if len(request.reports) > MAX_REPORTS:
            raise DeskError(grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_REPORTS} reports per call")
        if len(request.demand) > MAX_LAYERS or any(len(d.rows) > MAX_EXPERTS_PER_LAYER for d in request.demand):
            raise DeskError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"demand: at most {MAX_LAYERS} layers of {MAX_EXPERTS_PER_LAYER} experts")
        if request.demand:
            self.registry.demand.report(request.run_id, [(d.layer, list(d.rows)) for d in request.demand])
        if request.HasField("status"):
            self.registry.note_backbone(request.run_id, request.status)
        refused = []
        with _store_answers("ReportWork"):
            for r in request.reports:
                if r.cumulative_bytes > MAX_CUMULATIVE_BYTES:
                    raise DeskError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"session {r.session_id[:64]!r}: cumulative_bytes above {MAX_CUMULATIVE_BYTES}")
                live = self.registry.get(r.session_id)
                before = self.store.work_totals(r.session_id)
                counted = self.store.add_work(
                    request.run_id, r.session_id, r.cumulative_bytes, r.calls, r.rows,
                    wallet=live.wallet if live else None,
                    started_unix_ms=live.connected_since_unix_ms if live else None,
                )
                if not counted:
                    refused.append(r.session_id)
                    continue
                after = self.store.work_totals(r.session_id)
                with self._lock:
                    for i in range(3):
                        self._grown[i] += after[i] - before[i]
                if live is not None:
                    self.registry.set_work(r.session_id, *after)
                    if r.fallback_rows:
                        self.registry.note_fallback(r.session_id, request.run_id, r.fallback_rows)
        with self._lock:
            self._reports += 1
            self._refused += len(refused)
        if refused:
            log.warning("work refused for unknown or quarantined sessions", sessions=refused[:8], count=len(refused))
        return session_pb2.ReportWorkResponse(refused_session_ids=refused)

    def quarantine(self, request: session_pb2.QuarantineRequest) -> session_pb2.QuarantineResponse:
        sid = request.session_id
        live = self.registry.get(sid)
        with _store_answers("Quarantine"):
            wallet = live.wallet if live is not None else self.store.session_wallet(sid)
            if wallet is None:
                raise DeskError(grpc.StatusCode.NOT_FOUND, f"this hub has no session {sid[:64]!r}")
            until = time.time_ns() // 1_000_000 + int(self.quarantine_s * 1000)
            violation = session_pb2.Violation.Name(request.violation) if request.violation in \
                session_pb2.Violation.values() else str(request.violation)
            seq = self.store.quarantine(sid, self.key, wallet=wallet,
                                        started_unix_ms=live.connected_since_unix_ms if live else None)
            self.store.ban(wallet, until, f"{violation}: {request.detail[:200]}")
        self.registry.ban(wallet, until)
        # The evidence, for whoever reads the hub's log.
        log.error("session quarantined: wrong work", session_id=sid, wallet=wallet, violation=violation,
                  layer=request.layer, expert=request.expert, call_id=request.call_id, row=request.row,
                  max_abs_diff=request.max_abs_diff, tolerance=request.tolerance,
                  audited_rows=request.audited_rows, detail=request.detail[:300], receipt_seq=seq,
                  refused_until_unix_ms=until)
        with self._lock:
            self._quarantines[violation] = self._quarantines.get(violation, 0) + 1
            self._recent.append(QuarantineNote(
                session_id=sid, wallet=wallet, violation=violation, layer=request.layer, expert=request.expert,
                detail=request.detail[:200], at_unix_ms=time.time_ns() // 1_000_000, until_unix_ms=until))
        self.registry.kick(sid, f"quarantined: {violation}", CloseCode.QUARANTINED)
        return session_pb2.QuarantineResponse(refused_until_unix_ms=until)
