"""Checking a stranger's partials: which rows to audit, and whether an audited row is right.

A worker's answer to a call is first checked whole (shape, dtype, every value finite); then
rows are drawn for the audit with probability ``rate`` each, from a generator seeded from the
operating system after the answer arrived, so the worker cannot tell which rows are checked.
An audited row is recomputed here from the checkpoint's weights and the rows this backbone sent.

A segment (the rows of one expert in the call) of at most ``SEGMENT_ROWS`` rows is drawn
whole, with probability ``rate``; a larger one row by row. A matmul rounds a row differently
with the shape of the batch it is in; recomputed as the worker computed it, the whole
segment in one pass, an honest worker's rows come out equal bit for bit, and every row of
the segment is checked for that one forward. Either way each row is audited with
probability ``rate`` and the audits recompute a ``rate`` share of the remote work on
average, as ``--audit-rate`` says. (Drawing rows and bringing in the segment of each drawn
row, as this did before, audited ``1 - (1 - rate)^n`` of the segments of ``n`` rows: 28% of
the remote work at 16-row segments, fourteen times the rate asked for.)

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
import secrets
import threading
from collections.abc import Sequence

import torch

from kvasir_rpc import Activation, ExpertFunction, as_function, expert_forward

__all__ = ["DEFAULT_AUDIT_RATE", "SEGMENT_ROWS", "TOLERANCE_FACTOR", "AuditRates", "AuditResult", "RowSampler",
           "audit_rows", "error_scale"]

# One row (or small segment) in fifty: audits recompute 2% of the remote work of a session
# whose rows are each checked (_row_checks.py) once its wallet has earned it; each session's
# first call in a run is audited too (see RowSampler).
DEFAULT_AUDIT_RATE = 0.02
# A session answering without row checks (an older worker) is audited at least this much:
# the audits are all that stand between its answers and the output.
DEFAULT_UNCHECKED_RATE = 0.10
# A wallet's first rows are audited at this rate, halving every NEW_WALLET_HALF_LIFE_ROWS rows
# of accepted work until the session's own rate: a fresh identity (they are free) starts
# under close watch and earns its way down.
DEFAULT_NEW_WALLET_RATE = 0.25
NEW_WALLET_HALF_LIFE_ROWS = 2000
TOLERANCE_FACTOR = 8.0
# A segment of at most this many rows is drawn and audited whole (see RowSampler). At
# Qwen3-30B-A3B's widths on one core: a forward over 32 rows takes 6.4 ms, over 3 rows
# 3.2 ms, and the error bound that an inexact row needs 7-10 ms.
SEGMENT_ROWS = 48


@dataclasses.dataclass(frozen=True)
class AuditRates:
    """How much of a session's work the audits recompute: ``base`` for a session whose rows are
    checked, at least ``unchecked`` for one without row checks, and ``new`` for a wallet's first
    rows, halving every ``half_life_rows`` rows of its accepted work. ``base`` 0 turns the
    audits off (benchmarks)."""

    base: float = DEFAULT_AUDIT_RATE
    unchecked: float = DEFAULT_UNCHECKED_RATE
    new: float = DEFAULT_NEW_WALLET_RATE
    half_life_rows: int = NEW_WALLET_HALF_LIFE_ROWS

    def __post_init__(self) -> None:
        for name in ("base", "unchecked", "new"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"the audit rate {name} is a fraction from 0 to 1, got {getattr(self, name)}")
        if self.half_life_rows < 1:
            raise ValueError("half_life_rows must be at least 1")

    def rate(self, earned_rows: int, row_checked: bool) -> float:
        """The rate for a session of a wallet with ``earned_rows`` rows of accepted work."""
        if self.base == 0.0:
            return 0.0
        floor = self.base if row_checked else max(self.base, self.unchecked)
        return min(1.0, max(floor, self.new * 0.5 ** (earned_rows / self.half_life_rows)))


def _unit_roundoff(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2


class RowSampler:
    """Chooses audited rows: whole small segments or single rows, each with probability
    ``rate`` (the sampler's, or the one a call is given), from a generator seeded from the OS
    (never from anything a worker sees), plus one row of each session's first call (with its
    segment when that is small)."""

    def __init__(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"the audit rate is a fraction from 0 to 1, got {rate}")
        self.rate = rate
        self._gen = torch.Generator().manual_seed(secrets.randbits(63))
        self._seen: set[str] = set()
        self._lock = threading.Lock()  # decode groups answer calls from several threads

    def choose(self, session_id: str, sizes: Sequence[int], rate: float | None = None) -> torch.Tensor:
        """Indices (ascending, int64) of the rows of one answered call to audit; the call's
        segments hold ``sizes`` rows, in order."""
        rate = self.rate if rate is None else rate
        rows = sum(sizes)
        if rows == 0 or rate == 0.0:
            return torch.empty(0, dtype=torch.long)
        with self._lock:
            draws = torch.rand(rows, generator=self._gen) < rate
            first = session_id not in self._seen
            if first:
                self._seen.add(session_id)
                extra = int(torch.randint(rows, (1,), generator=self._gen))
        picked = torch.zeros(rows, dtype=torch.bool)
        start = 0
        for n in sizes:
            end = start + n
            if n <= SEGMENT_ROWS:
                # One draw for the whole segment (its first row's), so a segment is as likely
                # to be audited as a row is.
                whole = bool(draws[start]) if n else False
                if first and start <= extra < end:
                    whole = True
                if whole:
                    picked[start:end] = True
            else:
                picked[start:end] = draws[start:end]
                if first and start <= extra < end:
                    picked[extra] = True
            start = end
        return picked.nonzero()[:, 0]


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
