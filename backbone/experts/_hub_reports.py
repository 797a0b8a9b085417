"""What the backbone tells its hub: the work it accepted from each session (what the hub
signs receipts for) and the sessions it caught delivering wrong work.

The backbone is the payer and the authority on what it accepted. ``WorkReporter`` keeps,
for this run, each session's cumulative accepted bytes, calls and rows, and sends them with
``SessionService.ReportWork`` from its own thread every ``interval_s`` and when it closes;
counts are cumulative per (run, session), so a report that is sent twice adds nothing.
Quarantines go first, at once, so that no report after one counts the liar's work.

``AuditGate`` decides when an accepted call is paid: audits run after the answers are used,
so a session's calls wait, unpaid, behind any audit of that session submitted before them.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections.abc import Callable

import grpc

from kvasir_rpc import bearer, get_logger, session_pb2, session_pb2_grpc

__all__ = ["AuditGate", "WorkReporter", "WorkTally"]

log = get_logger("backbone.work")


@dataclasses.dataclass
class WorkTally:
    bytes: int = 0
    calls: int = 0
    rows: int = 0
    # Rows sent to the session and computed here (lost, refused or late): never paid.
    fallback_rows: int = 0


class AuditGate:
    """Pays accepted calls (``pay(session_id, bytes, rows)``) once every audit of their session
    submitted up to them has passed, in whatever order the audits end; a failed audit drops
    what its session has waiting, and the session is paid nothing more. Thread-safe."""

    def __init__(self, pay: Callable[[str, int, int], None]) -> None:
        self._pay = pay
        self._lock = threading.Lock()
        self._submitted: dict[str, int] = {}  # audits submitted, per session
        self._passed: dict[str, int] = {}  # audits 1..n of the session all passed
        self._passed_early: dict[str, set[int]] = {}  # passed, after one still pending
        self._held: dict[str, list[tuple[int, int, int]]] = {}  # (audit it waits for, bytes, rows)
        self._failed: set[str] = set()

    def accepted(self, session_id: str, nbytes: int, rows: int, *, audited: bool) -> int:
        """A call of ``session_id`` was accepted; ``audited``: some of its rows are to be
        audited. Returns the number of the audit it waits for (0: none, paid at once)."""
        with self._lock:
            if session_id in self._failed:
                return 0
            waits_for = self._submitted.get(session_id, 0) + int(audited)
            if audited:
                self._submitted[session_id] = waits_for
            if waits_for > self._passed.get(session_id, 0):
                self._held.setdefault(session_id, []).append((waits_for, nbytes, rows))
                return waits_for
        self._pay(session_id, nbytes, rows)
        return 0

    def passed(self, session_id: str, audit: int) -> None:
        """Audit number ``audit`` of ``session_id`` passed: pay what waited for it."""
        with self._lock:
            early = self._passed_early.setdefault(session_id, set())
            early.add(audit)
            done = self._passed.get(session_id, 0)
            while done + 1 in early:
                done += 1
                early.discard(done)
            self._passed[session_id] = done
            held = self._held.get(session_id, [])
            due = [h for h in held if h[0] <= done]
            self._held[session_id] = held[len(due):]
        for _, nbytes, rows in due:
            self._pay(session_id, nbytes, rows)

    def failed(self, session_id: str) -> None:
        """An audit of ``session_id`` failed: nothing it has waiting, or sends later, is paid."""
        with self._lock:
            self._failed.add(session_id)
            self._held.pop(session_id, None)

    def waiting(self) -> int:
        """Calls accepted and not yet paid, waiting for an audit."""
        with self._lock:
            return sum(len(h) for h in self._held.values())


class WorkReporter:
    """Accepted work per session for one backbone run, reported to the hub's SessionService."""

    def __init__(self, hub_address: str, token: str, *, interval_s: float = 1.0, call_timeout_s: float = 5.0) -> None:
        self.run_id = secrets.token_hex(16)
        self._metadata = bearer(token)
        self._channel = grpc.insecure_channel(hub_address)
        self._stub = session_pb2_grpc.SessionServiceStub(self._channel)
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self._lock = threading.Lock()
        self._work: dict[str, WorkTally] = {}
        self._sent: dict[str, tuple[int, int]] = {}  # (bytes, fallback rows) the hub has, per session
        self._quarantines: list[session_pb2.QuarantineRequest] = []
        self._dropped: set[str] = set()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.reports = 0
        self.failures = 0
        self.refused: set[str] = set()
        # Rows the router sent each expert this run ({layer: [rows by expert]}), reported with the
        # work when they grew: the hub plans --experts auto workers by them.
        self.demand_source: Callable[[], dict[int, list[int]]] | None = None
        # The backbone as it is now (BackboneStatus), sent with every report: the hub's page.
        self.status_source: Callable[[], session_pb2.BackboneStatus] | None = None
        self._demand_sent: dict[int, list[int]] = {}
        self._thread = threading.Thread(target=self._run, name="work-reporter", daemon=True)
        self._thread.start()

    def accepted(self, session_id: str, nbytes: int, rows: int) -> None:
        """One call of ``session_id`` was accepted: ``nbytes`` of work, ``rows`` assignments."""
        with self._lock:
            if session_id in self._dropped:
                return
            t = self._work.setdefault(session_id, WorkTally())
            t.bytes += nbytes
            t.calls += 1
            t.rows += rows

    def fell_back(self, session_id: str, rows: int) -> None:
        """``rows`` sent to ``session_id`` were computed here instead (the call was lost,
        refused or late): reported with the work, so the hub's page shows each session's
        fallback share. Unpaid."""
        with self._lock:
            if session_id in self._dropped:
                return
            self._work.setdefault(session_id, WorkTally()).fallback_rows += rows

    def quarantine(self, request: session_pb2.QuarantineRequest) -> None:
        """Report a liar at once; its work is never reported again in this run."""
        with self._lock:
            self._dropped.add(request.session_id)
            self._work.pop(request.session_id, None)
            self._quarantines.append(request)
        self._wake.set()

    def statistics(self) -> dict[str, WorkTally]:
        with self._lock:
            return {sid: dataclasses.replace(t) for sid, t in self._work.items()}

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> bool:
        """Send pending quarantines, then the work that grew. False if the hub did not answer."""
        with self._lock:
            quarantines, self._quarantines = self._quarantines, []
        for i, q in enumerate(quarantines):
            try:
                resp = self._stub.Quarantine(q, timeout=self.call_timeout_s, metadata=self._metadata)
                log.warning("session quarantined at the hub", session_id=q.session_id,
                            refused_until_unix_ms=resp.refused_until_unix_ms)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    continue  # the hub no longer knows it: nothing more to stop
                log.warning("hub did not take a quarantine; retrying", session_id=q.session_id,
                            code=str(exc.code()), details=exc.details())
                with self._lock:
                    self._quarantines[:0] = quarantines[i:]
                self.failures += 1
                return False
        with self._lock:
            reports = [
                session_pb2.WorkReport(session_id=sid, cumulative_bytes=t.bytes, calls=t.calls, rows=t.rows,
                                       fallback_rows=t.fallback_rows)
                for sid, t in self._work.items()
                if (t.bytes, t.fallback_rows) != self._sent.get(sid, (0, 0))
            ]
        demand = self.demand_source() if self.demand_source is not None else {}
        if demand == self._demand_sent:
            demand = {}
        status = self.status_source() if self.status_source is not None else None
        if not reports and not demand and status is None:
            return True
        try:
            resp = self._stub.ReportWork(session_pb2.ReportWorkRequest(
                run_id=self.run_id, reports=reports,
                demand=[session_pb2.ExpertDemand(layer=layer, rows=rows) for layer, rows in sorted(demand.items())],
                status=status), timeout=self.call_timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            self.failures += 1
            log.warning("hub did not take the work report; it is sent again", code=str(exc.code()),
                        details=exc.details())
            return False
        self.reports += 1
        if demand:
            self._demand_sent = demand
        refused = set(resp.refused_session_ids)
        self.refused |= refused
        with self._lock:
            for r in reports:
                self._sent[r.session_id] = (r.cumulative_bytes, r.fallback_rows)
                if r.session_id in refused:
                    self._dropped.add(r.session_id)
                    self._work.pop(r.session_id, None)
        return True

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop the thread and deliver what is left, trying until ``timeout_s``. True when the
        hub has every report."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self.call_timeout_s + 1)
        deadline = time.monotonic() + timeout_s
        ok = self.flush()
        while not ok and time.monotonic() < deadline:
            time.sleep(0.2)
            ok = self.flush()
        if not ok:
            log.error("the hub never took this run's last work report; that work is not paid", run_id=self.run_id)
        self._channel.close()
        return ok
