"""How far a stranger's partials may lie from this machine's own: the audit's tolerance.

The comparison: a row equal bit for bit to this backbone's own kernel passes at once (the
same exact path, as on one machine). Otherwise it must lie within a bound derived from the
dtype and the reduction sizes, element by element, against this backbone's own result::

    |partial - reference| <= C * u_c * E + C * u_c * |reference|     (partials in the compute dtype)
    |partial - reference| <= C * u_c * E + 2 * u_w * |reference|     (partials narrowed on the wire)

``u_c`` is the unit roundoff of the dtype the expert computes in (2^-24 for float32),
``u_w`` that of the narrower dtype the partials travel in (bfloat16 partials of a float32
model): an honest narrowed partial is the round-to-nearest of a value within ``C u_c E`` of
the backbone's, so at most one unit in the last place (``2 u_w |reference|`` bounds it) from
the backbone's own rounded result. ``C`` = ``TOLERANCE_FACTOR`` and ``E`` the
error scale of a float computation of the expert in any summation order: a dot product of
``n`` terms ``t`` errs by about ``sqrt(n) * ||t||_2`` roundoffs, and the gate/up errors are
carried through the activation and the down projection::

    E_g = sqrt(H) * sqrt(x^2 @ Wg^2.T)            (likewise E_u)         [rows, I]
    E_h = |act'(g)| |u| E_g + |act(g)| E_u + |h|                          [rows, I]
    E   = |w| * (sqrt(I) * sqrt(h^2 @ Wd^2.T) + sqrt(E_h^2 @ Wd^2.T)) + |out|

An honest float32 worker that sums in another order differs by at most 0.83 ``u_c * E`` from
the exact result (measured over the test sizes, on two BLAS paths; the backbone's own result
errs as much), so ``C`` = 8 leaves it a margin of five; a worker that adds 1e-3 to the
activation is off by thousands of them.
"""

from __future__ import annotations

import dataclasses

import torch

from kvasir_rpc._activation import Activation
from kvasir_rpc._function import ExpertFunction, as_function
from kvasir_rpc._kernel import expert_forward

__all__ = ["TOLERANCE_FACTOR", "AuditResult", "audit_rows", "error_scale"]

TOLERANCE_FACTOR = 8.0


def _unit_roundoff(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2


def error_scale(
    x: torch.Tensor,  # [n, H]
    gate_up: torch.Tensor,  # [2I, H] as stored (fn.matrices reads it)
    down: torch.Tensor,  # [H, I] as stored
    fn: Activation | ExpertFunction,
    w: torch.Tensor,  # [n]
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(reference, E)``: the expert's output and its error scale, both [n, H], computed in
    the inputs' dtype (E needs only its magnitude: float32 is plenty). With biases, each
    bias's addition adds one rounding of its sum; a gate of several operations (gpt-oss's)
    adds one rounding of h for each (``ExpertFunction.roundings``)."""
    fn = as_function(fn)
    wg, wu, wd = fn.matrices(gate_up, down)  # [I, H], [I, H], [H, I]
    hidden, inter = x.shape[1], wg.shape[0]
    g, u = x @ wg.T, x @ wu.T  # [n, I]
    x2 = x * x
    e_g = (hidden**0.5) * torch.sqrt(x2 @ (wg * wg).T)
    e_u = (hidden**0.5) * torch.sqrt(x2 @ (wu * wu).T)
    if biases is not None:
        b_g, b_u = fn.split(biases[0])
        e_g, e_u = e_g + (g + b_g).abs() + b_g.abs(), e_u + (u + b_u).abs() + b_u.abs()
        g, u = g + b_g, u + b_u
    a, b = fn.factors(g, u)
    step = 1e-3 * (1.0 + g.abs())
    slope = (fn.factors(g + step, u)[0] - fn.factors(g - step, u)[0]).abs() / (2 * step)
    h = a * b
    e_h = slope * b.abs() * e_g + a.abs() * e_u + (fn.roundings / 2) * h.abs()
    d2 = (wd * wd).T  # [I, H]
    y = h @ wd.T
    if biases is not None:
        y = y + biases[1]
    out = y * w[:, None]
    e = w.abs()[:, None] * ((inter**0.5) * torch.sqrt((h * h) @ d2) + torch.sqrt((e_h * e_h) @ d2)) + out.abs()
    if biases is not None:
        e = e + (w.abs()[:, None] * biases[1].abs())
    return out, e


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """The verdict on the audited rows of one call. ``row`` is the worst row (the first that
    failed, if any); ``max_abs_diff`` and ``tolerance`` are its worst element and that
    element's bound; ``exact`` rows matched this backbone's kernel bit for bit."""

    passed: bool
    rows: int
    exact: int
    row: int
    max_abs_diff: float
    tolerance: float


def audit_rows(
    got: torch.Tensor,  # [n, H] the worker's partials for the audited rows, in the wire dtype
    x: torch.Tensor,  # [n, H] the rows as sent (wire dtype)
    gate_up: torch.Tensor,
    down: torch.Tensor,
    fn: Activation | ExpertFunction,
    w: torch.Tensor,  # [n] routing weights as sent
    row_ids: list[int],  # the rows' positions in the call, for the evidence
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> AuditResult:
    """Check audited rows of one expert. Pure: no I/O, no state.

    The reference is this backbone's own kernel: it errs by about one ``u_c * E`` itself, a
    small part of the bound, and costs one forward where a float64 recomputation of a large
    expert cost forty. It is computed over ``x`` in one pass: given a worker's whole segment,
    in order, an honest worker's rows match it bit for bit."""
    compute = gate_up.dtype
    xc, wc = x.to(compute), w.to(compute)
    mine = expert_forward(xc, gate_up, down, fn, wc, biases)
    if mine.dtype != got.dtype:
        mine = mine.to(got.dtype)
    # Equal bits, NaN included (an honest overflow the backbone's own run has too).
    same = ((mine == got) | (mine.isnan() & got.isnan())).all(dim=-1)
    if bool(same.all()):
        return AuditResult(True, len(row_ids), len(row_ids), row_ids[0] if row_ids else 0, 0.0, 0.0)
    _, scale = error_scale(xc, gate_up, down, fn, wc, biases)
    ref = mine.to(compute)
    u_c, u_w = _unit_roundoff(compute), _unit_roundoff(got.dtype)
    if u_w > u_c:  # narrowed on the wire: one unit in the last place of the wire dtype
        info = torch.finfo(got.dtype)
        subnormal_step = float(info.smallest_normal) * float(info.eps)
        bound = TOLERANCE_FACTOR * u_c * scale + 2 * u_w * ref.abs() + subnormal_step
    else:
        bound = TOLERANCE_FACTOR * u_c * (scale + ref.abs())
    diff = (got.to(compute) - ref).abs()
    # A NaN anywhere fails: NaN <= bound is False.
    ratio = torch.where(diff <= bound, diff / bound.clamp_min(torch.finfo(compute).tiny), torch.full_like(diff, float("inf")))
    row_ok = torch.isfinite(ratio).all(dim=-1)
    worst = int((~row_ok).nonzero()[0, 0]) if not bool(row_ok.all()) else int(ratio.amax(dim=-1).argmax())
    col = int(ratio[worst].argmax())
    return AuditResult(
        passed=bool(row_ok.all()),
        rows=len(row_ids),
        exact=int(same.sum()),
        row=row_ids[worst],
        max_abs_diff=float(diff[worst, col]),
        tolerance=float(bound[worst, col]),
    )
