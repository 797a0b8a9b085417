"""The backbone's experts implementation, plugged into transformers' ExpertsInterface.

The router has already run (transformers' own gate); ``Dispatcher.forward`` receives its
decisions and sends the remote calls, computes the local experts while they fly, collects
the answers (checked, recomputed here when lost or refused) and combines every partial in
one fixed order whatever the placement. Its parts, one job each:

* ``Placement`` (``_placement.py``): which worker link serves which (layer, expert);
* ``ExpertWeights`` (``_weights.py``): where an expert's weights come from;
* ``SharedDeferral`` (``_shared_deferral.py``): Qwen3.5's shared expert computed while calls fly;
* ``AnswerChecker`` (``_answers.py``): whether a worker's answer is accepted;
* ``StragglerPolicy`` (``_deadlines.py``): how long a call is awaited before it is computed here.

All calls of a layer are awaited together, each until its own deadline: a late one is
computed here (hedged) and its answer, if it still comes, is dropped and never paid.

The sampled audits run on the Dispatcher's audit thread, off the critical path: an answer
that passes its whole-answer checks is used at once, its sampled rows are audited while
the decode goes on (while the next layers' calls fly, the core is otherwise idle), and a
session's calls are paid only once its audits submitted up to them have passed
(``AuditGate``). The decode attempt in force in the calling thread (``_attempt.py``) is told
which sessions each pass used and which audits it waits for; it settles them before the
decode chooses tokens, so no token leaves the backbone before the audits of the calls that
made it have passed, and it decides what to recompute when a session turns out to have lied.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import torch
from transformers.integrations.moe import ExpertsInterface

from backbone.experts._answers import AnswerChecker, Checked, SampledRows, SentCall
from backbone.experts._attempt import DecodeAttempt, ReplayNeeded, Untrusted, current_attempt
from backbone.experts._audit import DEFAULT_AUDIT_RATE, AuditRates
from backbone.experts._deadlines import StragglerPolicy
from backbone.experts._hub_reports import AuditGate, WorkReporter
from backbone.experts._links import Answer, ComputedPartials, DispatchCall, Link, SessionSource
from backbone.experts._placement import Placement
from backbone.experts._shared_deferral import SharedDeferral
from backbone.experts._weights import CheckpointWeights, ExpertWeights, HeldWeights, experts_modules
from kvasir_rpc import (
    NARROW_Z,
    ExpertFunction,
    ExpertIndex,
    Route,
    RowChecker,
    expert_forward,
    get_logger,
    plan_routes,
    session_pb2,
    threads_initializer,
)

__all__ = ["IMPLEMENTATION", "Dispatcher", "DispatchStats", "ReplayNeeded", "install"]  # ReplayNeeded: _attempt's

log = get_logger("backbone.experts")

IMPLEMENTATION = "kvasir"


@dataclasses.dataclass(frozen=True)
class DispatchStats:
    remote_calls: int
    remote_rows: int
    expert_bytes_held: int
    local_rows: int
    fallback_calls: int
    fallback_rows: int
    sessions_used: tuple[str, ...]
    sessions_rejected: tuple[str, ...]
    shared_overlapped: int = 0
    audited_rows: int = 0
    audit_exact_rows: int = 0
    audit_seconds: float = 0.0  # CPU time the audits took (on the audit thread)
    sessions_quarantined: tuple[str, ...] = ()
    replays: int = 0
    hedged_calls: int = 0  # late: computed here before their answer came
    hedged_rows: int = 0
    late_answers_dropped: int = 0  # answers of hedged calls that came after all: unused, unpaid
    sent_bytes: int = 0  # serialized requests of every remote call sent
    received_bytes: int = 0  # serialized partials of every answer that came in time
    answers_refused: int = 0  # answers that failed their check or audit (their session quarantined)
    row_checked_rows: int = 0  # rows whose row checks ran (every row of a row-checked session's answers)
    row_check_seconds: float = 0.0  # CPU time of the row checks, on the decode's threads
    row_check_refusals: int = 0  # answers refused by their row checks (computed here instead)
    # Links a worker turned away because it served its maximum of backbones (RESOURCE_EXHAUSTED).
    worker_busy_refusals: int = 0


class RowTally:
    """Expert rows (a token through an expert) of one forward pass counted by the request
    that owns each token: ``counts[kind, owner]`` with kind 0 remote (accepted), 1 local by
    choice, 2 computed here after a lost, late or refused call."""

    REMOTE, LOCAL, FALLBACK = 0, 1, 2

    def __init__(self, owners: torch.Tensor, n: int) -> None:
        self.owners = owners  # [T] the owner of each token row; -1: padding, no expert runs for it
        self.counts = torch.zeros(3, n, dtype=torch.long)
        padding = owners < 0
        self.padding: torch.Tensor | None = padding if bool(padding.any()) else None

    def without_padding(self, routes: list[Route]) -> list[Route]:
        """``routes`` with the padding rows left out (their experts' output stays zero)."""
        if self.padding is None:
            return routes
        kept = []
        for r in routes:
            keep = ~self.padding[r.token_idx]
            if bool(keep.all()):
                kept.append(r)
            elif bool(keep.any()):
                kept.append(Route(expert=r.expert, token_idx=r.token_idx[keep], top_k_pos=r.top_k_pos[keep]))
        return kept

    def add(self, kind: int, token_idx: torch.Tensor) -> None:
        self.counts[kind].index_add_(0, self.owners[token_idx], torch.ones_like(token_idx))


class Dispatcher:
    """Runs the experts path of ``model``: remote experts on the sessions ``watcher`` lists
    (a hub's ``SessionWatcher``, or emulated workers: ``_ceiling.py``), the rest here.

    ``watcher=None`` (or ``remote = False`` later) computes every expert here through the
    same kernel: the reference the remote run must equal bitwise. ``expert_source``: the
    model was loaded without its experts (``load_model(..., experts="on-demand")``) and an
    expert is read from this checkpoint index the first time it is computed here.
    ``stragglers``: when a call is late and computed here (its ``cap_s`` is replaced by
    ``call_timeout_s``, after which a call is lost and its link dropped).
    Thread-safe: decode groups call ``forward`` from several threads.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        watcher: SessionSource | None,
        *,
        call_timeout_s: float = 30.0,
        wire_dtype: torch.dtype | None = None,
        expert_source: ExpertIndex | None = None,
        audit_rate: float = DEFAULT_AUDIT_RATE,
        reporter: WorkReporter | None = None,
        stragglers: StragglerPolicy | None = None,
        audit_rates: AuditRates | None = None,
        row_checks: bool = True,
        kind: str = "generate",
    ) -> None:
        modules = experts_modules(model)
        self.weights: ExpertWeights
        if expert_source is None:
            self.weights = HeldWeights(modules)
        elif all(p.is_meta for m in modules.values() for p in m.parameters()):
            self.weights = CheckpointWeights(modules, expert_source)
        else:
            raise ValueError("on-demand expert weights need a model loaded without its experts "
                             "(load_model(..., experts='on-demand')); this one holds them")
        for layer, module in modules.items():
            module._kvasir = (self, layer)  # type: ignore[assignment]
        self.remote = watcher is not None
        self.placement = Placement(watcher, self.weights) if watcher is not None else None
        # ``audit_rates`` (when given) says more than ``audit_rate``, its base rate.
        rates = audit_rates if audit_rates is not None else AuditRates(base=audit_rate)
        self.checker = AnswerChecker(self.weights, rates, RowChecker(self.weights) if row_checks else None)
        # One thread audits the sampled rows of accepted answers while the decode goes on.
        self._auditor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit",
                                                              initializer=_audit_thread_setup())
        self.shared = SharedDeferral(model, modules, implementation=IMPLEMENTATION, deferring=lambda: self.remote)
        self.reporter = reporter
        if reporter is not None and self.placement is not None:
            reporter.demand_source = self.placement.demand
            reporter.status_source = self.backbone_status
        self.payments = AuditGate(reporter.accepted if reporter is not None else lambda *_: None)
        # None: activations travel in the model's dtype (bit-exact). bfloat16/float16 for a
        # float32 model halves the bytes and is not bit-exact.
        self.wire_dtype = wire_dtype
        # The call timeout caps every deadline: a call unanswered that long is lost.
        self.policy = dataclasses.replace(stragglers or StragglerPolicy(), cap_s=call_timeout_s)
        # Sessions whose past answers cannot all be trusted, with what they served: those that
        # failed an audit or were quarantined while answering without row checks (none of their
        # answers), and those refused by a row check (the answers whose rows passed narrowly).
        # Decode attempts that used them recompute without them (``_attempt.py``). Replaced,
        # never mutated.
        self._untrusted: dict[str, Untrusted] = {}
        self._tally = threading.local()  # the RowTally of this thread's forward pass, if any
        self._lock = threading.Lock()
        # Called with each accepted call's round trip in seconds (metrics' latency histogram).
        self.observe_call: Callable[[float], None] | None = None
        # What ``backbone_status`` says this backbone is ("generate" or "serve"), and where its
        # load (requests running, waiting) is read: a service's engine, once it is built.
        self.kind = kind
        self._load: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self.reset_counters()

    # -- the experts path ------------------------------------------------------------

    def forward(self, module: torch.nn.Module, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """The experts' output [T, H] for ``hidden`` [T, H] routed to ``top_k_index`` [T, K]
        with ``top_k_weights`` [T, K]. Raises ReplayNeeded when a session the decode attempt
        in force used can no longer be trusted."""
        attempt = current_attempt()
        if attempt is not None:
            attempt.check()
        num_experts = self.weights.num_experts(layer)
        assert num_experts is not None
        routes = plan_routes(top_k_index, num_experts)
        tally: RowTally | None = getattr(self._tally, "value", None)
        if tally is not None:
            routes = tally.without_padding(routes)
        placed, local = self._place(layer, routes, attempt)
        fn = self.weights.functions[layer]

        inflight = [self._send(link, layer, rs, hidden, top_k_weights) for link, rs in placed.items()]
        self.shared.run(layer)  # while the calls fly
        partials = {r.expert: self._compute(layer, fn, hidden, top_k_weights, r) for r in local}
        with self._lock:
            self.local_rows += sum(len(r.token_idx) for r in local)
        self._count(RowTally.LOCAL, local)
        self._collect(layer, fn, hidden, top_k_weights, inflight, partials)
        if attempt is not None:
            attempt.check()  # a session this pass refused may taint what earlier passes used
        return _combine(hidden, routes, partials)

    def _place(self, layer: int, routes: list[Route], attempt: DecodeAttempt | None
               ) -> tuple[dict[Link, list[Route]], list[Route]]:
        """``(routes by the link that serves them, routes computed here)``: here when there is
        no swarm, and for the experts the attempt keeps here after its replays."""
        if not self.remote or self.placement is None:
            return {}, routes
        keep = attempt.keeps_local(layer) if attempt is not None else set()
        if keep is None:
            return {}, routes
        placed, local = self.placement.split(layer, [r for r in routes if r.expert not in keep])
        local.extend(r for r in routes if r.expert in keep)
        local.sort(key=lambda r: r.expert)
        return placed, local

    def _send(self, link: Link, layer: int, routes: list[Route], hidden: torch.Tensor,
              top_k_weights: torch.Tensor) -> SentCall:
        """One batched call to ``link`` for all of this layer's rows routed to its experts."""
        tokens = torch.cat([r.token_idx for r in routes])  # one per assignment, in segment order
        # A token routed to several of this worker's experts travels once.
        distinct, index = torch.unique(tokens, return_inverse=True)
        dedupe = distinct.numel() < tokens.numel()
        rows = hidden[distinct] if dedupe else hidden[tokens]  # [n, H]
        if self.wire_dtype is not None and rows.dtype != self.wire_dtype:
            rows = rows.to(self.wire_dtype)
        weights = torch.cat([top_k_weights[r.token_idx, r.top_k_pos] for r in routes])  # [assignments]
        segments = [(r.expert, len(r.token_idx)) for r in routes]
        row_index = index.tolist() if dedupe else ()
        projections = link.row_checked and self.checker.row_checks is not None
        rec = link.submit(len(tokens), DispatchCall(layer, rows, weights, segments, row_index, projections),
                          self.policy)
        with self._lock:
            self.sent_bytes += rec.request_bytes
        return SentCall(rec, routes, link, rows, weights, index if dedupe else None, rec.request_bytes, projections)

    def _compute(self, layer: int, fn: ExpertFunction, hidden: torch.Tensor, top_k_weights: torch.Tensor,
                 r: Route) -> torch.Tensor:
        """One expert's partials [rows, H] for its routed rows, computed here."""
        gate_up, down = self.weights.get(layer, r.expert)
        return expert_forward(hidden[r.token_idx], gate_up, down, fn, top_k_weights[r.token_idx, r.top_k_pos],
                              self.weights.biases(layer, r.expert))

    def _collect(self, layer: int, fn: ExpertFunction, hidden: torch.Tensor, top_k_weights: torch.Tensor,
                 inflight: list[SentCall], partials: dict[int, torch.Tensor]) -> None:
        """Each call's answer into ``partials``: accepted and paid, or lost, refused or late
        and recomputed here (a refused one's session quarantined). All calls are awaited
        together, in the order they finish, each until its own deadline."""
        waiting = {sent.record.future: sent for sent in inflight}
        while waiting:
            nearest = min(sent.record.deadline_ns for sent in waiting.values())
            timeout = max(0.0, (nearest - time.perf_counter_ns()) / 1e9)
            done, _ = concurrent.futures.wait(waiting, timeout=timeout,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            now = time.perf_counter_ns()
            finished = [waiting.pop(fut) for fut in done]
            late = [sent for sent in waiting.values() if sent.record.deadline_ns <= now]
            for sent in late:
                del waiting[sent.record.future]
            for sent in finished:
                checked = self._answer(layer, fn, hidden.shape[1], sent)
                if checked.evidence is not None:
                    self._refuse(sent.link, checked.evidence)
                if checked.partials is None:  # lost or refused: recomputed here, not paid
                    self._fall_back(layer, fn, hidden, top_k_weights, sent, partials)
                else:
                    self._accept(sent, checked, hidden.dtype, partials)
            for sent in late:
                self._late(layer, sent)
                self._count(RowTally.FALLBACK, sent.routes)
                self._report_fallback(sent)
                for r in sent.routes:
                    partials[r.expert] = self._compute(layer, fn, hidden, top_k_weights, r)

    def _fall_back(self, layer: int, fn: ExpertFunction, hidden: torch.Tensor, top_k_weights: torch.Tensor,
                   sent: SentCall, partials: dict[int, torch.Tensor]) -> None:
        with self._lock:
            self.fallback_calls += 1
            self.fallback_rows += sent.record.rows
        self._count(RowTally.FALLBACK, sent.routes)
        self._report_fallback(sent)
        for r in sent.routes:
            partials[r.expert] = self._compute(layer, fn, hidden, top_k_weights, r)

    def _late(self, layer: int, sent: SentCall) -> None:
        """``sent`` passed its deadline unanswered: count it (hedged, or lost at the call
        timeout) and drop its answer if it still comes. The caller computes it here."""
        rec, link = sent.record, sent.link
        waited_s = round((time.perf_counter_ns() - rec.sent_ns) / 1e9, 3)
        assert self.placement is not None
        if not self.policy.hedging or rec.deadline_ns - rec.sent_ns >= int(self.policy.cap_s * 1e9):
            # The call timeout: lost, as a broken stream is.
            log.warning("remote call timed out; computing locally", session_id=link.session_id, layer=layer,
                        rows=rec.rows, waited_s=waited_s)
            self.placement.drop(link, TimeoutError(f"call {rec.call_id} unanswered after {waited_s} s"))
            with self._lock:
                self.fallback_calls += 1
                self.fallback_rows += rec.rows
            return
        misses = link.note_miss()
        srtt, rttvar = link.round_trip()
        with self._lock:
            self.hedged_calls += 1
            self.hedged_rows += rec.rows
        rec.future.add_done_callback(self._late_answer)
        log.info("remote call late; computing locally", session_id=link.session_id, layer=layer, rows=rec.rows,
                 waited_s=waited_s, srtt_s=srtt, rttvar_s=rttvar, misses=misses)
        if misses >= self.policy.max_misses:
            log.warning("worker missed its deadlines; not routing to it", session_id=link.session_id,
                        misses=misses, srtt_s=srtt)
            self.placement.drop(link, TimeoutError(f"{misses} calls in a row past their deadlines"))

    def _late_answer(self, fut: concurrent.futures.Future[Answer]) -> None:
        """The answer of a hedged call: never checked, never used, never paid."""
        if not fut.cancelled() and fut.exception() is None:
            with self._lock:
                self.late_answers_dropped += 1

    def _answer(self, layer: int, fn: ExpertFunction, width: int, sent: SentCall) -> Checked:
        """The finished call's verdict: its checked partials and rows to audit, or none (lost,
        or refused with the evidence)."""
        rec = sent.record
        exc = rec.future.exception()
        if exc is not None:  # the stream failed: recomputed here
            log.warning("remote call lost; computing locally", session_id=sent.link.session_id, layer=layer,
                        rows=rec.rows, error=repr(exc)[:200])
            assert self.placement is not None
            self.placement.drop(sent.link, exc)
            return Checked(None)
        answer = rec.future.result()
        if not isinstance(answer, ComputedPartials):  # computed in this process: nothing was received
            with self._lock:
                self.received_bytes += answer.ByteSize()
        return self.checker.check(layer, fn, sent, answer, width)

    def _accept(self, sent: SentCall, checked: Checked, dtype: torch.dtype, partials: dict[int, torch.Tensor]) -> None:
        """Use an answer that passed its checks; its sampled rows, if any, go to the audit
        thread. Paid once every audit of its session up to it has passed (at once when none
        is pending)."""
        out, sampled = checked.partials, checked.sampled
        assert out is not None
        # Paid: the request as sent and the partials (and projections) at exactly their expected size.
        work = sent.request_bytes + checked.work_bytes
        self.checker.accepted(sent.link.wallet, sent.record.rows)
        if out.dtype != dtype:
            out = out.to(dtype)
        start = 0
        for r in sent.routes:
            n = len(r.token_idx)
            partials[r.expert] = out[start : start + n]
            start += n
        self._count(RowTally.REMOTE, sent.routes)
        sid = sent.link.session_id
        sent.link.note_on_time()
        with self._lock:
            self.remote_calls += 1
            self.remote_rows += sent.record.rows
            self._used.add(sid)
        attempt = current_attempt()
        if attempt is not None:
            attempt.used(sid, narrow=checked.z > NARROW_Z)
        if self.observe_call is not None and sent.record.answered_ns:
            self.observe_call((sent.record.answered_ns - sent.record.sent_ns) / 1e9)
        number = self.payments.accepted(sid, work, sent.record.rows, audited=sampled is not None)
        if sampled is not None:
            audit = self._auditor.submit(self._audit, sent.link, sampled, number)
            if attempt is not None:
                attempt.audit_pending(audit)

    def _audit(self, link: Link, sampled: SampledRows, number: int) -> bool:
        """On the audit thread: the sampled rows of an accepted call. If they pass, the
        session's calls that waited for this audit are paid; else nothing it has waiting is,
        it is quarantined and no longer trusted (decodes that used it replay at their next
        settle). Whether they passed."""
        evidence = self.checker.audit(sampled)
        if evidence is None:
            self.payments.passed(link.session_id, number)
            return True
        self._refuse(link, evidence, audited=True)
        return False

    def _refuse(self, link: Link, evidence: session_pb2.QuarantineRequest, *, audited: bool = False) -> None:
        """Stop using a session that delivered wrong work, pay it nothing more, and report it
        with the evidence. None of its answers already used is trusted any more when an audit
        caught it (they had passed their checks) or when its rows are not checked; when its row
        checks caught it, those whose rows passed narrowly are not."""
        assert self.placement is not None
        self.payments.failed(link.session_id)
        narrow_only = not audited and link.row_checked and self.checker.row_checks is not None
        with self._lock:
            self.answers_refused += 1
            if evidence.violation == session_pb2.VIOLATION_ROW_CHECK:
                self.row_check_refusals += 1
            self._untrusted = {**self._untrusted, link.session_id: Untrusted(link.slices, narrow_only)}
        if self.placement.quarantine(link):
            evidence.audited_rows = self.checker.audited_rows
            log.error("worker delivered wrong work: quarantined", session_id=link.session_id, wallet=link.wallet,
                      violation=session_pb2.Violation.Name(evidence.violation), layer=evidence.layer,
                      expert=evidence.expert, call_id=evidence.call_id, row=evidence.row,
                      max_abs_diff=evidence.max_abs_diff, tolerance=evidence.tolerance, detail=evidence.detail)
            if self.reporter is not None:
                self.reporter.quarantine(evidence)

    # -- rows by request ---------------------------------------------------------------

    @contextlib.contextmanager
    def tally_rows(self, owners: torch.Tensor, n: int) -> Iterator[torch.Tensor]:
        """Count this thread's expert rows by owner while the block runs: ``owners`` [T]
        gives the owner (0 to n - 1) of each token row of the forward pass. Yields the
        counts [3, n] (remote, local, fallback), filled in as the block runs."""
        tally = RowTally(owners, n)
        previous = getattr(self._tally, "value", None)
        self._tally.value = tally
        try:
            yield tally.counts
        finally:
            self._tally.value = previous

    def _report_fallback(self, sent: SentCall) -> None:
        """``sent``'s rows were computed here: the hub hears it with the work (each session's
        fallback share on its page)."""
        if self.reporter is not None:
            self.reporter.fell_back(sent.link.session_id, sent.record.rows)

    def _count(self, kind: int, routes: list[Route]) -> None:
        tally: RowTally | None = getattr(self._tally, "value", None)
        if tally is not None:
            for r in routes:
                tally.add(kind, r.token_idx)

    # -- decode attempts (replays) -----------------------------------------------------

    def untrusted(self) -> Mapping[str, Untrusted]:
        """Sessions whose past answers cannot all be trusted, with the slices each served."""
        return self._untrusted

    def note_replay(self) -> None:
        with self._lock:
            self.replays += 1

    # -- counters and resources ----------------------------------------------------------

    def reset_counters(self) -> None:
        with self._lock:
            self.remote_calls = self.remote_rows = self.local_rows = 0
            self.fallback_calls = self.fallback_rows = 0
            self.replays = 0
            self.hedged_calls = self.hedged_rows = self.late_answers_dropped = 0
            self.sent_bytes = self.received_bytes = self.answers_refused = self.row_check_refusals = 0
            self._used: set[str] = set()
        self.shared.overlapped = 0
        self.checker.reset_counters()

    def measure_load_with(self, load: Callable[[], tuple[int, int]]) -> None:
        """Read this backbone's load (requests running, waiting) from ``load``: a service's
        engine, built after its dispatcher."""
        self._load = load

    def backbone_status(self) -> session_pb2.BackboneStatus:
        """This run as the hub's status page shows it (sent with every work report)."""
        running, waiting = self._load()
        d = self.statistics()
        return session_pb2.BackboneStatus(kind=self.kind, running=running, waiting=waiting, remote_rows=d.remote_rows,
                                          local_rows=d.local_rows, fallback_rows=d.fallback_rows,
                                          worker_busy_refusals=d.worker_busy_refusals)

    def statistics(self) -> DispatchStats:
        checks = self.checker.statistics()
        placement = self.placement
        rejected = placement.rejected() if placement is not None else ()
        quarantined = tuple(sorted(placement.quarantined)) if placement is not None else ()
        with self._lock:
            return DispatchStats(
                remote_calls=self.remote_calls,
                remote_rows=self.remote_rows,
                expert_bytes_held=self.weights.bytes_held(),
                local_rows=self.local_rows,
                fallback_calls=self.fallback_calls,
                fallback_rows=self.fallback_rows,
                worker_busy_refusals=placement.busy_refusals if placement is not None else 0,
                sessions_used=tuple(sorted(self._used)),
                sessions_rejected=rejected,
                shared_overlapped=self.shared.overlapped,
                audited_rows=checks.audited_rows,
                audit_exact_rows=checks.audit_exact_rows,
                audit_seconds=checks.audit_seconds,
                sessions_quarantined=quarantined,
                replays=self.replays,
                hedged_calls=self.hedged_calls,
                hedged_rows=self.hedged_rows,
                late_answers_dropped=self.late_answers_dropped,
                sent_bytes=self.sent_bytes,
                received_bytes=self.received_bytes,
                answers_refused=self.answers_refused,
                row_checked_rows=checks.row_checked_rows,
                row_check_seconds=checks.row_check_seconds,
                row_check_refusals=self.row_check_refusals,
            )

    def close(self) -> None:
        # Audits still queued pay or quarantine before the work is reported.
        self._auditor.shutdown(wait=True)
        if self.placement is not None:
            self.placement.close()


def _audit_thread_setup() -> Callable[[], None]:
    """The audit thread's start: this thread's torch thread count, and on Linux a lower
    priority (nice 5, this thread only), so that audits take the time the decode threads and
    a hub on the same core leave idle rather than delay them; a decode that waits for its
    audits (``settle``) leaves them the core. A/B on the decode bench, RTT 13 and 50 ms,
    3 runs each: 337 and 298 tokens/s against 323 and 278 at the same priority (noisy)."""
    same_threads = threads_initializer()

    def setup() -> None:
        same_threads()
        if sys.platform == "linux":  # elsewhere a thread id is not a process id
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 5)

    return setup


def _combine(hidden: torch.Tensor, routes: list[Route], partials: dict[int, torch.Tensor]) -> torch.Tensor:
    """Every expert's partials added into [T, H] in one fixed order, whatever ran where:
    ascending expert, as transformers' eager."""
    final = torch.zeros_like(hidden)
    for r in routes:
        final.index_add_(0, r.token_idx, partials[r.expert].to(final.dtype))
    return final


def kvasir_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The function registered as experts implementation ``"kvasir"``."""
    ctx = getattr(self, "_kvasir", None)
    if ctx is None:
        raise RuntimeError("experts implementation 'kvasir' needs a backbone Dispatcher attached to the model")
    dispatcher, layer = ctx
    with torch.no_grad():
        return dispatcher.forward(self, layer, hidden_states, top_k_index, top_k_weights)


def install() -> None:
    """Register the implementation with transformers (idempotent)."""
    ExpertsInterface.register(IMPLEMENTATION, kvasir_experts_forward)
