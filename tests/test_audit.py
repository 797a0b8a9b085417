"""The audit's comparison and sampling, as pure functions: honest answers in any summation
order pass, the table's liars fail, and the sampler is unpredictable and covers first calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backbone.experts._audit import AuditRates, RowSampler
from kvasir_rpc import TOLERANCE_FACTOR, audit_rows, error_scale
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
    # Whether another summation order gives other bits depends on the BLAS; it passes either way.
    other = audit_rows(_reordered(x, gate_up, down, w), x, gate_up, down, act, w, rows)
    assert other.passed, other
    for liar in (_offset, _zeros, _nan):
        verdict = audit_rows(liar(x, gate_up, down, w), x, gate_up, down, act, w, rows)
        assert not verdict.passed, (liar.__name__, verdict)
        assert verdict.max_abs_diff > verdict.tolerance or verdict.max_abs_diff != verdict.max_abs_diff


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"H{s[0]}-I{s[1]}-x{s[2]}")
def test_the_reference_over_the_workers_segment_matches_an_honest_row_bit_for_bit(size):
    """A matmul may round a row differently alone than inside a batch of 32 (whether it does
    depends on the CPU's BLAS path: it does on an AMD EPYC, not on an AVX-512 Xeon). Audited
    with its whole segment (as the checker audits a segment of at most SEGMENT_ROWS rows), an
    honest row is equal bit for bit (no bound needed); audited alone it passes either way,
    by equal bits or by the bound; and a liar's row in the same segment still fails."""
    x, gate_up, down, w = _case(*size, seed=2)
    honest = expert_forward(x, gate_up, down, act, w)  # the worker's segment: 32 rows at once
    at = torch.tensor([3, 17, 30])
    rows = list(range(32))
    alone = audit_rows(honest[at], x[at], gate_up, down, act, w[at], at.tolist())
    with_segment = audit_rows(honest, x, gate_up, down, act, w, rows)
    assert alone.passed and with_segment.passed
    assert with_segment.exact == 32 and with_segment.max_abs_diff == 0.0
    # Rows that round differently on purpose (one ulp off the reference's own bits, on every
    # CPU) are not counted exact, and only the bound passes them.
    ref_alone = expert_forward(x[at], gate_up, down, act, w[at])
    off_by_one_ulp = torch.nextafter(ref_alone, torch.full_like(ref_alone, float("inf")))
    nudged = audit_rows(off_by_one_ulp, x[at], gate_up, down, act, w[at], at.tolist())
    assert nudged.passed and nudged.exact == 0 and 0.0 < nudged.max_abs_diff <= nudged.tolerance, nudged
    liar = honest.clone()
    liar[17] = _offset(x, gate_up, down, w)[17]
    verdict = audit_rows(liar, x, gate_up, down, act, w, rows)
    assert not verdict.passed and verdict.row == 17 and verdict.exact == 31, verdict


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


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_a_narrow_wire_allows_one_unit_in_the_last_place_and_no_more(wire):
    """An honest narrowed partial is the backbone's own rounded result or one step from it;
    two steps off on every element, or 0.9 of the old bound (4 half-ulps), is a lie."""
    x, gate_up, down, w = _case(64, 32, 1.0, 0.02)
    xb = x.to(wire)
    ref = expert_forward(xb.float(), gate_up, down, act, w).to(wire)
    rows = list(range(32))

    def steps(k: int) -> torch.Tensor:
        out = ref
        for _ in range(k):
            out = torch.nextafter(out, torch.full_like(out, float("inf")))
        return out

    one = audit_rows(steps(1), xb, gate_up, down, act, w, rows)
    assert one.passed and one.exact == 0
    assert not audit_rows(steps(2), xb, gate_up, down, act, w, rows).passed
    old_bound = ref.float() + 0.9 * 8 * 2.0**-9 * ref.float().abs()
    assert not audit_rows(old_bound.to(wire), xb, gate_up, down, act, w, rows).passed


def test_sampler_rate_first_call_and_unpredictability():
    s = RowSampler(0.02)
    first = s.choose("s1", [10])
    assert first.tolist() == list(range(10))  # a session's first call is always audited, a small segment whole
    counts = sum(s.choose("s1", [1000]).numel() for _ in range(50))
    assert 600 < counts < 1400  # a large segment row by row: 2% of 50,000 rows = 1000
    # Two samplers (two backbones, or one restarted) choose differently: seeded from the OS.
    a, b = RowSampler(0.5), RowSampler(0.5)
    assert not torch.equal(a.choose("x", [256]), b.choose("x", [256]))
    assert RowSampler(0.0).choose("y", [100]).numel() == 0
    assert RowSampler(0.5).choose("z", []).numel() == 0
    with pytest.raises(ValueError):
        RowSampler(1.5)


def test_sampler_audits_the_rate_of_the_work_not_more():
    """Small segments are drawn whole with probability ``rate``, so the audits recompute a
    ``rate`` share of the rows, and each row is audited with probability ``rate``: drawing
    rows and bringing in each drawn row's segment audited 1 - 0.98^16 = 28% of 16-row
    segments at a 2% rate."""
    from backbone.experts._audit import SEGMENT_ROWS

    s = RowSampler(0.02)
    s.choose("s", [1])  # the first call, audited whatever the draw
    sizes = [16] * 8 + [SEGMENT_ROWS] + [1, 0, 3]
    rows = sum(sizes)
    per_row = torch.zeros(rows)
    calls = 2000
    for _ in range(calls):
        picked = s.choose("s", sizes)
        per_row[picked] += 1
        # Whole segments or nothing, in ascending order.
        start, chosen = 0, set(picked.tolist())
        for n in sizes:
            seg = set(range(start, start + n))
            assert seg <= chosen or not (seg & chosen)
            start += n
        assert picked.tolist() == sorted(chosen)
    share = float(per_row.sum()) / (rows * calls)
    assert 0.014 < share < 0.026, share  # 2%, not 28%
    # Every row, in a segment of 16 or alone, audited at the rate: 40 expected of 2000 calls.
    assert 15 < float(per_row[:16].mean()) < 70 and 15 < float(per_row[128 + SEGMENT_ROWS]) < 70


class _Weights:
    """Experts by (layer, expert), as the checker reads them."""

    def __init__(self, experts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.experts = experts

    def get(self, layer: int, expert: int, *, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        return self.experts[expert]

    def biases(self, layer: int, expert: int) -> None:
        return None


def _answered_call(session_id: str, sizes: dict[int, int], lie_at: int | None = None):  # type: ignore[no-untyped-def]
    """A sent call with one segment per expert of ``sizes`` and a worker's answer to it
    (each segment computed in one forward, as the Python worker does), wrong at ``lie_at``."""
    import types
    from concurrent.futures import Future

    from backbone.experts._answers import SentCall
    from backbone.experts._links import CallRecord
    from kvasir_rpc import Route, encode_tensor, expert_pb2

    g = torch.Generator().manual_seed(5)
    experts = {e: (torch.randn(64, 64, generator=g) * 0.1, torch.randn(64, 32, generator=g) * 0.1) for e in sizes}
    total = sum(sizes.values())
    rows, weights = torch.randn(total, 64, generator=g), torch.rand(total, generator=g)
    routes, parts, start = [], [], 0
    for e, n in sizes.items():
        routes.append(Route(expert=e, token_idx=torch.arange(start, start + n), top_k_pos=torch.zeros(n, dtype=torch.long)))
        parts.append(expert_forward(rows[start : start + n], *experts[e], act, weights[start : start + n]))
        start += n
    out = torch.cat(parts)
    if lie_at is not None:
        out[lie_at] += 1e-3
    record = CallRecord(call_id=1, session_id=session_id, layer=0, rows=total, sent_ns=0, future=Future())
    sent = SentCall(record=record, routes=routes, link=types.SimpleNamespace(session_id=session_id, wallet="w"),  # type: ignore[arg-type]
                    rows=rows, weights=weights, index=None, request_bytes=0)
    return sent, expert_pb2.ExpertPartials(partials=encode_tensor(out)), _Weights(experts)


def test_a_sampled_row_brings_its_whole_small_segment_into_the_audit():
    """Each session's first call has one row sampled. In a segment of at most SEGMENT_ROWS
    rows, every row of the segment is then audited, bit-exact for an honest worker, and a
    lie on another row of it is caught; in a larger segment only the sampled row is."""
    from backbone.experts._answers import AnswerChecker
    from backbone.experts._audit import SEGMENT_ROWS

    sizes = {2: 10, 5: SEGMENT_ROWS + 12}
    seen = set()
    for i in range(200):  # the sampled row is random: until both segments were drawn
        sent, msg, weights = _answered_call(f"s{i}", sizes)
        checker = AnswerChecker(weights, AuditRates(base=1e-9, unchecked=0.0, new=0.0))  # type: ignore[arg-type]
        checked = checker.check(0, act, sent, msg, 64)
        out, evidence, sampled = checked.partials, checked.evidence, checked.sampled
        assert out is not None and evidence is None and sampled is not None
        small = bool((sampled.experts == 2).any())
        seen.add(small)
        assert checker.audit(sampled) is None
        if small:  # every row of the segment, each equal bit for bit to the reference
            assert sampled.picked.tolist() == list(range(10)) and checker.audit_exact_rows == 10
        else:
            assert len(sampled.picked) == 1 and int(sampled.picked[0]) >= 10
        if small:
            # A lie on a row that was not the sampled one is caught all the same.
            sent, msg, weights = _answered_call(f"liar{i}", sizes, lie_at=7)
            checker = AnswerChecker(weights, AuditRates(base=1e-9, unchecked=0.0, new=0.0))  # type: ignore[arg-type]
            sampled = checker.check(0, act, sent, msg, 64).sampled
            assert sampled is not None
            if bool((sampled.experts == 2).any()):
                caught = checker.audit(sampled)
                assert caught is not None and caught.row == 7 and caught.expert == 2
        if seen == {True, False}:
            break
    assert seen == {True, False}


def test_audit_rates_start_high_for_a_new_wallet_and_floor_a_session_without_row_checks():
    rates = AuditRates(base=0.02, unchecked=0.10, new=0.25, half_life_rows=2000)
    assert rates.rate(0, row_checked=True) == 0.25  # a fresh identity: a quarter of its work recomputed
    assert rates.rate(2000, row_checked=True) == 0.125
    assert rates.rate(2000 * 3, row_checked=True) == pytest.approx(0.25 / 8)
    assert rates.rate(10**6, row_checked=True) == 0.02  # earned its way down to the base rate
    assert rates.rate(10**6, row_checked=False) == 0.10  # without row checks, never under the floor
    assert rates.rate(0, row_checked=False) == 0.25
    assert AuditRates(base=0.0).rate(0, row_checked=False) == 0.0  # --audit-rate 0: audits off
    with pytest.raises(ValueError):
        AuditRates(new=1.5)
