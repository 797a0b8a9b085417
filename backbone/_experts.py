"""The backbone's experts implementation, plugged into transformers' ExpertsInterface.

The router has already run (transformers' own gate); this function receives its decisions
and owns the rest: which expert computes where, batched calls per worker, local compute
while remote calls fly, fallback to local weights for anything lost, and one fixed
combination order whatever the placement.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import threading
import time
from collections.abc import Iterable

import torch
from transformers.integrations.moe import ExpertsInterface

from kvasir_rpc import (
    ExpertIndex,
    Route,
    TensorCodecError,
    all_finite,
    decode_tensor,
    encode_tensor,
    expert_digest,
    expert_forward,
    expert_pb2,
    get_logger,
    plan_routes,
    session_pb2,
    slices_digest,
)
from backbone._audit import DEFAULT_AUDIT_RATE, AuditResult, RowSampler, audit_rows
from backbone._links import CallRecord, SessionWatcher, WorkerLink
from backbone._work import WorkReporter

__all__ = ["IMPLEMENTATION", "Dispatcher", "DispatchStats", "ReplayNeeded", "install"]

log = get_logger("backbone.experts")

IMPLEMENTATION = "kvasir"


def _expert_weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] of an experts module."""
    gate_up, down = module.gate_up_proj, module.down_proj
    assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    return gate_up, down


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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
    audit_seconds: float = 0.0
    sessions_quarantined: tuple[str, ...] = ()
    replays: int = 0


class ReplayNeeded(RuntimeError):
    """A session this decode used was caught delivering wrong work: everything it touched
    must be recomputed without it (the decode restarts from the prompt)."""


@dataclasses.dataclass
class _Sent:
    """What left for one remote call, kept until its answer is checked."""

    record: CallRecord
    routes: list[Route]
    link: WorkerLink
    rows: torch.Tensor  # [distinct, H] as sent (wire dtype)
    weights: torch.Tensor  # [assignments] as sent
    index: torch.Tensor | None  # [assignments] row of `rows` per assignment, or None: the identity
    request_bytes: int


class Dispatcher:
    """Places (layer, expert) slices on live worker sessions and runs the experts path.

    ``remote=False`` computes every expert locally through the same kernel (the reference
    the remote run must equal bitwise).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        watcher: SessionWatcher | None,
        *,
        call_timeout_s: float = 30.0,
        wire_dtype: torch.dtype | None = None,
        expert_source: ExpertIndex | None = None,
        audit_rate: float = DEFAULT_AUDIT_RATE,
        reporter: WorkReporter | None = None,
    ) -> None:
        self.watcher = watcher
        self.reporter = reporter
        self._sampler = RowSampler(audit_rate)
        # Replaced, never mutated: decode threads read it without the lock.
        self._quarantined: frozenset[str] = frozenset()
        # Sessions whose answers the current decode attempt of this thread used.
        self._attempt = threading.local()
        self.audited_rows = self.audit_exact_rows = self.replays = 0
        self.audit_seconds = 0.0
        # None: activations travel in the model's dtype (bit-exact). bfloat16/float16 for a
        # float32 model halves the bytes and is not bit-exact.
        self.wire_dtype = wire_dtype
        self.call_timeout_s = call_timeout_s
        self.remote = watcher is not None
        self._experts: dict[int, torch.nn.Module] = {}
        for name, module in model.named_modules():
            if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and (m := _LAYER.search(name)):
                layer = int(m[1])
                self._experts[layer] = module
                module._kvasir = (self, layer)  # type: ignore[assignment]
        if not self._experts:
            raise ValueError("the model has no experts modules with gate_up_proj/down_proj")
        self._defer_shared(model)
        self._digests: dict[tuple[int, int], bytes] = {}
        self._links: dict[str, WorkerLink] = {}
        self._rejected: set[str] = set()
        self._seen_version = -1
        self._routes: dict[int, dict[int, WorkerLink]] = {}
        self._lock = threading.Lock()
        self._calls: list[CallRecord] = []
        self.remote_calls = self.remote_rows = self.local_rows = 0
        self.fallback_calls = self.fallback_rows = 0
        self.shared_overlapped = 0
        self._used: set[str] = set()
        self._stats_lock = threading.Lock()
        # On-demand experts: the model's expert tensors are dropped (meta) and an expert is
        # read from the checkpoint the first time this backbone has to compute it, so
        # resident memory follows the dense part plus the experts computed here.
        self._source = expert_source
        self._loaded: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._load_lock = threading.Lock()
        if expert_source is not None:
            for module in self._experts.values():
                gate_up, down = _expert_weights(module)
                module.gate_up_proj = torch.nn.Parameter(torch.empty(gate_up.shape, device="meta"), requires_grad=False)
                module.down_proj = torch.nn.Parameter(torch.empty(down.shape, device="meta"), requires_grad=False)
            gc.collect()

    # -- shared experts, computed while the remote calls fly --------------------------------

    def _defer_shared(self, model: torch.nn.Module) -> None:
        """Qwen3.5-style blocks compute ``shared_expert(x)`` before they call the experts and
        use it only after the experts return. With remote experts its compute is moved into
        this layer's experts call, after the remote calls leave: the shared expert's
        ``forward`` (an instance attribute; modules and weights stay as they are) returns an
        empty tensor of the right shape and notes its input; ``forward`` below fills that
        tensor with the shared expert's own output, same ops on the same input, so the
        result is bitwise unchanged. A hook on the block checks that the tensor was filled
        before the block returns and raises otherwise, should a later transformers
        change the order."""
        self._pending = threading.local()
        for name, block in model.named_modules():
            shared = getattr(block, "shared_expert", None)
            experts = getattr(block, "experts", None)
            m = _LAYER.search(name + ".")
            if not isinstance(shared, torch.nn.Module) or getattr(experts, "_kvasir", None) is None or m is None:
                continue
            layer = int(m[1])
            previous = getattr(shared, "_kvasir_shared", None)
            if previous is not None:  # a Dispatcher attached to this model before: replace it
                compute, handle = previous
                handle.remove()
            else:
                compute = shared.forward
            shared.forward = self._deferred(layer, compute, experts)  # type: ignore[method-assign]
            handle = block.register_forward_hook(self._check_filled(layer))
            shared._kvasir_shared = (compute, handle)  # type: ignore[assignment]

    def _deferred(self, layer: int, compute, experts: object):  # type: ignore[no-untyped-def]
        config = getattr(experts, "config", None)

        def forward(x: torch.Tensor) -> torch.Tensor:
            ours = getattr(config, "_experts_implementation", None) == IMPLEMENTATION
            pending = self._pending.__dict__.setdefault("by_layer", {})
            if not (self.remote and ours) or torch.is_grad_enabled():
                pending.pop(layer, None)  # nothing stale from a forward that raised
                return compute(x)
            out = torch.empty_like(x)
            pending[layer] = (compute, x, out)
            return out

        return forward

    def _check_filled(self, layer: int):  # type: ignore[no-untyped-def]
        def hook(module: torch.nn.Module, args: object, output: object) -> None:
            if self._pending.__dict__.get("by_layer", {}).pop(layer, None) is not None:
                raise RuntimeError(f"layer {layer}: the shared expert's output was used before the experts call "
                                   "computed it; this transformers version orders the MoE block differently")

        return hook

    def _run_shared(self, layer: int) -> None:
        pending = self._pending.__dict__.get("by_layer", {}).pop(layer, None)
        if pending is not None:
            compute, x, out = pending
            out.copy_(compute(x))
            with self._stats_lock:
                self.shared_overlapped += 1

    def _weights(self, module: torch.nn.Module, layer: int, expert: int, *,
                 keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's ``(gate_up [2I, H], down [H, I])``: the model's, or read on demand.
        ``keep=False`` (audits, which touch a sampled few) reads an expert not already held
        without keeping it, so auditing does not grow the backbone's memory."""
        if self._source is None:
            gate_up, down = _expert_weights(module)
            return gate_up[expert], down[expert]
        key = (layer, expert)
        with self._load_lock:
            if key not in self._loaded:
                if not keep:
                    return self._source.load(layer, expert)
                self._loaded[key] = self._source.load(layer, expert)
            return self._loaded[key]

    def drop_loaded(self) -> None:
        """Forget experts read on demand (after a measurement that computed them all here)."""
        with self._load_lock:
            self._loaded.clear()
        gc.collect()

    def expert_bytes_held(self) -> int:
        """Bytes of expert weights this process holds in memory."""
        if self._source is None:
            return sum(t.numel() * t.element_size() for m in self._experts.values() for t in _expert_weights(m))
        return sum(t.numel() * t.element_size() for pair in self._loaded.values() for t in pair)

    # -- placement -------------------------------------------------------------------

    def _expected_digest(self, slices: dict[int, tuple[int, ...]]) -> bytes | None:
        digests = {}
        for layer, experts in slices.items():
            module = self._experts.get(layer)
            if module is None:
                return None
            num_experts = _expert_weights(module)[0].shape[0]
            for e in experts:
                if e >= num_experts:
                    return None
                key = (layer, e)
                if key not in self._digests:
                    if self._source is not None:
                        self._digests[key] = self._source.expert_digest(layer, e)
                    else:
                        self._digests[key] = expert_digest(*self._weights(module, layer, e))
                digests[key] = self._digests[key]
        return slices_digest(digests)

    def _refresh(self) -> None:
        """Rebuild the route table when the hub's session set changed."""
        assert self.watcher is not None
        if self.watcher.version == self._seen_version:
            return
        self._seen_version = self.watcher.version
        live = self.watcher.sessions()
        for sid in list(self._links):
            if sid not in live:
                self._links.pop(sid).close()
        for sid, s in sorted(live.items(), key=lambda kv: (kv[1].connected_since_unix_ms, kv[0])):
            if sid in self._links or sid in self._rejected or sid in self._quarantined:
                continue
            link_slices = {sl.layer: tuple(sl.experts) for sl in s.slices}
            expected = self._expected_digest(link_slices)
            if expected is None or expected != s.weights_digest:
                log.warning("session weights do not match this model; not routing to it", session_id=sid,
                            wallet=s.wallet)
                self._rejected.add(sid)
                continue
            self._links[sid] = WorkerLink(s, token=self.watcher.token)
        routes: dict[int, dict[int, WorkerLink]] = {}
        for link in self._links.values():
            if link.dead is not None:
                continue
            for layer, experts in link.slices.items():
                for e in experts:
                    routes.setdefault(layer, {}).setdefault(e, link)
        self._routes = routes

    # -- the experts path ------------------------------------------------------------

    def forward(
        self, module: torch.nn.Module, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        self.check_attempt()
        routes = plan_routes(top_k_index, _expert_weights(module)[0].shape[0])
        placed: dict[WorkerLink, list[Route]] = {}
        local: list[Route] = []
        if self.remote:
            with self._lock:
                self._refresh()
                table = self._routes.get(layer, {})
            for r in routes:
                link = table.get(r.expert)
                if link is not None and link.dead is None:
                    placed.setdefault(link, []).append(r)
                else:
                    local.append(r)
        else:
            local = routes

        # Remote calls leave first: one batched call per worker for this layer.
        inflight: list[_Sent] = []
        for link, rs in placed.items():
            tokens = torch.cat([r.token_idx for r in rs])  # one per assignment, in segment order
            # A token routed to several of this worker's experts travels once.
            distinct, index = torch.unique(tokens, return_inverse=True)
            dedupe = distinct.numel() < tokens.numel()
            rows = hidden[distinct] if dedupe else hidden[tokens]  # [n, H]
            if self.wire_dtype is not None and rows.dtype != self.wire_dtype:
                rows = rows.to(self.wire_dtype)
            weights = torch.cat([top_k_weights[r.token_idx, r.top_k_pos] for r in rs])  # [assignments]
            req = expert_pb2.DispatchRequest(
                layer=layer,
                hidden=encode_tensor(rows),
                weights=encode_tensor(weights),
                segments=[expert_pb2.ExpertSegment(expert=r.expert, rows=len(r.token_idx)) for r in rs],
                row_index=index.tolist() if dedupe else (),
            )
            size = req.ByteSize()
            inflight.append(_Sent(link.submit(layer, req), rs, link, rows, weights, index if dedupe else None, size))

        self._run_shared(layer)  # while the calls fly
        partials: dict[int, torch.Tensor] = {}
        for r in local:
            partials[r.expert] = self._local(module, layer, hidden, top_k_weights, r)
        with self._stats_lock:
            self.local_rows += sum(len(r.token_idx) for r in local)

        replay = False
        for sent in inflight:
            rec, rs, link = sent.record, sent.routes, sent.link
            try:
                msg = rec.future.result(timeout=self.call_timeout_s)
            except Exception as exc:  # timeout or stream failure: recompute here
                self._lost(link, layer, rec, exc)
                out, violation = None, None
            else:
                out, violation = self._check(module, layer, hidden, sent, msg)
            if violation is not None:
                replay |= self._quarantine(link, violation)
            if out is None:  # lost or refused: recomputed here, not paid
                with self._stats_lock:
                    self.fallback_calls += 1
                    self.fallback_rows += rec.rows
                for r in rs:
                    partials[r.expert] = self._local(module, layer, hidden, top_k_weights, r)
                continue
            assert out is not None
            # Paid: the request as sent and the partials at exactly their expected size.
            work = sent.request_bytes + out.numel() * out.element_size()
            if out.dtype != hidden.dtype:
                out = out.to(hidden.dtype)
            start = 0
            for r in rs:
                n = len(r.token_idx)
                partials[r.expert] = out[start : start + n]
                start += n
            with self._stats_lock:
                self.remote_calls += 1
                self.remote_rows += rec.rows
                self._used.add(link.session_id)
            self._attempt_sessions().add(link.session_id)
            if self.reporter is not None:
                self.reporter.accepted(link.session_id, work, rec.rows)
        if replay:
            raise ReplayNeeded("a worker this decode used was caught delivering wrong work")

        # One fixed order, whatever ran where: ascending expert, as transformers' eager.
        final = torch.zeros_like(hidden)
        for r in routes:
            final.index_add_(0, r.token_idx, partials[r.expert].to(final.dtype))
        return final

    # -- checking answers --------------------------------------------------------------

    def _lost(self, link: WorkerLink, layer: int, rec: CallRecord, exc: BaseException) -> None:
        log.warning("remote call lost; computing locally", session_id=link.session_id, layer=layer,
                    rows=rec.rows, error=repr(exc)[:200])
        link._fail(exc)
        with self._lock:
            self._seen_version = -1  # rebuild routes without this link

    def _check(self, module: torch.nn.Module, layer: int, hidden: torch.Tensor, sent: _Sent,
               msg: expert_pb2.ExpertPartials) -> tuple[torch.Tensor | None, session_pb2.QuarantineRequest | None]:
        """The answer's partials if they are accepted, else the evidence against the worker.

        Whole-answer checks first (shape, dtype, finiteness), then the sampled audit."""
        rec = sent.record
        evidence = session_pb2.QuarantineRequest(session_id=sent.link.session_id, layer=layer, call_id=rec.call_id)
        sent_dtype = sent.rows.dtype
        try:
            out = decode_tensor(msg.partials)
            if out.shape != (rec.rows, hidden.shape[1]) or out.dtype != sent_dtype:
                raise TensorCodecError(f"partials of shape {list(out.shape)} {out.dtype}, expected "
                                       f"[{rec.rows}, {hidden.shape[1]}] {sent_dtype}")
        except TensorCodecError as exc:
            evidence.violation = session_pb2.VIOLATION_MALFORMED
            evidence.detail = str(exc)[:300]
            return None, evidence
        if not all_finite(out):
            # Wrong unless this backbone's own result is just as non-finite (an honest overflow).
            mine = self._recompute(module, layer, sent, torch.arange(rec.rows))
            if all_finite(mine) or not torch.equal(mine.isfinite(), out.isfinite()):
                bad = int((~out.isfinite()).any(dim=-1).nonzero()[0, 0])
                evidence.violation = session_pb2.VIOLATION_NON_FINITE
                evidence.row = bad
                evidence.expert = self._expert_of(sent, bad)
                evidence.max_abs_diff = float("inf")
                evidence.detail = f"row {bad} of {rec.rows} holds NaN or Inf; this backbone's result is finite"
                return None, evidence
        picked = self._sampler.choose(sent.link.session_id, rec.rows)
        if picked.numel():
            t0 = time.perf_counter()
            verdict = self._audit(module, layer, sent, out, picked)
            with self._stats_lock:
                self.audit_seconds += time.perf_counter() - t0
                self.audited_rows += verdict.rows
                self.audit_exact_rows += verdict.exact
            if not verdict.passed:
                evidence.violation = session_pb2.VIOLATION_AUDIT_MISMATCH
                evidence.row = verdict.row
                evidence.expert = self._expert_of(sent, verdict.row)
                evidence.max_abs_diff = verdict.max_abs_diff
                evidence.tolerance = verdict.tolerance
                evidence.detail = (f"audited row {verdict.row} of {rec.rows}: |partial - recomputed| "
                                   f"{verdict.max_abs_diff:.3g} > tolerance {verdict.tolerance:.3g}")
                return None, evidence
        return out, None

    def _expert_of(self, sent: _Sent, row: int) -> int:
        start = 0
        for r in sent.routes:
            start += len(r.token_idx)
            if row < start:
                return r.expert
        return sent.routes[-1].expert

    def _inputs(self, sent: _Sent, picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sent rows and routing weights of assignments ``picked`` (as the worker got them)."""
        x = sent.rows[picked] if sent.index is None else sent.rows[sent.index[picked]]
        return x, sent.weights[picked]

    def _by_expert(self, module: torch.nn.Module, layer: int, sent: _Sent, picked: torch.Tensor):  # type: ignore[no-untyped-def]
        """For each expert among assignments ``picked``: which of them (a mask over
        ``picked``) and its weights, read without keeping them (audits touch a sampled few)."""
        expert_of = torch.cat([torch.full((len(r.token_idx),), r.expert) for r in sent.routes])[picked]
        for e in expert_of.unique().tolist():
            yield expert_of == e, self._weights(module, layer, e, keep=False)

    def _recompute(self, module: torch.nn.Module, layer: int, sent: _Sent, picked: torch.Tensor) -> torch.Tensor:
        """This backbone's kernel on assignments ``picked`` of a call, in the wire dtype."""
        x, w = self._inputs(sent, picked)
        act = module.act_fn
        assert callable(act)
        result = torch.empty(len(picked), x.shape[1], dtype=sent.rows.dtype)
        for sel, (gate_up, down) in self._by_expert(module, layer, sent, picked):
            part = expert_forward(x[sel].to(gate_up.dtype), gate_up, down, act, w[sel].to(gate_up.dtype))
            result[sel] = part.to(result.dtype)
        return result

    def _audit(self, module: torch.nn.Module, layer: int, sent: _Sent, out: torch.Tensor,
               picked: torch.Tensor) -> AuditResult:
        """Audit rows ``picked`` of an answer, expert by expert; the first failure, or a pass."""
        x, w = self._inputs(sent, picked)
        act = module.act_fn
        assert callable(act)
        rows = exact = 0
        for sel, (gate_up, down) in self._by_expert(module, layer, sent, picked):
            v = audit_rows(out[picked[sel]], x[sel], gate_up, down, act, w[sel], picked[sel].tolist())
            rows += v.rows
            exact += v.exact
            if not v.passed:
                return dataclasses.replace(v, rows=rows, exact=exact)
        return AuditResult(True, rows, exact, int(picked[0]), 0.0, 0.0)

    def _quarantine(self, link: WorkerLink, evidence: session_pb2.QuarantineRequest) -> bool:
        """Stop using a session that delivered wrong work and report it with the evidence.
        True when the current decode attempt used it (its results must be replayed)."""
        sid = link.session_id
        with self._lock:
            first = sid not in self._quarantined
            self._quarantined = self._quarantined | {sid}
            self._seen_version = -1
            dropped = self._links.pop(sid, None)
        link._fail(RuntimeError(f"session {sid} quarantined"))
        if first:
            evidence.audited_rows = self.audited_rows
            log.error("worker delivered wrong work: quarantined", session_id=sid, wallet=link.wallet,
                      violation=session_pb2.Violation.Name(evidence.violation), layer=evidence.layer,
                      expert=evidence.expert, call_id=evidence.call_id, row=evidence.row,
                      max_abs_diff=evidence.max_abs_diff, tolerance=evidence.tolerance, detail=evidence.detail)
            if self.reporter is not None:
                self.reporter.quarantine(evidence)
            if dropped is not None:
                threading.Thread(target=dropped.close, name=f"close-{sid}", daemon=True).start()
        return sid in self._attempt_sessions()

    # -- decode attempts (replays) -----------------------------------------------------

    def _attempt_sessions(self) -> set[str]:
        used: set[str] | None = getattr(self._attempt, "used", None)
        if used is None:
            used = self._attempt.used = set()
        return used

    def begin_attempt(self) -> None:
        """A decode (attempt) starts in this thread: nothing it uses is tainted yet."""
        self._attempt.used = set()

    def check_attempt(self) -> None:
        """Raise ReplayNeeded if this thread's decode attempt used a session since quarantined
        (by any thread): its results are not to be trusted."""
        quarantined = self._quarantined
        if quarantined and not quarantined.isdisjoint(self._attempt_sessions()):
            raise ReplayNeeded("a session this decode used was quarantined")

    def note_replay(self) -> None:
        with self._stats_lock:
            self.replays += 1

    def _local(self, module: torch.nn.Module, layer: int, hidden: torch.Tensor, top_k_weights: torch.Tensor,
               r: Route) -> torch.Tensor:
        gate_up, down = self._weights(module, layer, r.expert)
        act = module.act_fn
        assert callable(act)
        return expert_forward(hidden[r.token_idx], gate_up, down, act, top_k_weights[r.token_idx, r.top_k_pos])

    def reset_counters(self) -> None:
        self.remote_calls = self.remote_rows = self.local_rows = 0
        self.fallback_calls = self.fallback_rows = 0
        self.shared_overlapped = 0
        self.audited_rows = self.audit_exact_rows = self.replays = 0
        self.audit_seconds = 0.0
        self._used = set()

    def statistics(self) -> DispatchStats:
        return DispatchStats(
            remote_calls=self.remote_calls,
            remote_rows=self.remote_rows,
            expert_bytes_held=self.expert_bytes_held(),
            local_rows=self.local_rows,
            fallback_calls=self.fallback_calls,
            fallback_rows=self.fallback_rows,
            sessions_used=tuple(sorted(self._used)),
            sessions_rejected=tuple(sorted(self._rejected)),
            shared_overlapped=self.shared_overlapped,
            audited_rows=self.audited_rows,
            audit_exact_rows=self.audit_exact_rows,
            audit_seconds=round(self.audit_seconds, 4),
            sessions_quarantined=tuple(sorted(self._quarantined)),
            replays=self.replays,
        )

    def links(self) -> Iterable[WorkerLink]:
        return list(self._links.values())

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()


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
