"""The hub's rate of new sessions, on a fake clock: a bucket per address and one for the whole
hub, counted in new wallets; a returning wallet with a clean record costs less than a new one,
a recently quarantined one more; a quarantine charges the liar's address; refused tries cost
nothing; the address table is bounded. Every wait here is an exact binary fraction of a
second, so the arithmetic is exact."""

from __future__ import annotations

import pytest

from relay.hub._admission import (
    COSTS,
    QUARANTINE_PENALTY,
    SUSPECT_FOR_S,
    SessionRate,
    SessionRateLimits,
    Standing,
    WalletHistory,
    standing_of,
)

NEW, RETURNING, SUSPECT = Standing.NEW, Standing.RETURNING, Standing.SUSPECT
DAY_MS = 24 * 3600 * 1000


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admitted(rate: SessionRate, address: str, standing: Standing, tries: int, *, holds: bool = False) -> int:
    return sum(rate.admit(address, standing, holds_session=holds) is None for _ in range(tries))


def test_defaults_let_an_address_start_its_whole_session_cap_of_new_wallets_then_a_few_a_minute() -> None:
    clock = FakeClock()
    rate = SessionRate(clock=clock)
    assert admitted(rate, "203.0.113.7", NEW, 32) == 32  # the per-address cap's worth, at once
    refused = rate.admit("203.0.113.7", NEW)
    assert refused is not None and refused.limit == "address" and refused.wait_s == 10.0
    assert refused.reason == ("new sessions from this address come too fast (a wallet new here counts more); "
                              "retry in 10 s")
    # Refused tries take nothing: retrying does not push the wait further out.
    clock.now += 5
    assert admitted(rate, "203.0.113.7", NEW, 50) == 0
    clock.now += 5
    assert admitted(rate, "203.0.113.7", NEW, 5) == 1
    # Six a minute from then on.
    clock.now += 60
    assert admitted(rate, "203.0.113.7", NEW, 20) == 6


def test_the_liars_churn_is_slowed_to_what_the_refill_and_the_penalty_allow() -> None:
    """The attack that ran against main: caught, quarantined, back with a fresh wallet within
    ~90 ms, 17 wallets in 1.5 s. Now an address burns its burst once; after it each fresh
    wallet waits for its own token and for the penalty of the one caught before it."""
    clock = FakeClock()
    rate = SessionRate(clock=clock)
    wallets = 0
    while clock.now < 1000 + 3600:  # an hour of trying every 1/16 s
        if rate.admit("198.51.100.9", NEW) is None:
            wallets += 1
            rate.penalize("198.51.100.9")  # caught on its first call and quarantined
        clock.now += 1 / 16
    per_wallet_s = (1 + QUARANTINE_PENALTY) / (6 / 60)  # a new wallet and a penalty, refilled
    assert wallets == pytest.approx(32 / (1 + QUARANTINE_PENALTY) + 3600 / per_wallet_s, abs=2)
    assert wallets < 100  # not 17 every 1.5 s (about 40,000 an hour)


def test_addresses_are_limited_separately() -> None:
    rate = SessionRate(SessionRateLimits(address_burst=2), clock=FakeClock())
    assert admitted(rate, "10.0.0.1", NEW, 5) == 2
    assert admitted(rate, "10.0.0.2", NEW, 5) == 2
    assert admitted(rate, "2001:db8:1:2::/64", NEW, 5) == 2


def test_the_hub_bucket_bounds_strangers_from_many_addresses_and_keeps_no_refused_address() -> None:
    clock = FakeClock()
    rate = SessionRate(SessionRateLimits(hub_burst=4, hub_per_minute=15), clock=clock)
    assert [rate.admit(f"10.0.0.{i}", NEW) is None for i in range(6)] == [True] * 4 + [False] * 2
    refused = rate.admit("10.0.1.1", NEW)
    assert refused is not None and refused.limit == "hub" and refused.wait_s == 4.0
    assert refused.reason == "new wallets are joining this hub too fast; retry in 4 s"
    # An address the hub refused is not remembered: rotating addresses cannot flush the table.
    assert rate.statistics().addresses == 4
    clock.now += 4
    assert rate.admit("10.0.1.1", NEW) is None


def test_a_returning_wallet_costs_half_at_its_address_and_nothing_at_the_hub() -> None:
    rate = SessionRate(SessionRateLimits(hub_burst=2), clock=FakeClock())
    assert admitted(rate, "10.0.0.1", NEW, 3) == 2  # strangers have used up the hub's burst
    # The workers that already serve this hub still come back (after its restart, say) ...
    assert admitted(rate, "10.0.0.9", RETURNING, 70) == 64  # ... two for one new wallet per address
    assert rate.admit("10.0.0.9", RETURNING).limit == "address"  # type: ignore[union-attr]


def test_a_recently_quarantined_wallet_costs_more() -> None:
    clock = FakeClock()
    rate = SessionRate(clock=clock)
    assert admitted(rate, "10.0.0.1", SUSPECT, 20) == 8  # four new wallets each
    refused = rate.admit("10.0.0.1", SUSPECT)
    assert refused is not None and refused.wait_s == 40.0
    clock.now += 10
    assert rate.admit("10.0.0.1", SUSPECT) is not None and rate.admit("10.0.0.1", NEW) is None


def test_a_suspect_costs_at_most_the_burst_so_a_small_burst_still_admits_it() -> None:
    clock = FakeClock()
    rate = SessionRate(SessionRateLimits(address_burst=2, hub_burst=1, hub_per_minute=1), clock=clock)
    assert rate.admit("10.0.0.1", SUSPECT) is None
    refused = rate.admit("10.0.0.1", SUSPECT)
    assert refused is not None and refused.wait_s == 60.0  # the hub's one token, at one a minute


@pytest.mark.parametrize("standing", list(Standing))
def test_further_sessions_of_a_connected_wallet_cost_what_a_returning_one_does(standing: Standing) -> None:
    """A worker holding several sessions (``--sessions 8``) pays for its identity once."""
    rate = SessionRate(clock=FakeClock())
    assert rate.admit("10.0.0.1", standing) is None
    assert admitted(rate, "10.0.0.1", standing, 7, holds=True) == 7
    first = COSTS[standing][0]
    assert admitted(rate, "10.0.0.1", NEW, 100) == int(32 - first - 7 * 0.5)


def test_the_soak_swarm_joins_at_once_under_the_defaults() -> None:
    """tests/test_soak.py: four worker processes, eight sessions each under one wallet, all
    from 127.0.0.1, dialling together; and a ninth worker's eight right after."""
    rate = SessionRate(clock=FakeClock())
    for _ in range(5):
        assert rate.admit("127.0.0.1", NEW) is None
        assert admitted(rate, "127.0.0.1", NEW, 7, holds=True) == 7


def test_a_quarantine_charges_the_address_into_debt_bounded_by_the_burst() -> None:
    clock = FakeClock()
    rate = SessionRate(clock=clock)
    assert rate.admit("10.0.0.1", NEW) is None
    rate.penalize("10.0.0.1")
    assert admitted(rate, "10.0.0.1", NEW, 40) == 32 - 1 - int(QUARANTINE_PENALTY)
    for _ in range(100):  # a liar's many sessions, all quarantined
        rate.penalize("10.0.0.1")
    refused = rate.admit("10.0.0.1", NEW)
    assert refused is not None and refused.wait_s == (32 + 1) * 10  # from -burst back to one token
    assert rate.admit("10.0.0.2", NEW) is None  # its neighbour is not charged
    assert rate.statistics().penalties == 101


def test_the_address_table_is_bounded_and_forgets_the_least_recently_admitted() -> None:
    rate = SessionRate(SessionRateLimits(address_burst=1, hub_burst=10_000, hub_per_minute=1, max_addresses=100),
                       clock=FakeClock())
    assert rate.admit("victim", NEW) is None and rate.admit("victim", NEW) is not None
    for i in range(1000):
        assert rate.admit(f"10.0.{i >> 8}.{i & 255}", NEW) is None
        assert rate.statistics().addresses <= 100
    assert rate.admit("victim", NEW) is None  # forgotten: a full bucket, as after a quiet spell


def test_statistics_count_admitted_by_standing_and_refused_by_limit_and_standing() -> None:
    rate = SessionRate(SessionRateLimits(address_burst=1, hub_burst=2), clock=FakeClock())
    rate.admit("a", NEW)
    rate.admit("a", NEW)  # the address's one token is gone
    rate.admit("b", RETURNING)
    rate.admit("c", NEW)
    rate.admit("d", SUSPECT)  # the hub's second token went to "c"
    stats = rate.statistics()
    assert stats.admitted == {"new": 2, "returning": 1, "suspect": 0}
    assert stats.refused == {("address", "new"): 1, ("hub", "suspect"): 1}
    assert stats.penalties == 0 and stats.addresses == 3


@pytest.mark.parametrize(("history", "days_ago_checked", "standing"), [
    (WalletHistory(), 0, NEW),
    (WalletHistory(accepted_work=True), 0, RETURNING),
    (WalletHistory(accepted_work=True, last_quarantined_unix_ms=0), 29, SUSPECT),
    (WalletHistory(accepted_work=False, last_quarantined_unix_ms=0), 29, SUSPECT),
    (WalletHistory(accepted_work=True, last_quarantined_unix_ms=0), 30, RETURNING),
    (WalletHistory(accepted_work=False, last_quarantined_unix_ms=0), 31, NEW),
])
def test_standing_from_the_wallets_history(history: WalletHistory, days_ago_checked: int, standing: Standing) -> None:
    assert SUSPECT_FOR_S == 30 * 24 * 3600
    assert standing_of(history, days_ago_checked * DAY_MS) is standing


@pytest.mark.parametrize(("field", "value", "says"), [
    ("address_burst", 0.5, "address_burst must be at least 1"),
    ("hub_burst", 0, "hub_burst must be at least 1"),
    ("address_per_minute", 0, "address_per_minute must be above 0"),
    ("hub_per_minute", -1, "hub_per_minute must be above 0"),
    ("max_addresses", 0, "max_addresses must be at least 1"),
])
def test_limits_that_would_refuse_everyone_are_refused(field: str, value: float, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        SessionRateLimits(**{field: value})  # type: ignore[arg-type]
