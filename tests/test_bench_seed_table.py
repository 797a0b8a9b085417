"""``kvasir bench --seed-table``'s pure parts: the overhead from two rates, and the table built
from given figures, with the edge measured and skipped."""

from __future__ import annotations

import pytest

from kvasir.bench.seed_table import SEED_TABLE_MODEL, added_ms, overhead, overhead_at_seed_token, seed_rows, seed_table


def _result(*, edge: bool) -> dict[str, object]:
    medians = {"local": 5.0, "gateway": 4.5, **({"edge": 4.0} if edge else {})}
    return {
        "batching": {"hidden": 2048, "inter": 768, "rows_s": {"1": 1000.0, "512": 40000.0},
                     "p50_ms": {"1": 1.0, "512": 12.8}, "b512_over_b1": 40.0},
        "decode": {"model": SEED_TABLE_MODEL, "rtt_ms": 13, "rounds": 5, "new_tokens": 32,
                   "median_tokens_per_s": medians,
                   "overhead": {p: round(overhead(v, 5.0), 4) for p, v in medians.items() if p != "local"},
                   "overhead_by_round": {p: [0.05, 0.1, 0.15] for p in medians if p != "local"},
                   "added_ms_per_token": {p: round(added_ms(v, 5.0), 1) for p, v in medians.items() if p != "local"},
                   "local_ms_per_token": 200.0,
                   "texts_identical": {p: True for p in medians},
                   "verdict": {p: "bitwise equal" for p in medians if p != "local"},
                   "skipped": {} if edge else {"edge": "nginx not found: install Debian's nginx"}},
    }


def test_overhead_is_the_share_of_local_throughput_lost():
    assert overhead(4.169, 4.220) == pytest.approx(0.0121, abs=1e-4)  # the seed's 1.2%
    assert overhead(5.0, 5.0) == 0.0
    assert overhead(6.0, 5.0) == pytest.approx(-0.2)  # faster than local: a negative overhead, not hidden
    with pytest.raises(ValueError, match="positive"):
        overhead(1.0, 0.0)


def test_added_time_per_token_and_its_share_of_the_seeds_token():
    assert added_ms(4.0, 5.0) == pytest.approx(50.0)  # 250 ms a token against 200
    assert overhead_at_seed_token(0.0) == 0.0
    # The seed's own: 4.220 -> 4.169 tok/s is 2.9 ms a token, 1.2% of its 237 ms token.
    assert overhead_at_seed_token(added_ms(4.169, 4.220)) == pytest.approx(overhead(4.169, 4.220))
    with pytest.raises(ValueError, match="positive"):
        added_ms(0.0, 5.0)


def test_the_table_puts_each_seed_figure_beside_ours():
    rows = seed_rows(_result(edge=True))
    assert [r.seed for r in rows] == ["77x (GPU)", "1.2% (4.220 -> 4.169 tok/s)", "~28% (CDN edge)"]
    assert rows[0].ours == "40.0x"
    assert rows[1].ours == "10.0% (5.0 -> 4.5 tok/s)"
    assert rows[2].ours == "20.0% (5.0 -> 4.0 tok/s)"
    assert "tokens identical (bitwise equal)" in rows[1].how and "nginx" in rows[2].how
    assert "by round 5.0% to 15.0%" in rows[1].how
    assert "+22.2 ms on a 200.0 ms token" in rows[1].how  # 1000/4.5 - 1000/5
    assert "40,000 rows/s at 512 over 1,000 at 1" in rows[0].how
    text = seed_table(_result(edge=True))
    assert all(r.ours in text and r.seed in text and r.how in text for r in rows)


def test_a_skipped_edge_says_why_and_shows_no_number():
    rows = seed_rows(_result(edge=False))
    assert rows[2].ours == "skipped: nginx not found: install Debian's nginx"
    assert "%" not in rows[2].ours and "tok/s" not in rows[2].ours


def test_differing_tokens_and_fallbacks_are_reported():
    result = _result(edge=True)
    assert "computed here" not in seed_rows(result)[1].how
    result["decode"]["texts_identical"]["gateway"] = False  # type: ignore[index]
    result["decode"]["fallback_calls"] = {"gateway": 3, "edge": 0}  # type: ignore[index]
    rows = seed_rows(result)
    assert "TOKENS DIFFER" in rows[1].how and "3 calls computed here after all" in rows[1].how
    assert "computed here" not in rows[2].how
