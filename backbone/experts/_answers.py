"""Checking a worker's answer to one call before its partials are used or paid.

Whole-answer checks first, at once (it decodes, has the expected shape and dtype, every
value is finite unless this backbone's own result overflows alike); then, for a session whose
worker returns its projections, the row checks of ``_row_checks.py`` on every row, also before
the answer is used; then the sampled audit of ``_audit.py``, which the Dispatcher runs off
the decode's critical path: the sampled rows are copied out of the call (``SampledRows``)
and audited on another thread while the decode goes on, and the decode waits for the
verdicts before it chooses its next tokens. A refused answer comes with the evidence the hub
is sent. How much is audited depends on the session (``AuditRates``): more for a session
without row checks and for a wallet's first rows.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Iterator

import torch

from backbone.experts._audit import AuditRates, RowSampler
from backbone.experts._links import Answer, CallRecord, ComputedPartials, Link
from backbone.experts._weights import ExpertTensors, ExpertWeights
from kvasir_rpc import (
    AuditResult,
    ExpertFunction,
    Route,
    RowChecker,
    TensorCodecError,
    all_finite,
    audit_rows,
    decode_tensor,
    expert_forward,
    session_pb2,
)

__all__ = ["AnswerChecker", "Checked", "SampledRows", "SentCall"]

# Wallets whose accepted work the checker remembers (the least recently seen forgotten first).
_WALLETS_KEPT = 100_000


@dataclasses.dataclass
class SentCall:
    """What left for one remote call, kept until its answer is checked."""

    record: CallRecord
    routes: list[Route]  # the call's segments, in order
    link: Link
    rows: torch.Tensor  # [distinct, H] as sent (wire dtype)
    weights: torch.Tensor  # [assignments] as sent
    index: torch.Tensor | None  # [assignments] row of `rows` per assignment, or None: the identity
    request_bytes: int
    projections: bool = False  # the call asked for the projections (row checks)

    def inputs(self, picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sent rows and routing weights of assignments ``picked`` (as the worker got them)."""
        x = self.rows[picked] if self.index is None else self.rows[self.index[picked]]
        return x, self.weights[picked]

    def experts(self) -> torch.Tensor:
        """The expert of each assignment [assignments], in segment order."""
        return torch.cat([torch.full((len(r.token_idx),), r.expert) for r in self.routes])


@dataclasses.dataclass(frozen=True)
class SampledRows:
    """The rows of one accepted answer chosen for the audit, copied out of its call (a few
    rows: the call itself is not kept) so that the audit can run later, on another thread."""

    layer: int
    fn: ExpertFunction
    session_id: str
    call_id: int
    call_rows: int  # assignments in the call
    picked: torch.Tensor  # [n] the audited rows' positions in the call, ascending
    experts: torch.Tensor  # [n] the expert of each
    x: torch.Tensor  # [n, H] the rows as sent (wire dtype)
    w: torch.Tensor  # [n] their routing weights as sent
    got: torch.Tensor  # [n, H] the worker's partials for them


@dataclasses.dataclass(frozen=True)
class CheckStats:
    audited_rows: int
    audit_exact_rows: int
    audit_seconds: float
    row_checked_rows: int = 0  # rows checked by the row checks (every row of their sessions' answers)
    row_check_seconds: float = 0.0  # CPU time the row checks took, on the decode's threads


@dataclasses.dataclass(frozen=True)
class Checked:
    """The verdict on one answer before it is used: its ``partials`` [assignments, width] in
    the wire dtype, or the ``evidence`` against its worker; the rows ``sampled`` for the audit
    (the caller must audit them before the call is paid); the answer's bytes of work at their
    expected size (partials and projections); and ``z``, how narrowly its rows passed their
    checks (in standard deviations; 0 without row checks)."""

    partials: torch.Tensor | None
    evidence: session_pb2.QuarantineRequest | None = None
    sampled: SampledRows | None = None
    work_bytes: int = 0
    z: float = 0.0


class AnswerChecker:
    """Accepts or refuses answers; counts what it audited and checked. Thread-safe.
    ``row_checks``: None when answers' rows are not checked (no call asks for projections)."""

    def __init__(self, weights: ExpertWeights, rates: AuditRates, row_checks: RowChecker | None = None) -> None:
        self._weights = weights
        self.rates = rates
        self._sampler = RowSampler(rates.base)
        self.row_checks = row_checks
        self._earned: collections.OrderedDict[str, int] = collections.OrderedDict()  # wallet -> rows accepted
        self._lock = threading.Lock()
        self.reset_counters()

    def reset_counters(self) -> None:
        with self._lock:
            self.audited_rows = self.audit_exact_rows = self.row_checked_rows = 0
            self.audit_seconds = 0.0
            if self.row_checks is not None:
                self.row_checks.seconds = 0.0

    def statistics(self) -> CheckStats:
        with self._lock:
            return CheckStats(self.audited_rows, self.audit_exact_rows, round(self.audit_seconds, 4),
                              self.row_checked_rows,
                              round(self.row_checks.seconds, 4) if self.row_checks is not None else 0.0)

    def earned(self, wallet: str) -> int:
        """Rows of ``wallet``'s work this backbone has accepted."""
        with self._lock:
            return self._earned.get(wallet, 0)

    def accepted(self, wallet: str, rows: int) -> None:
        """``rows`` more of ``wallet``'s work were accepted: its audits thin out (AuditRates)."""
        with self._lock:
            self._earned[wallet] = self._earned.pop(wallet, 0) + rows
            while len(self._earned) > _WALLETS_KEPT:
                self._earned.popitem(last=False)

    def check(self, layer: int, fn: ExpertFunction, sent: SentCall, msg: Answer, width: int) -> Checked:
        """The answer's verdict: refused (with the evidence) if it fails its whole-answer
        checks or, when the call asked for projections, the row checks of any row; else
        accepted, with the rows to audit chosen here, after the answer arrived."""
        rec = sent.record
        evidence = session_pb2.QuarantineRequest(session_id=sent.link.session_id, layer=layer, call_id=rec.call_id)
        sent_dtype = sent.rows.dtype
        projections: torch.Tensor | None = None
        try:
            out, projections = _tensors(msg, sent.projections)
            if out.shape != (rec.rows, width) or out.dtype != sent_dtype:
                raise TensorCodecError(f"partials of shape {list(out.shape)} {out.dtype}, expected "
                                       f"[{rec.rows}, {width}] {sent_dtype}")
            if projections is not None:
                inter = self._weights.intermediate_size(layer)
                if projections.shape != (rec.rows, 2 * inter) or projections.dtype != sent_dtype:
                    raise TensorCodecError(f"projections of shape {list(projections.shape)} {projections.dtype}, "
                                           f"expected [{rec.rows}, {2 * inter}] {sent_dtype}")
        except TensorCodecError as exc:
            evidence.violation = session_pb2.VIOLATION_MALFORMED
            evidence.detail = str(exc)[:300]
            return Checked(None, evidence)
        work = out.numel() * out.element_size() + (
            projections.numel() * projections.element_size() if projections is not None else 0)
        if not all_finite(out):
            # Wrong unless this backbone's own result is just as non-finite (an honest overflow).
            mine = self._recompute(layer, fn, sent, torch.arange(rec.rows))
            if all_finite(mine) or not torch.equal(mine.isfinite(), out.isfinite()):
                bad = int((~out.isfinite()).any(dim=-1).nonzero()[0, 0])
                evidence.violation = session_pb2.VIOLATION_NON_FINITE
                evidence.row = bad
                evidence.expert = int(sent.experts()[bad])
                evidence.max_abs_diff = float("inf")
                evidence.detail = f"row {bad} of {rec.rows} holds NaN or Inf; this backbone's result is finite"
                return Checked(None, evidence)
            projections = None  # an honest overflow, the same as this backbone's: nothing to check by rows
        z = 0.0
        if projections is not None and self.row_checks is not None:
            experts = sent.experts()
            x, w = sent.inputs(torch.arange(rec.rows))
            verdict = self.row_checks.check(layer, fn, x, w, experts, out, projections)
            with self._lock:
                self.row_checked_rows += rec.rows
            if not verdict.passed:
                evidence.violation = session_pb2.VIOLATION_ROW_CHECK
                evidence.row = verdict.row
                evidence.expert = int(experts[verdict.row])
                evidence.max_abs_diff = verdict.diff
                evidence.tolerance = verdict.tau
                evidence.detail = verdict.detail[:300]
                return Checked(None, evidence)
            z = verdict.z
        # Whole segments of at most SEGMENT_ROWS rows, in order: their reference is then
        # computed as the worker computed it (see _audit.py).
        earned = max(self.earned(sent.link.wallet), getattr(sent.link, "prior_rows", 0))
        rate = self.rates.rate(earned, row_checked=sent.projections)
        picked = self._sampler.choose(sent.link.session_id, [len(r.token_idx) for r in sent.routes], rate)
        if not picked.numel():
            return Checked(out, work_bytes=work, z=z)
        x, w = sent.inputs(picked)
        sampled = SampledRows(layer=layer, fn=fn, session_id=sent.link.session_id, call_id=rec.call_id,
                              call_rows=rec.rows, picked=picked, experts=sent.experts()[picked], x=x, w=w,
                              got=out[picked])
        return Checked(out, sampled=sampled, work_bytes=work, z=z)

    def audit(self, s: SampledRows) -> session_pb2.QuarantineRequest | None:
        """Audit the sampled rows of one answer: None if they pass, else the evidence."""
        # CPU time of this thread: audits run beside the decode at a lower priority, so their
        # wall time would count the time other threads had the core.
        t0 = time.thread_time()
        with torch.inference_mode():  # another thread than the decode's: no autograd here either
            verdict = self._audit(s)
        with self._lock:
            self.audit_seconds += time.thread_time() - t0
            self.audited_rows += verdict.rows
            self.audit_exact_rows += verdict.exact
        if verdict.passed:
            return None
        expert = int(s.experts[(s.picked == verdict.row).nonzero()[0, 0]])
        return session_pb2.QuarantineRequest(
            session_id=s.session_id, layer=s.layer, call_id=s.call_id,
            violation=session_pb2.VIOLATION_AUDIT_MISMATCH, row=verdict.row, expert=expert,
            max_abs_diff=verdict.max_abs_diff, tolerance=verdict.tolerance,
            detail=(f"audited row {verdict.row} of {s.call_rows}: |partial - recomputed| "
                    f"{verdict.max_abs_diff:.3g} > tolerance {verdict.tolerance:.3g}"))

    def _by_expert(self, layer: int, experts: torch.Tensor) -> Iterator[tuple[torch.Tensor, ExpertTensors]]:
        """For each expert among ``experts`` (one per row): which rows (a mask) and its
        weights ``(gate_up, down, biases)``, read without keeping them (audits touch a sampled few)."""
        for e in experts.unique().tolist():
            yield experts == e, (*self._weights.get(layer, e, keep=False), self._weights.biases(layer, e))

    def _recompute(self, layer: int, fn: ExpertFunction, sent: SentCall, picked: torch.Tensor) -> torch.Tensor:
        """This backbone's kernel on assignments ``picked`` of a call, in the wire dtype."""
        x, w = sent.inputs(picked)
        result = torch.empty(len(picked), x.shape[1], dtype=sent.rows.dtype)
        for sel, (gate_up, down, biases) in self._by_expert(layer, sent.experts()[picked]):
            part = expert_forward(x[sel].to(gate_up.dtype), gate_up, down, fn, w[sel].to(gate_up.dtype), biases)
            result[sel] = part.to(result.dtype)
        return result

    def _audit(self, s: SampledRows) -> AuditResult:
        """Audit the sampled rows, expert by expert; the first failure, or a pass."""
        rows = exact = 0
        for sel, (gate_up, down, biases) in self._by_expert(s.layer, s.experts):
            v = audit_rows(s.got[sel], s.x[sel], gate_up, down, s.fn, s.w[sel], s.picked[sel].tolist(), biases)
            rows += v.rows
            exact += v.exact
            if not v.passed:
                return dataclasses.replace(v, rows=rows, exact=exact)
        return AuditResult(True, rows, exact, int(s.picked[0]), 0.0, 0.0)


def _tensors(msg: Answer, projections: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An answer's partials and, when the call asked for them (``projections``), its
    projections, as tensors. Raises TensorCodecError when they do not decode or the
    projections are missing."""
    if isinstance(msg, ComputedPartials):
        got, proj = msg.partials, msg.projections
    else:
        got = decode_tensor(msg.partials)
        proj = decode_tensor(msg.projections) if projections and msg.HasField("projections") else None
    if projections and proj is None:
        raise TensorCodecError("no projections: the worker announced them and the call asked for them")
    return got, proj if projections else None
