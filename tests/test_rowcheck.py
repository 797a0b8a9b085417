"""Row checks (kvasir_rpc/_row_checks.py) as pure functions: every honest way of computing an
expert passes (this kernel, another summation order, narrow wires, narrow models), every
liar of the issue's table fails on every row of a float32 wire, a narrow wire still catches
gross lies, and a lie of a given size passes one check no more often than the stated bound."""

from __future__ import annotations

import math

import kvasir_rpc._row_checks as rowcheck
import pytest
import torch
import torch.nn.functional as F

from kvasir_rpc import ROW_CHECK_FACTOR, ExpertFunction, RowChecker, expert_forward_projections

act = F.silu


class Weights:
    """The ExpertWeights a RowChecker reads: [E, 2I, H] and [E, H, I]."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up, self.down = gate_up, down
        self.reads = 0

    def num_experts(self, layer: int) -> int:
        return self.gate_up.shape[0]

    def get(self, layer: int, e: int, *, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        return self.gate_up[e], self.down[e]

    def biases(self, layer: int, e: int) -> None:
        return None


def _reordered(x, gate_up, down, a, w):  # type: ignore[no-untyped-def]
    """An honest float32 worker in another language: the same function summed in other orders."""
    p = sum(x[:, i : i + 7] @ gate_up[:, i : i + 7].T for i in reversed(range(0, x.shape[1], 7)))
    gate, up = p.chunk(2, dim=-1)
    h = a(gate) * up
    out = sum(h[:, i : i + 5] @ down[:, i : i + 5].T for i in reversed(range(0, h.shape[1], 5)))
    return out * w[:, None], p


def _case(hidden: int, inter: int, experts: int = 4, n: int = 64, model: torch.dtype = torch.float32, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02).to(model)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.02).to(model)
    x = torch.randn(n, hidden, generator=g)
    w = torch.rand(n, generator=g)
    ex = torch.randint(0, experts, (n,), generator=g)
    return gate_up, down, x, w, ex


def _answer(gate_up, down, x, w, ex, model, wire, forward=expert_forward_projections, a=act):  # type: ignore[no-untyped-def]
    """A worker's answer to a call of the rows ``x`` (sent in ``wire``), row by row."""
    xs = x.to(wire)
    ys, ps = [], []
    for i in range(x.shape[0]):
        e = int(ex[i])
        y, p = forward(xs[i : i + 1].to(model), gate_up[e], down[e], a, w[i : i + 1].to(model))
        ys.append(y)
        ps.append(p)
    return xs, torch.cat(ys).to(wire), torch.cat(ps).to(wire)


HONEST = [
    # (model dtype, wire dtype, how the worker computes)
    (torch.float32, torch.float32, "kernel"),
    (torch.float32, torch.float32, "reordered"),
    (torch.float32, torch.bfloat16, "kernel"),
    (torch.float32, torch.bfloat16, "reordered"),
    (torch.float32, torch.float16, "kernel"),
    (torch.bfloat16, torch.bfloat16, "kernel"),
    (torch.float16, torch.float16, "kernel"),
]


@pytest.mark.parametrize("size", [(64, 32), (512, 192)], ids=lambda s: f"H{s[0]}-I{s[1]}")
@pytest.mark.parametrize("model,wire,how", HONEST, ids=lambda v: str(v).replace("torch.", ""))
def test_honest_workers_pass_every_row_with_a_wide_margin(size, model, wire, how):
    gate_up, down, x, w, ex = _case(*size, model=model)
    forward = _reordered if how == "reordered" else expert_forward_projections
    xs, y, p = _answer(gate_up, down, x, w, ex, model, wire, forward)
    verdict = RowChecker(Weights(gate_up, down)).check(0, act, xs, w, ex, y, p)
    assert verdict.passed, verdict
    # The largest difference, in standard deviations of the bound, stays far from the factor
    # (1.6 measured on float32 wires, 2.5 on narrow ones, over 64 rows).
    assert verdict.z < 0.6 * ROW_CHECK_FACTOR, verdict


LIES = {
    "zeros": lambda y, p: (torch.zeros_like(y), torch.zeros_like(p)),
    "zeros, projections right": lambda y, p: (torch.zeros_like(y), p),
    "partials x 1.001": lambda y, p: (y * 1.001, p),
    "0.9 x the old audit bound": lambda y, p: (y + 0.9 * 8 * 2.0**-9 * y.abs(), p),
    "gate projection x 1.001": lambda y, p: (y, torch.cat([p[:, : p.shape[1] // 2] * 1.001, p[:, p.shape[1] // 2 :]], 1)),
    "up projection shifted": lambda y, p: (y, p + torch.cat([torch.zeros_like(p[:, :1]).expand(-1, p.shape[1] // 2),
                                                             torch.full_like(p[:, : p.shape[1] // 2], 1e-3)], 1)),
    "one element": lambda y, p: (y.index_put((torch.arange(y.shape[0]), torch.zeros(y.shape[0], dtype=torch.long)),
                                             y[:, 0] + 1e-3), p),
}


@pytest.fixture(autouse=True)
def _seeded_secrets(monkeypatch):
    """The secrets from a fixed sequence of seeds rather than the OS, so that what a small lie's
    luck gives is the same every run."""
    seeds = iter(range(1, 1_000_000))
    monkeypatch.setattr(rowcheck.secrets, "randbits", lambda bits: next(seeds))


# Lies a row may slip past now and then (the probability bound: about 1% a row for a partial
# 0.1% off at these widths), and the share of rows allowed to.
SMALL_LIES = {"partials x 1.001": 0.05, "one element": 0.05}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_every_row_of_a_liar_fails_on_a_float32_wire(lie):
    gate_up, down, x, w, ex = _case(512, 192)
    xs, y, p = _answer(gate_up, down, x, w, ex, torch.float32, torch.float32)
    y2, p2 = LIES[lie](y, p)
    checker = RowChecker(Weights(gate_up, down))
    passed = 0
    for i in range(x.shape[0]):  # row by row: each must fail on its own
        verdict = checker.check(0, act, xs[i : i + 1], w[i : i + 1], ex[i : i + 1], y2[i : i + 1], p2[i : i + 1])
        passed += verdict.passed
        assert verdict.passed or verdict.ratio > 1.0, (i, verdict)
    assert passed <= SMALL_LIES.get(lie, 0.0) * x.shape[0], passed
    verdict = checker.check(0, act, xs, w, ex, y2, p2)
    assert not verdict.passed and verdict.detail


def test_the_offset_activation_liar_fails_too():
    gate_up, down, x, w, ex = _case(512, 192)
    xs, y, p = _answer(gate_up, down, x, w, ex, torch.float32, torch.float32, a=lambda g: act(g) + 1e-3)
    assert not RowChecker(Weights(gate_up, down)).check(0, act, xs, w, ex, y, p).passed


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_a_narrow_wire_catches_a_zero_liar_in_any_call_of_several_rows(wire):
    """On a narrow wire honest rounding is ~0.4% of each value, so one row of zeros slips past
    now and then; a call of 8 rows of zeros never does (and the audits stand behind it)."""
    gate_up, down, x, w, ex = _case(512, 192, n=256)
    xs, y, p = _answer(gate_up, down, x, w, ex, torch.float32, wire)
    checker = RowChecker(Weights(gate_up, down))
    zeros_y, zeros_p = torch.zeros_like(y), torch.zeros_like(p)
    rows_caught = sum(not checker.check(0, act, xs[i:i + 1], w[i:i + 1], ex[i:i + 1], zeros_y[i:i + 1],
                                        zeros_p[i:i + 1]).passed for i in range(256))
    assert rows_caught >= 0.8 * 256, rows_caught
    for c in range(0, 256, 8):
        assert not checker.check(0, act, xs[c:c + 8], w[c:c + 8], ex[c:c + 8], zeros_y[c:c + 8],
                                 zeros_p[c:c + 8]).passed


def test_a_lie_passes_one_check_no_more_often_than_the_bound():
    """A lie e along the partials passes a check with probability at most sqrt(2/pi) tau/||e||
    over the secrets: with ||e|| = 20 tau, at most 4%. Secrets seeded for the test only."""
    gate_up, down, x, w, ex = _case(512, 192, n=1)
    xs, y, p = _answer(gate_up, down, x, w, ex, torch.float32, torch.float32)
    weights = Weights(gate_up, down)
    probe = RowChecker(weights)
    honest = probe.check(0, act, xs, w, ex, y, p)
    assert honest.passed
    # The threshold of the partials' check for this row, from the row alone (no secret in it).
    tau = float(probe.thresholds(0, act, xs, w, ex, y, p)[0, 2])
    direction = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    lie = (y.double() + 20 * tau * direction / direction.norm()).float()
    trials = 400
    passed = sum(RowChecker(weights).check(0, act, xs, w, ex, lie, p).passed for _ in range(trials))
    assert passed / trials <= 2 * math.sqrt(2 / math.pi) / 20, passed


def test_images_are_made_once_per_expert_and_again_when_the_secrets_are_renewed():
    gate_up, down, x, w, ex = _case(64, 32, experts=4, n=32)
    xs, y, p = _answer(gate_up, down, x, w, ex, torch.float32, torch.float32)
    weights = Weights(gate_up, down)
    now = [0.0]
    checker = RowChecker(weights, renew_s=60.0, clock=lambda: now[0])
    for _ in range(3):
        assert checker.check(0, act, xs, w, ex, y, p).passed
    assert weights.reads == len(ex.unique()) and checker.images_made == len(ex.unique())
    assert checker.layers_ready() == {0: len(ex.unique())}
    now[0] = 61.0  # renewed: new secrets, the images made again as experts are checked
    assert checker.check(0, act, xs[:1], w[:1], ex[:1], y[:1], p[:1]).passed
    assert checker.layers_ready() == {0: 1}


def test_an_empty_call_passes_and_nan_projections_fail():
    gate_up, down, x, w, ex = _case(64, 32, n=4)
    xs, y, p = _answer(gate_up, down, x, w, ex, torch.float32, torch.float32)
    checker = RowChecker(Weights(gate_up, down))
    assert checker.check(0, act, xs[:0], w[:0], ex[:0], y[:0], p[:0]).passed
    bad = p.clone()
    bad[2, 5] = float("nan")
    verdict = checker.check(0, act, xs, w, ex, y, bad)
    assert not verdict.passed and verdict.row == 2


@pytest.mark.parametrize("runs", [[3, 40, 5, 70, 2, 9], [1] * 100, [200], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7], []])
def test_chunks_cover_every_row_once_in_order_and_name_their_expert_only_when_they_have_one(runs):
    experts = torch.cat([torch.full((n,), i) for i, n in enumerate(runs)]) if runs else torch.empty(0, dtype=torch.long)
    chunks = rowcheck._chunks(experts)
    covered = [i for rows, _ in chunks for i in range(rows.start, rows.stop)]
    assert covered == list(range(len(experts)))
    for rows, expert in chunks:
        assert 0 < rows.stop - rows.start <= rowcheck._CHUNK_ROWS
        if expert is not None:
            assert set(experts[rows].tolist()) == {expert}


# -- gpt-oss's expert function: biases, interleaved and transposed weights, the clamped gate --

GPT_OSS = ExpertFunction(gate="clamped_swiglu", activation="", alpha=1.702, limit=7.0, interleaved=True,
                         transposed=True, bias=True)


class BiasedWeights(Weights):
    """gpt-oss's experts as stored: [E, H, 2I], [E, I, H] and their biases."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, b_gu: torch.Tensor, b_d: torch.Tensor) -> None:
        super().__init__(gate_up, down)
        self.b_gu, self.b_d = b_gu, b_d

    def biases(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return self.b_gu[e], self.b_d[e]


def _gpt_oss_case(model: torch.dtype, hidden: int = 96, inter: int = 48, experts: int = 4, n: int = 48):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(experts, hidden, 2 * inter, generator=g) * 0.3).to(model)  # projections past +-7
    down = (torch.randn(experts, inter, hidden, generator=g) * 0.05).to(model)
    b_gu, b_d = (torch.randn(experts, 2 * inter, generator=g)).to(model), (torch.randn(experts, hidden, generator=g)).to(model)
    x = torch.randn(n, hidden, generator=g)
    w = torch.rand(n, generator=g)
    ex = torch.randint(0, experts, (n,), generator=g)
    return gate_up, down, b_gu, b_d, x, w, ex


def _gpt_oss_answer(case, model, fn=GPT_OSS, biased=True):  # type: ignore[no-untyped-def]
    gate_up, down, b_gu, b_d, x, w, ex = case
    xs = x.to(model)
    ys, ps = [], []
    for i in range(x.shape[0]):
        e = int(ex[i])
        y, p = expert_forward_projections(xs[i : i + 1], gate_up[e], down[e], fn, w[i : i + 1].to(model),
                                          (b_gu[e], b_d[e]) if biased else None)
        ys.append(y)
        ps.append(p)
    return xs, torch.cat(ys), torch.cat(ps)


@pytest.mark.parametrize("model", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
def test_gpt_oss_honest_rows_pass_and_its_shortcuts_fail(model):
    import dataclasses

    case = _gpt_oss_case(model)
    gate_up, down, b_gu, b_d, x, w, ex = case
    checker = RowChecker(BiasedWeights(gate_up, down, b_gu, b_d))
    xs, y, p = _gpt_oss_answer(case, model)
    g, u = p[:, : p.shape[1] // 2].float(), p[:, p.shape[1] // 2 :].float()
    assert float(g.max()) > 7 and float(u.abs().max()) > 7  # the clamps are exercised
    honest = checker.check(0, GPT_OSS, xs, w.to(model), ex, y, p)
    assert honest.passed and honest.z < 0.6 * ROW_CHECK_FACTOR, honest
    # A worker that leaves out the biases, or the clamps, or computes the plain SwiGLU over the
    # same weights: every such answer fails.
    no_bias = dataclasses.replace(GPT_OSS, bias=False)
    unclamped = dataclasses.replace(GPT_OSS, limit=1e30)
    for name, (fn, biased) in {"no biases": (no_bias, False), "no clamps": (unclamped, True)}.items():
        _, y2, p2 = _gpt_oss_answer(case, model, fn, biased)
        verdict = checker.check(0, GPT_OSS, xs, w.to(model), ex, y2, p2)
        assert not verdict.passed, name
    # The partials right but the projections of another layout (interleaved, as stored): refused.
    stored = torch.stack([xs[i : i + 1] @ gate_up[int(ex[i])] + b_gu[int(ex[i])] for i in range(xs.shape[0])])[:, 0]
    assert not checker.check(0, GPT_OSS, xs, w.to(model), ex, y, stored).passed
