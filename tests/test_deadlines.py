"""Deadlines from measured round trips (backbone/experts/_deadlines.py): plain arithmetic, no clock."""

from __future__ import annotations

import pytest

from backbone.experts._deadlines import RttEstimator, StragglerPolicy


def test_first_sample_sets_srtt_and_half_of_it_as_variation():
    est = RttEstimator()
    est.observe(0.2, rows=8)
    assert est.srtt == 0.2 and est.rttvar == 0.1 and est.rows == 8 and est.samples == 1


def test_later_samples_follow_rfc_6298_gains():
    est = RttEstimator()
    est.observe(0.2, rows=8)
    est.observe(0.6, rows=8)
    # rttvar = 3/4 * 0.1 + 1/4 * |0.2 - 0.6|; srtt = 7/8 * 0.2 + 1/8 * 0.6
    assert est.rttvar == pytest.approx(0.175)
    assert est.srtt == pytest.approx(0.25)


def test_a_steady_link_converges_and_its_variation_decays():
    est = RttEstimator()
    for _ in range(200):  # bounded
        est.observe(0.01, rows=4)
    assert est.srtt == pytest.approx(0.01) and est.rttvar < 1e-6


def test_deadline_is_the_initial_one_before_any_measurement():
    policy = StragglerPolicy(factor=3, floor_s=2, cap_s=30, initial_s=3)
    assert RttEstimator().deadline_s(policy, rows=100) == 3
    # Never more than the call timeout, never less than the floor.
    assert RttEstimator().deadline_s(StragglerPolicy(cap_s=1.5, floor_s=1), rows=1) == 1.5
    assert RttEstimator().deadline_s(StragglerPolicy(floor_s=5, initial_s=3), rows=1) == 5


def test_deadline_is_factor_times_srtt_plus_four_rttvar_clamped():
    est = RttEstimator()
    est.observe(1.0, rows=10)  # srtt 1.0, rttvar 0.5
    assert est.deadline_s(StragglerPolicy(factor=2, floor_s=0.1, cap_s=30), rows=10) == pytest.approx(6.0)
    assert est.deadline_s(StragglerPolicy(factor=2, floor_s=0.1, cap_s=5), rows=10) == 5.0  # capped
    fast = RttEstimator()
    fast.observe(0.002, rows=10)
    assert fast.deadline_s(StragglerPolicy(factor=3, floor_s=2), rows=10) == 2.0  # floored


def test_a_call_with_more_rows_than_usual_gets_more_time_and_fewer_never_less():
    est = RttEstimator()
    est.observe(1.0, rows=10)
    policy = StragglerPolicy(factor=1, floor_s=0.1, cap_s=100)
    assert est.deadline_s(policy, rows=40) == pytest.approx(4 * est.deadline_s(policy, rows=10))
    assert est.deadline_s(policy, rows=1) == est.deadline_s(policy, rows=10)


def test_factor_zero_waits_the_call_timeout():
    est = RttEstimator()
    est.observe(0.001, rows=1)
    policy = StragglerPolicy(factor=0, cap_s=30)
    assert not policy.hedging
    assert est.deadline_s(policy, rows=1) == 30 and RttEstimator().deadline_s(policy, rows=1) == 30


@pytest.mark.parametrize("bad", [dict(factor=-1), dict(factor=float("nan")), dict(floor_s=0), dict(cap_s=0),
                                 dict(initial_s=-1), dict(max_misses=0)])
def test_a_bad_policy_is_refused_naming_the_setting(bad):
    with pytest.raises(ValueError, match="must be"):
        StragglerPolicy(**bad)


def test_a_negative_round_trip_is_refused():
    with pytest.raises(ValueError, match="negative"):
        RttEstimator().observe(-0.1, rows=1)
