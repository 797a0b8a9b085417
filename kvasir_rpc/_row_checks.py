"""Row checks: every row of a worker's answer checked before it is used, at a small fraction
of the cost of recomputing it (Freivalds' random projections).

A worker that announced ``projections`` returns, with each assignment's partial ``y``, the
projections it computed first, ``p = x @ gate_up^T = [g | u]``. For each MoE layer this
backbone draws three secret random vectors (standard normal, from the operating system, never
sent anywhere), ``r_g``, ``r_u`` (length I) and ``r_y`` (length H), and for each expert their
images through its weights, ``G^T r_g``, ``U^T r_u`` (length H) and ``D^T r_y`` (length I),
made once from the checkpoint. A row then passes when, with ``h = act(g) * u`` computed here::

    r_g . g  ~  (G^T r_g) . x        r_u . u  ~  (U^T r_u) . x        r_y . y  ~  w (D^T r_y) . h

O(H + I) per row, in float64, where recomputing it is O(H * I): the three links (x to g and u,
g and u to h, h to y) are each checked, so no answer that is wrong by more than rounding can
pass all three except by chance, and the worker cannot aim at the chance without knowing r.

How close is close enough. An honest worker's values differ from the exact ones by rounding:
each dot product of n terms by about ``u_a sqrt(n) ||terms||`` (``u_a``: float32's unit
roundoff, the least precision an implementation may accumulate in), each stored value by
``u |value|`` in the dtype it is stored in. Over the secret r, an honest error vector ``e``
(which cannot depend on r) gives ``r . e ~ N(0, ||e||^2)``, and ``||e||^2`` is bounded by
terms this backbone computes per row from the row, the answer and per-expert column norms of
the weights (``_variances``). A row fails when a difference exceeds ``ROW_CHECK_FACTOR``
standard deviations of that bound: an honest row fails with a probability under
``P(|Z| > ROW_CHECK_FACTOR)`` (1e-15 at 8), less since the bound is loose; a wrong row with
error ``e`` passes one check with probability at most ``sqrt(2/pi) * tau / ||e||``, ``tau``
the threshold.

The secrets of a layer are renewed every ``renew_s`` seconds (the images are made again,
lazily, as experts are checked), so what a liar could learn from which of its answers passed
dies with them.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from kvasir_rpc._activation import Activation
from kvasir_rpc._function import ExpertFunction, as_function

__all__ = ["ROW_CHECK_FACTOR", "NARROW_Z", "RowChecker", "RowVerdict"]

# A row fails when a check's difference exceeds this many standard deviations of the honest
# error bound. The bound is loose (an honest reordered float32 worker measures far under it,
# see tests/test_rowcheck.py), so honest rows never come near it.
ROW_CHECK_FACTOR = 8.0
# A row that passes but comes closer than this many standard deviations is "narrow": should
# its session later be caught lying, the passes that used it are recomputed (see _attempt.py).
# Honest rows stay under it (at most 2.5 measured over narrow wires, 1.6 over float32 ones).
NARROW_Z = 4.0
# Rows checked at a time (see RowChecker._measure).
_CHUNK_ROWS = 64
# The least precision an implementation may accumulate its dot products in (float32).
_U_ACCUMULATE = 2.0**-24
# The largest slope of the activations MoE checkpoints use (silu 1.1, gelu 1.13, relu 1), for
# how an error in g moves act(g).
_MAX_SLOPE = 1.25


class ExpertSource(Protocol):
    """Where the checks read an expert's weights (``backbone.experts._weights.ExpertWeights``)."""

    def num_experts(self, layer: int) -> int | None: ...

    def get(self, layer: int, expert: int, *, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]: ...

    def biases(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...


def _unit(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2


@dataclasses.dataclass(frozen=True)
class RowVerdict:
    """The row checks of one call: ``passed``; the worst row (the first that failed, if any)
    and its worst check's difference over its threshold (``ratio``, > 1 failed); ``z``, the
    largest difference in standard deviations of any row (how narrowly the call passed)."""

    passed: bool
    row: int
    ratio: float
    z: float
    diff: float = 0.0  # the failing check's difference and threshold
    tau: float = 0.0
    detail: str = ""


class _LayerSecrets:
    """One layer's secret vectors and the images made from them so far, expert by expert."""

    def __init__(self, experts: int, hidden: int, inter: int, made_at: float) -> None:
        gen = torch.Generator().manual_seed(secrets.randbits(63))
        r_g = torch.randn(inter, generator=gen)
        r_u = torch.randn(inter, generator=gen)
        r_y = torch.randn(hidden, generator=gen)
        # The projections' secrets side by side, [g | u] @ r_p = [r_g . g, r_u . u]; and with
        # columns of ones and of squared secrets, so that one matmul of a row's squares gives its
        # squared norms and what its dot products with the secrets may err.
        # Every vector a row meets is a row of a [k, n] matrix, so that F.linear takes a chunk of
        # rows against all of them at once (a matmul with few columns runs several times slower).
        zero_i = torch.zeros(inter)
        self.r_p = torch.stack([torch.cat([r_g, zero_i]), torch.cat([zero_i, r_u])])  # [2, 2I]
        ones_i = torch.ones(inter)
        self.sq_p = torch.stack([torch.cat([ones_i, zero_i]), torch.cat([r_g * r_g, zero_i]),
                                 torch.cat([zero_i, ones_i]), torch.cat([zero_i, r_u * r_u])])  # [4, 2I]
        self.r_y = torch.stack([r_y, torch.zeros(hidden)])  # [2, H] (the second row unused)
        self.sq_y = torch.stack([torch.ones(hidden), r_y * r_y])  # [2, H]
        self.made_at = made_at
        # Per expert (float32: each value's rounding, and the float32 sums over them, are counted
        # in the thresholds):
        self.img_x = torch.zeros(experts, 2, hidden)  # [G^T r_g; U^T r_u]
        self.sq_x = torch.zeros(experts, 4, hidden)  # [|G|^2; |U|^2 by column; (G^T r_g)^2; (U^T r_u)^2]
        self.img_h = torch.zeros(experts, 2, inter)  # [D^T r_y; 0]
        self.sq_h = torch.zeros(experts, 2, inter)  # [|D|^2 by column; (D^T r_y)^2]
        # Where the experts have biases: [r_g . b_g, r_u . b_u], r_y . b_d and [|b_g|^2, |b_u|^2,
        # |b_d|^2] per expert (float64), added to the images' side of each check.
        self.bias_x = torch.zeros(experts, 2, dtype=torch.float64)
        self.bias_y = torch.zeros(experts, dtype=torch.float64)
        self.bias_sq = torch.zeros(experts, 3, dtype=torch.float64)
        self.ready = torch.zeros(experts, dtype=torch.bool)
        self.compute = torch.float32  # the experts' dtype, as the first image read found it
        self.lock = threading.Lock()


class RowChecker:
    """Checks every row of a call's answer; thread-safe (decode groups check concurrently)."""

    def __init__(self, weights: ExpertSource, *, renew_s: float = 3600.0, factor: float = ROW_CHECK_FACTOR,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._weights = weights
        self.renew_s = renew_s
        self.factor = factor
        self._clock = clock
        self._layers: dict[int, _LayerSecrets] = {}
        self._lock = threading.Lock()
        self.seconds = 0.0  # thread CPU time spent checking (images included)
        self.images_made = 0

    def _secrets(self, layer: int, hidden: int, inter: int) -> _LayerSecrets:
        now = self._clock()
        with self._lock:
            s = self._layers.get(layer)
            if s is None or now - s.made_at >= self.renew_s:
                n = self._weights.num_experts(layer)
                if n is None:
                    raise ValueError(f"layer {layer} has no experts")
                s = self._layers[layer] = _LayerSecrets(n, hidden, inter, now)
            return s

    def _make_images(self, layer: int, s: _LayerSecrets, experts: torch.Tensor, fn: ExpertFunction) -> None:
        """The images of the experts among ``experts`` not made yet, from their weights (in
        float64, then kept in float32)."""
        if bool(s.ready[experts].all()):
            return
        missing = [e for e in experts.unique().tolist() if not bool(s.ready[e])]
        with s.lock:
            for e in missing:
                if bool(s.ready[e]):
                    continue
                gate_up, down = self._weights.get(layer, e, keep=False)
                s.compute = gate_up.dtype
                g, u, d = fn.matrices(gate_up, down)  # [I,H] [I,H] [H,I] (views of the stored weights)
                inter = g.shape[0]
                gtr, utr, dtr = _image(s.r_p[0, :inter], g), _image(s.r_p[1, inter:], u), _image(s.r_y[0], d)
                biases = self._weights.biases(layer, e) if fn.bias else None
                if biases is not None:
                    b_g, b_u = (b.double() for b in fn.split(biases[0]))
                    b_d = biases[1].double()
                    s.bias_x[e] = torch.stack([s.r_p[0, :inter].double() @ b_g, s.r_p[1, inter:].double() @ b_u])
                    s.bias_y[e] = s.r_y[0].double() @ b_d
                    s.bias_sq[e] = torch.stack([b_g @ b_g, b_u @ b_u, b_d @ b_d])
                s.img_x[e] = torch.stack([gtr, utr])
                s.sq_x[e] = torch.stack([_square_columns(g), _square_columns(u), gtr * gtr, utr * utr])
                s.img_h[e, 0] = dtr
                s.sq_h[e] = torch.stack([_square_columns(d), dtr * dtr])
                s.ready[e] = True
                self.images_made += 1

    def check(
        self,
        layer: int,
        fn: Activation | ExpertFunction,
        x: torch.Tensor,  # [n, H] each assignment's row, as sent (wire dtype)
        w: torch.Tensor,  # [n] routing weights as sent
        experts: torch.Tensor,  # [n] int64
        partials: torch.Tensor,  # [n, H] as received (wire dtype)
        projections: torch.Tensor,  # [n, 2I] as received (wire dtype)
    ) -> RowVerdict:
        """Check every row; pure but for the lazily made images. The caller has checked that
        the answer's shapes and dtypes are right and its partials finite."""
        t0 = time.thread_time()
        try:
            return self._check(layer, as_function(fn), x, w, experts, partials, projections)
        finally:
            with self._lock:
                self.seconds += time.thread_time() - t0

    def thresholds(self, layer: int, fn: Activation | ExpertFunction, x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor,
                   partials: torch.Tensor, projections: torch.Tensor) -> torch.Tensor:
        """[n, 3] each row's thresholds (gate, up, partial): what an honest answer's differences
        stay under. They depend on the row and the answer, not on the secrets."""
        return self.factor * self._measure(layer, as_function(fn), x, w, experts, partials, projections)[1]

    def _check(self, layer: int, fn: ExpertFunction, x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor,
               partials: torch.Tensor, projections: torch.Tensor) -> RowVerdict:
        if x.shape[0] == 0:
            return RowVerdict(True, 0, 0.0, 0.0)
        diffs, sigma = self._measure(layer, fn, x, w, experts, partials, projections)
        tau = self.factor * sigma + torch.finfo(torch.float64).tiny
        ratio = diffs / tau  # NaN (a NaN anywhere) fails too: NaN <= 1 is False
        ok = (ratio <= 1.0).all(dim=-1)
        z = float(torch.nan_to_num(diffs / (sigma + torch.finfo(torch.float64).tiny), nan=math.inf).max())
        if bool(ok.all()):
            worst = int(ratio.amax(dim=-1).argmax())
            return RowVerdict(True, worst, float(ratio[worst].max()), z)
        row = int((~ok).nonzero()[0, 0])
        # The first link that breaks (x to g, x to u, then h to y): a wrong g also makes the
        # partial's check fail, further along.
        which = int((~(ratio[row] <= 1.0)).nonzero()[0, 0])
        name = ("gate projection", "up projection", "partial")[which]
        return RowVerdict(False, row, float(ratio[row, which]), z, float(diffs[row, which]), float(tau[row, which]),
                          detail=f"row {row}: its {name} is off by {float(diffs[row, which]):.3g} along a secret "
                                 f"direction, {float(ratio[row, which]):.3g} times the threshold "
                                 f"{float(tau[row, which]):.3g}")

    def _measure(self, layer: int, fn: ExpertFunction, x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor,
                 partials: torch.Tensor, projections: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(|differences|, honest standard deviations)``, both [n, 3] float64.

        In float32, as small matmuls over the received tensors, a chunk of rows at a time
        (``_chunks``: a chunk's rows stay in the CPU's cache, and a call of many small segments
        costs a few dozen torch operations per chunk, not per segment). This backbone's own
        float32 sums err like an honest worker's, and the thresholds count it: each dot
        product of n terms ``a_j b_j`` adds ``u_a^2 n sum (a_j b_j)^2`` to its variance, the
        sum the matmuls with the squared secrets give."""
        n, hidden = x.shape
        inter = projections.shape[1] // 2
        s = self._secrets(layer, hidden, inter)
        self._make_images(layer, s, experts, fn)
        narrowed = _unit(partials.dtype) > _unit(s.compute)
        diffs = torch.empty(n, 3, dtype=torch.float64)
        sums = torch.empty(n, 11, dtype=torch.float64)
        y_sq = torch.empty(n, 2, dtype=torch.float64)
        bias_sq = torch.zeros(n, 3, dtype=torch.float64) if fn.bias else None
        xs, ys, ps, ws = x.float(), partials.float(), projections.float(), w.float()
        for rows, expert in _chunks(experts):
            xf, p, y = xs[rows], ps[rows], ys[rows]
            g, u = p[:, :inter], p[:, inter:]
            a, b = fn.factors(g, u)
            h = a * b  # [c, I]
            x2, h2 = xf * xf, h * h
            if expert is not None:  # one expert's rows: its images as they are
                at_x, x_sq = F.linear(xf, s.img_x[expert]), F.linear(x2, s.sq_x[expert])  # [c, 2], [c, 4]
                at_h, h_sq = F.linear(h, s.img_h[expert])[:, 0], F.linear(h2, s.sq_h[expert])  # [c], [c, 2]
                d2 = s.sq_h[expert, 0]
            else:  # rows of several experts: each row with its own expert's images
                ex = experts[rows]
                at_x, x_sq = torch.einsum("ch,ckh->ck", xf, s.img_x[ex]), torch.einsum("ch,ckh->ck", x2, s.sq_x[ex])
                at_h, h_sq = (h * s.img_h[ex, 0]).sum(-1), torch.einsum("ci,cki->ck", h2, s.sq_h[ex])
                d2 = s.sq_h[ex, 0]
            at_p = F.linear(p, s.r_p)  # [c, 2]: r_g . g, r_u . u
            at_x64, at_h64 = at_x.double(), at_h.double()
            if bias_sq is not None:  # the biases' side: r_g . b_g, r_u . b_u, r_y . b_d
                e_rows = expert if expert is not None else experts[rows]
                at_x64, at_h64 = at_x64 + s.bias_x[e_rows], at_h64 + s.bias_y[e_rows]
                bias_sq[rows] = s.bias_sq[e_rows]
            diffs[rows, :2] = (at_p.double() - at_x64).abs()
            diffs[rows, 2] = (F.linear(y, s.r_y)[:, 0].double() - at_h64 * ws[rows].double()).abs()
            sums[rows, 0:4] = x_sq.double()  # x^2 . |G|^2, x^2 . |U|^2, x^2 . (G^T r_g)^2, x^2 . (U^T r_u)^2
            sums[rows, 4:6] = h_sq.double()  # h^2 . |D|^2, h^2 . (D^T r_y)^2
            sums[rows, 6:10] = F.linear(p * p, s.sq_p).double()  # ||g||^2, g^2 . r_g^2, ||u||^2, u^2 . r_u^2
            y_sq[rows] = F.linear(y * y, s.sq_y).double()  # ||y||^2, y^2 . r_y^2
            sums[rows, 10] = ((_wire_moves(g.double(), u.double(), fn, partials.dtype).pow(2) * d2).sum(-1)
                              if narrowed else 0.0)
        var = _variances(sums, y_sq, w.double(), projections, partials, hidden=hidden, inter=inter,
                         compute=s.compute, roundings=fn.roundings)
        if bias_sq is not None:
            # Each bias is added to a product already rounded to the compute dtype: that rounding
            # (of a value at most |v| + |b| in size, v the sum after) is not in v's own half ulp.
            u_c2 = _unit(s.compute) ** 2
            var[:, 0] += 2 * u_c2 * (sums[:, 6] + bias_sq[:, 0])
            var[:, 1] += 2 * u_c2 * (sums[:, 8] + bias_sq[:, 1])
            var[:, 2] += 2 * u_c2 * (y_sq[:, 0] + w.double() ** 2 * bias_sq[:, 2])
        return diffs, var.sqrt()

    def layers_ready(self) -> dict[int, int]:
        """{layer: experts whose images are made} under the current secrets."""
        with self._lock:
            return {layer: int(s.ready.sum()) for layer, s in self._layers.items()}


def _image(r: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``r @ m`` (``m`` [k, n]) summed in float64, a block of rows of ``m`` at a time (converting
    the whole matrix to float64 at once took five times longer), returned in float32."""
    acc = torch.zeros(m.shape[1], dtype=torch.float64)
    for i in range(0, m.shape[0], 64):
        acc += r[i : i + 64].double() @ m[i : i + 64].double()
    return acc.float()


def _square_columns(m: torch.Tensor) -> torch.Tensor:
    """The squared norms of ``m``'s columns, in float32 (they only size the thresholds)."""
    m = m.float()
    return (m * m).sum(0)


def _chunks(experts: torch.Tensor) -> list[tuple[slice, int | None]]:
    """Rows in chunks of at most ``_CHUNK_ROWS``: an expert's run of rows on its own (with
    that expert, None otherwise) when it is long, short runs together."""
    ids, counts = torch.unique_consecutive(experts, return_counts=True)
    out: list[tuple[slice, int | None]] = []
    start = mixed = 0  # mixed: where the pending chunk of short runs began
    for e, m in zip(ids.tolist(), counts.tolist()):
        if m >= _CHUNK_ROWS // 8:
            if mixed < start:
                out.append((slice(mixed, start), None))
            out.extend((slice(a, min(a + _CHUNK_ROWS, start + m)), e) for a in range(start, start + m, _CHUNK_ROWS))
            mixed = start + m
        elif start + m - mixed > _CHUNK_ROWS:
            out.append((slice(mixed, start), None))
            mixed = start
        start += m
    if mixed < start:
        out.append((slice(mixed, start), None))
    return out


def _half_ulp_sq(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sums over the last dim of the squared half units in the last place of ``v``'s values
    in ``dtype`` (the most rounding to ``dtype`` moved a value that came out as each), float64."""
    precision = round(-math.log2(float(torch.finfo(dtype).eps))) + 1  # float32 24, bfloat16 8, float16 11
    _, exponent = torch.frexp(v)
    half = torch.ldexp(torch.ones_like(v), exponent - precision - 1)
    tiny = float(torch.finfo(dtype).smallest_normal) * float(torch.finfo(dtype).eps) / 2  # a subnormal's half ulp
    return (torch.where(v == 0, torch.zeros_like(v), half) ** 2).sum(-1) + v.shape[-1] * tiny**2


def _wire_moves(g: torch.Tensor, u: torch.Tensor, fn: ExpertFunction, wire: torch.dtype) -> torch.Tensor:
    """``a``: how far h = a(g) * b(u) (``fn.factors``: act(g) and u for a GLU) may have moved,
    per element, when g and u were rounded to the (narrower) wire dtype after the worker
    computed h from them: ``|b| s ulp(g)/2 + |a| ulp(u)/2``, ``s`` the largest slope of a (b's is
    at most 1). [n, I] float64."""
    precision = round(-math.log2(float(torch.finfo(wire).eps))) + 1
    half_g = torch.ldexp(torch.ones_like(g), torch.frexp(g)[1] - precision - 1)
    half_u = torch.ldexp(torch.ones_like(u), torch.frexp(u)[1] - precision - 1)
    a, b = fn.factors(g, u)
    return b.abs() * _MAX_SLOPE * half_g + a.abs() * half_u


def _variances(sums: torch.Tensor, y_sq: torch.Tensor, w: torch.Tensor, projections: torch.Tensor,
               partials: torch.Tensor, *, hidden: int, inter: int, compute: torch.dtype,
               roundings: int = 2) -> torch.Tensor:
    """[n, 3] bounds of the variance of an honest answer's differences in the g, u and y
    checks (float64), from the per-row sums ``_measure`` gathered (``sums`` [n, 11], ``y_sq``
    [n, 2]: see there) and the received tensors.

    ``u_a``: float32's unit roundoff (the least precision a dot product may accumulate in, and
    what this backbone's own sums run in); ``u_c``: the compute dtype's; ``|M|^2`` the squared
    column norms of a weight matrix; ``ulp/2`` the most rounding to the wire dtype moved each
    received value::

        g (and u):  u_a^2 H (x^2 . |G|^2)                              the worker's dot products
                  + rounding of g: sum (ulp/2)^2 [+ u_c^2 ||g||^2 when narrowed]
                  + u_a^2 ((H + 1) x^2 . (G^T r)^2 + I g^2 . r^2)       this backbone's float32 sums
        y:          w^2 (u_a^2 I + (2 u_c)^2 + 20 u_a^2) (h^2 . |D|^2)  accumulation; h's roundings
                                                                      there and here, act's error
                  + w^2 (a^2 . |D|^2)                                  g, u narrowed on the wire
                  + rounding of y: sum (ulp/2)^2 + u_c^2 ||y||^2 [+ u_c^2 ||y||^2 when narrowed]
                  + u_a^2 (w^2 (I + 1) h^2 . (D^T r_y)^2 + H y^2 . r_y^2)   this backbone's sums

    where ``a = |u| s ulp(g)/2 + |act(g)| ulp(u)/2`` bounds how far h moved when g and u were
    narrowed (``s`` the activation's largest slope). Narrowed: the answer travels in a dtype
    narrower than the expert computes in (bfloat16 partials of a float32 model). A float32
    answer's rounding is bounded by ``u_a^2 ||v||^2`` rather than its exact half ulps (it is far
    under the rest, and cheaper)."""
    wire = partials.dtype
    u_c = _unit(compute)
    narrowed = _unit(wire) > u_c
    u_a2 = _U_ACCUMULATE**2
    extra = u_c**2 if narrowed else 0.0
    gg, uu, yy = sums[:, 6], sums[:, 8], y_sq[:, 0]
    if wire == torch.float32:
        half_g, half_u, half_y = u_a2 * gg, u_a2 * uu, u_a2 * yy
    else:
        g, u = projections[:, :inter].double(), projections[:, inter:].double()
        half_g, half_u, half_y = _half_ulp_sq(g, wire), _half_ulp_sq(u, wire), _half_ulp_sq(partials.double(), wire)
    var_g = u_a2 * (hidden * sums[:, 0] + (hidden + 1) * sums[:, 2] + inter * sums[:, 7]) + half_g + extra * gg
    var_u = u_a2 * (hidden * sums[:, 1] + (hidden + 1) * sums[:, 3] + inter * sums[:, 9]) + half_u + extra * uu
    ww = w * w
    var_y = (ww * ((u_a2 * inter + (roundings * u_c) ** 2 + 20 * u_a2) * sums[:, 4] + u_a2 * (inter + 1) * sums[:, 5]
                   + sums[:, 10])
             + u_a2 * hidden * y_sq[:, 1] + half_y + (u_c**2 + extra) * yy)
    return torch.stack([var_g, var_u, var_y], dim=-1)
