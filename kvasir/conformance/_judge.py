"""How the check judges a worker's answer: its partials against the reference kernel on the
checkpoint, within the backbone's audit tolerance (``judge_partials``), and its projections by
the row checks the backbone runs (``judge_projections``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvasir.conformance._calls import _Call
    from kvasir_rpc import ExpertFunction, ExpertIndex


class _IndexWeights:
    """The checkpoint's experts as the row checks read them (backbone's ExpertWeights)."""

    def __init__(self, experts: ExpertIndex) -> None:
        self._experts = experts

    def num_experts(self, layer: int) -> int:
        return self._experts.info.num_experts

    def get(self, layer: int, expert: int, *, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        return self._experts.load(layer, expert)

    def biases(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._experts.biases(layer, expert)


def judge_projections(call: _Call, partials: torch.Tensor, answer: Any, experts: ExpertIndex,
                      fn: ExpertFunction) -> tuple[bool, str]:
    """The row checks the backbone runs on every row of an answer whose projections it asked
    for (docs/PROTOCOL.md 11.1), on a call's answer: ``(passed, why not)``."""
    import torch

    from kvasir_rpc import RowChecker, TensorCodecError, decode_tensor

    cid = call.request.call_id
    if not answer.HasField("projections"):
        return False, (f"call {cid} ({call.name}) asked for projections (the hello announced them) and the answer "
                       "has none: ExpertPartials.projections, [assignments, 2 x intermediate] (PROTOCOL.md 9.2)")
    try:
        got = decode_tensor(answer.projections)
    except TensorCodecError as exc:
        return False, f"call {cid} ({call.name}): malformed projections: {exc}"
    rows = sum(n for _, n in call.segments)
    want = (rows, 2 * experts.info.intermediate_size)
    if tuple(got.shape) != want or got.dtype != call.hidden.dtype:
        return False, (f"call {cid} ({call.name}): projections of shape {list(got.shape)} {got.dtype}, expected "
                       f"{list(want)} {call.hidden.dtype}")
    x = call.hidden if call.row_index is None else call.hidden[call.row_index]
    ids = torch.tensor([e for e, n in call.segments for _ in range(n)], dtype=torch.long)
    verdict = RowChecker(_IndexWeights(experts)).check(call.layer, fn, x, call.weights, ids, partials, got)
    if not verdict.passed:
        return False, (f"call {cid} ({call.name}), layer {call.layer}: the row checks fail: {verdict.detail} "
                       "(PROTOCOL.md 11.1: the projections must be [g | u], all gates then all ups, biases added, "
                       "and the partials computed from them)")
    return True, ""


def judge_partials(call: _Call, got: torch.Tensor, experts: ExpertIndex, fn: ExpertFunction) -> tuple[bool, str]:
    """Compare a worker's partials for ``call`` with the reference kernel on the checkpoint.

    Returns ``(passed, note)``: bit-equal passes with an empty note; within the backbone's audit
    tolerance passes with a note; anything else fails, the note naming the worst element."""
    import torch

    from kvasir_rpc import audit_rows, expert_forward

    rows = sum(n for _, n in call.segments)
    want = (rows, call.hidden.shape[1])
    if tuple(got.shape) != want or got.dtype != call.hidden.dtype:
        return False, (f"call {call.request.call_id} ({call.name}): partials of shape {list(got.shape)} "
                       f"{got.dtype}, expected {list(want)} {call.hidden.dtype} (one row per assignment, "
                       "in the request's dtype)")
    exact, start = 0, 0
    worst: tuple[float, str] | None = None
    for expert, n in call.segments:
        picked = torch.arange(start, start + n) if call.row_index is None else call.row_index[start : start + n]
        x, w, g = call.hidden[picked], call.weights[start : start + n], got[start : start + n]
        gate_up, down = experts.load(call.layer, expert)
        biases = experts.biases(call.layer, expert)
        verdict = audit_rows(g, x, gate_up, down, fn, w, list(range(start, start + n)), biases)
        exact += verdict.exact
        if not verdict.passed:
            ref = expert_forward(x.to(gate_up.dtype), gate_up, down, fn, w.to(gate_up.dtype), biases).to(got.dtype)
            diff = torch.nan_to_num((g - ref).abs().float(), nan=float("inf"))
            r, c = divmod(int(diff.argmax()), diff.shape[1])
            gap = float(diff[r, c])
            if worst is None or gap > worst[0]:
                worst = (gap, (f"call {call.request.call_id} ({call.name}), layer {call.layer} expert {expert}, "
                               f"assignment row {start + r} column {c}: got {float(g[r, c])!r}, the reference "
                               f"kernel gives {float(ref[r, c])!r} (|diff| {gap:.3g}; the backbone's audit "
                               f"allows {verdict.tolerance:.3g} on its worst element)"))
        start += n
    if worst is not None:
        return False, worst[1]
    if exact < rows:
        return True, (f"call {call.request.call_id} ({call.name}): {rows - exact} of {rows} rows within the "
                      "backbone's audit tolerance but not bit-exact: a backbone's --compare-local gives the verdict "
                      "'within the audit bound, tokens identical' (a pass; --require-bitwise fails it)")
    return True, ""
