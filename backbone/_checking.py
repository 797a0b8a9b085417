"""Checking a worker's answer to one call before its partials are used or paid.

Whole-answer checks first (it decodes, has the expected shape and dtype, every value is
finite unless this backbone's own result overflows alike), then the sampled audit of
``_audit.py``. A refused answer comes with the evidence the hub is sent.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import torch

from kvasir_rpc import (
    Activation,
    Route,
    TensorCodecError,
    all_finite,
    decode_tensor,
    expert_forward,
    expert_pb2,
    session_pb2,
)
from backbone._audit import AuditResult, RowSampler, audit_rows
from backbone._links import CallRecord, WorkerLink
from backbone._weights import ExpertWeights

__all__ = ["AnswerChecker", "SentCall"]


@dataclasses.dataclass
class SentCall:
    """What left for one remote call, kept until its answer is checked."""

    record: CallRecord
    routes: list[Route]  # the call's segments, in order
    link: WorkerLink
    rows: torch.Tensor  # [distinct, H] as sent (wire dtype)
    weights: torch.Tensor  # [assignments] as sent
    index: torch.Tensor | None  # [assignments] row of `rows` per assignment, or None: the identity
    request_bytes: int

    def inputs(self, picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sent rows and routing weights of assignments ``picked`` (as the worker got them)."""
        x = self.rows[picked] if self.index is None else self.rows[self.index[picked]]
        return x, self.weights[picked]

    def expert_of(self, row: int) -> int:
        """The expert whose segment holds assignment ``row``."""
        start = 0
        for r in self.routes:
            start += len(r.token_idx)
            if row < start:
                return r.expert
        return self.routes[-1].expert


@dataclasses.dataclass(frozen=True)
class CheckStats:
    audited_rows: int
    audit_exact_rows: int
    audit_seconds: float


class AnswerChecker:
    """Accepts or refuses answers; counts what it audited. Thread-safe."""

    def __init__(self, weights: ExpertWeights, audit_rate: float) -> None:
        self._weights = weights
        self._sampler = RowSampler(audit_rate)
        self._lock = threading.Lock()
        self.reset_counters()

    def reset_counters(self) -> None:
        with self._lock:
            self.audited_rows = self.audit_exact_rows = 0
            self.audit_seconds = 0.0

    def statistics(self) -> CheckStats:
        with self._lock:
            return CheckStats(self.audited_rows, self.audit_exact_rows, round(self.audit_seconds, 4))

    def check(self, layer: int, act: Activation, sent: SentCall, msg: expert_pb2.ExpertPartials,
              width: int) -> tuple[torch.Tensor | None, session_pb2.QuarantineRequest | None]:
        """The answer's partials [assignments, width] in the wire dtype if accepted, else
        ``(None, evidence against the worker)``."""
        rec = sent.record
        evidence = session_pb2.QuarantineRequest(session_id=sent.link.session_id, layer=layer, call_id=rec.call_id)
        sent_dtype = sent.rows.dtype
        try:
            out = decode_tensor(msg.partials)
            if out.shape != (rec.rows, width) or out.dtype != sent_dtype:
                raise TensorCodecError(f"partials of shape {list(out.shape)} {out.dtype}, expected "
                                       f"[{rec.rows}, {width}] {sent_dtype}")
        except TensorCodecError as exc:
            evidence.violation = session_pb2.VIOLATION_MALFORMED
            evidence.detail = str(exc)[:300]
            return None, evidence
        if not all_finite(out):
            # Wrong unless this backbone's own result is just as non-finite (an honest overflow).
            mine = self._recompute(layer, act, sent, torch.arange(rec.rows))
            if all_finite(mine) or not torch.equal(mine.isfinite(), out.isfinite()):
                bad = int((~out.isfinite()).any(dim=-1).nonzero()[0, 0])
                evidence.violation = session_pb2.VIOLATION_NON_FINITE
                evidence.row = bad
                evidence.expert = sent.expert_of(bad)
                evidence.max_abs_diff = float("inf")
                evidence.detail = f"row {bad} of {rec.rows} holds NaN or Inf; this backbone's result is finite"
                return None, evidence
        picked = self._sampler.choose(sent.link.session_id, rec.rows)
        if picked.numel():
            t0 = time.perf_counter()
            verdict = self._audit(layer, act, sent, out, picked)
            with self._lock:
                self.audit_seconds += time.perf_counter() - t0
                self.audited_rows += verdict.rows
                self.audit_exact_rows += verdict.exact
            if not verdict.passed:
                evidence.violation = session_pb2.VIOLATION_AUDIT_MISMATCH
                evidence.row = verdict.row
                evidence.expert = sent.expert_of(verdict.row)
                evidence.max_abs_diff = verdict.max_abs_diff
                evidence.tolerance = verdict.tolerance
                evidence.detail = (f"audited row {verdict.row} of {rec.rows}: |partial - recomputed| "
                                   f"{verdict.max_abs_diff:.3g} > tolerance {verdict.tolerance:.3g}")
                return None, evidence
        return out, None

    def _by_expert(self, layer: int, sent: SentCall,
                   picked: torch.Tensor) -> Iterator[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]:
        """For each expert among assignments ``picked``: which of them (a mask over
        ``picked``) and its weights, read without keeping them (audits touch a sampled few)."""
        expert_of = torch.cat([torch.full((len(r.token_idx),), r.expert) for r in sent.routes])[picked]
        for e in expert_of.unique().tolist():
            yield expert_of == e, self._weights.get(layer, e, keep=False)

    def _recompute(self, layer: int, act: Activation, sent: SentCall, picked: torch.Tensor) -> torch.Tensor:
        """This backbone's kernel on assignments ``picked`` of a call, in the wire dtype."""
        x, w = sent.inputs(picked)
        result = torch.empty(len(picked), x.shape[1], dtype=sent.rows.dtype)
        for sel, (gate_up, down) in self._by_expert(layer, sent, picked):
            part = expert_forward(x[sel].to(gate_up.dtype), gate_up, down, act, w[sel].to(gate_up.dtype))
            result[sel] = part.to(result.dtype)
        return result

    def _audit(self, layer: int, act: Activation, sent: SentCall, out: torch.Tensor,
               picked: torch.Tensor) -> AuditResult:
        """Audit rows ``picked`` of an answer, expert by expert; the first failure, or a pass."""
        x, w = sent.inputs(picked)
        rows = exact = 0
        for sel, (gate_up, down) in self._by_expert(layer, sent, picked):
            v = audit_rows(out[picked[sel]], x[sel], gate_up, down, act, w[sel], picked[sel].tolist())
            rows += v.rows
            exact += v.exact
            if not v.passed:
                return dataclasses.replace(v, rows=rows, exact=exact)
        return AuditResult(True, rows, exact, int(picked[0]), 0.0, 0.0)
