"""The audit's comparison and sampling, as pure functions: honest answers in any summation
order pass, the table's liars fail, and the sampler is unpredictable and covers first calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backbone._audit import TOLERANCE_FACTOR, RowSampler, audit_rows, error_scale
from kvasir_rpc._kernel import expert_forward

act = F.silu


def _reordered(x, gate_up, down, w):  # type: ignore[no-untyped-def]
    """An honest float32 worker in another language: same function, other summation order."""
    hidden = x.shape[1]
    g = sum(x[:, i : i + 7] @ gate_up[:, i : i + 7].T for i in range(0, hidden, 7))
    gate, up = g.chunk(2, dim=-1)
    h = act(gate) * up
    inter = h.shape[1]
    out = sum(h[:, i : i + 5] @ down[:, i : i + 5].T for i in range(0, inter, 5))
    return out * w[:, None]


def _offset(x, gate_up, down, w):  # type: ignore[no-untyped-def]
    return expert_forward(x, gate_up, down, lambda g: act(g) + 1e-3, w)


def _zeros(x, gate_up, down, w):  # type: ignore[no-untyped-def]
    return torch.zeros(x.shape[0], down.shape[0])


def _nan(x, gate_up, down, w):  # type: ignore[no-untyped-def]
    out = expert_forward(x, gate_up, down, act, w)
    out[0, 3] = float("nan")
    return out


SIZES = [
    # (hidden, intermediate, input scale, weight scale): the tiny test models, Qwen3-30B-A3B's
    # widths, and large activations.
    (64, 32, 1.0, 0.02),
    (2048, 768, 1.0, 0.02),
    (2048, 768, 4.0, 0.05),
]


def _case(hidden: int, inter: int, xs: float, ws: float, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, hidden, generator=g) * xs
    gate_up = torch.randn(2 * inter, hidden, generator=g) * ws
    down = torch.randn(hidden, inter, generator=g) * ws
    w = torch.rand(32, generator=g)
    return x, gate_up, down, w


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"H{s[0]}-I{s[1]}-x{s[2]}")
def test_honest_answers_pass_and_liars_fail(size):
    x, gate_up, down, w = _case(*size)
    rows = list(range(32))
    same = audit_rows(expert_forward(x, gate_up, down, act, w), x, gate_up, down, act, w, rows)
    assert same.passed and same.exact == 32 and same.max_abs_diff == 0.0
    other = audit_rows(_reordered(x, gate_up, down, w), x, gate_up, down, act, w, rows)
    assert other.passed and other.exact < 32, other
    assert other.max_abs_diff > 0.0
    for liar in (_offset, _zeros, _nan):
        verdict = audit_rows(liar(x, gate_up, down, w), x, gate_up, down, act, w, rows)
        assert not verdict.passed, (liar.__name__, verdict)
        assert verdict.max_abs_diff > verdict.tolerance or verdict.max_abs_diff != verdict.max_abs_diff


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"H{s[0]}-I{s[1]}-x{s[2]}")
def test_the_reference_over_the_workers_segment_matches_an_honest_row_bit_for_bit(size):
    """A row computed in a batch of 32 rounds differently from the same row computed alone or
    with two others; recomputed over the worker's whole segment, an honest row is equal bit
    for bit (no bound needed), and a liar's row in the same segment still fails."""
    x, gate_up, down, w = _case(*size, seed=2)
    honest = expert_forward(x, gate_up, down, act, w)  # the worker's segment: 32 rows at once
    at = torch.tensor([3, 17, 30])
    alone = audit_rows(honest[at], x[at], gate_up, down, act, w[at], at.tolist())
    with_segment = audit_rows(honest[at], x[at], gate_up, down, act, w[at], at.tolist(), segment=(x, w, at))
    assert alone.passed and with_segment.passed
    assert with_segment.exact == 3 and with_segment.max_abs_diff == 0.0
    assert alone.exact < 3  # alone, the rows round differently: only the bound passes them
    liar = honest.clone()
    liar[17] = _offset(x, gate_up, down, w)[17]
    verdict = audit_rows(liar[at], x[at], gate_up, down, act, w[at], at.tolist(), segment=(x, w, at))
    assert not verdict.passed and verdict.row == 17 and verdict.exact == 2, verdict


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"H{s[0]}-I{s[1]}-x{s[2]}")
def test_margins_both_ways(size):
    """The bound sits well above honest reordering and well below a 1e-3 activation offset,
    in units of the per-element error scale u * E."""
    x, gate_up, down, w = _case(*size, seed=1)
    ref, scale = error_scale(x.double(), gate_up.double(), down.double(), act, w.double())
    unit = 2.0**-24 * scale
    honest = ((_reordered(x, gate_up, down, w).double() - ref).abs() / unit).max().item()
    liar_rows = ((_offset(x, gate_up, down, w).double() - ref).abs() / unit).amax(dim=-1)
    assert honest < TOLERANCE_FACTOR / 4, honest
    # Every row of the liar is caught, each by a wide margin.
    assert liar_rows.min().item() > 4 * TOLERANCE_FACTOR, liar_rows.min().item()


def test_narrow_wire_partials_get_their_rounding():
    """bfloat16 partials of an honest float32 computation pass; the liar still fails."""
    x, gate_up, down, w = _case(64, 32, 1.0, 0.02)
    xb = x.to(torch.bfloat16)
    honest = expert_forward(xb.float(), gate_up, down, act, w).to(torch.bfloat16)
    assert audit_rows(honest, xb, gate_up, down, act, w, list(range(32))).passed
    liar = _offset(xb.float(), gate_up, down, w).to(torch.bfloat16)
    assert not audit_rows(liar, xb, gate_up, down, act, w, list(range(32))).passed


def test_sampler_rate_first_call_and_unpredictability():
    s = RowSampler(0.02)
    first = s.choose("s1", 10)
    assert first.numel() >= 1  # a session's first call is always audited
    counts = sum(s.choose("s1", 1000).numel() for _ in range(50))
    assert 600 < counts < 1400  # 2% of 50,000 rows = 1000
    # Two samplers (two backbones, or one restarted) choose differently: seeded from the OS.
    a, b = RowSampler(0.5), RowSampler(0.5)
    assert not torch.equal(a.choose("x", 256), b.choose("x", 256))
    assert RowSampler(0.0).choose("y", 100).numel() == 0
    with pytest.raises(ValueError):
        RowSampler(1.5)
