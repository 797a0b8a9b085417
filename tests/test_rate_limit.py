"""Token buckets per key (relay._buckets), on a fake clock. As the gateway limits new
connections per address: a burst of ``rate``, refilled at ``rate`` a second, each address (an
IPv4 address, an IPv6 /64) on its own, in a table of bounded size that forgets the least
recently seen address first. As the hub limits new sessions (tests/test_session_rate.py): a
burst of its own, costs other than one, a wait to tell the refused, and a debt."""

from __future__ import annotations

import pytest

from kvasir_rpc import address_key
from relay._buckets import TokenBuckets


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def allowed(limiter: TokenBuckets, key: str, tries: int) -> int:
    return sum(limiter.allow(key) for _ in range(tries))


@pytest.mark.parametrize("rate", [1.0, 5.0, 50.0])
def test_a_burst_of_rate_then_refused(rate: float) -> None:
    limiter = TokenBuckets(rate, clock=FakeClock())
    assert allowed(limiter, "10.0.0.1", int(rate) + 20) == int(rate)
    assert not limiter.allow("10.0.0.1")


def test_tokens_refill_at_rate_per_second_up_to_the_burst() -> None:
    clock = FakeClock()
    limiter = TokenBuckets(8.0, clock=clock)  # steps of 1/16 s: exact in binary floating point
    assert allowed(limiter, "a", 10) == 8
    clock.now += 1 / 16  # half a token
    assert not limiter.allow("a")
    clock.now += 1 / 16  # the half kept from the refused try, plus another half
    assert limiter.allow("a") and not limiter.allow("a")
    clock.now += 3 / 8
    assert allowed(limiter, "a", 10) == 3
    clock.now += 3600  # a long quiet spell refills to the burst, never beyond
    assert allowed(limiter, "a", 100) == 8


def test_addresses_are_limited_separately() -> None:
    limiter = TokenBuckets(2.0, clock=FakeClock())
    assert allowed(limiter, "a", 5) == 2
    assert allowed(limiter, "b", 5) == 2
    assert not limiter.allow("a") and not limiter.allow("b")


def test_the_table_is_hard_bounded_and_forgets_the_least_recently_seen() -> None:
    clock = FakeClock()
    limiter = TokenBuckets(1.0, clock=clock, max_entries=1000)

    def address(i: int) -> str:
        return f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}"

    assert limiter.allow("victim") and not limiter.allow("victim")  # limited: its bucket is empty
    # An attacker rotating fresh addresses, all within the same instant (nothing is quiet):
    # the table never passes its bound however many arrive.
    for i in range(50_000):
        assert limiter.allow(address(i))
        assert len(limiter) <= 1000
    assert len(limiter) == 1000
    assert address(50_000 - 1000) in limiter._buckets and address(50_000 - 1001) not in limiter._buckets
    # The victim was the oldest and went first; forgotten, it starts with a full bucket.
    assert "victim" not in limiter._buckets and limiter.allow("victim")


def test_a_recent_address_survives_a_rotation_that_evicts_older_ones() -> None:
    clock = FakeClock()
    limiter = TokenBuckets(1.0, clock=clock, max_entries=3)
    assert limiter.allow("a") and limiter.allow("b") and limiter.allow("c")
    assert not limiter.allow("a")  # seen again (refused): now the most recent
    assert limiter.allow("d")  # evicts "b", the least recently seen
    assert list(limiter._buckets) == ["c", "a", "d"]
    assert not limiter.allow("a")  # still remembered, still limited


def test_a_table_of_no_entries_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        TokenBuckets(1.0, max_entries=0)


@pytest.mark.parametrize(("host", "key"), [
    ("203.0.113.7", "203.0.113.7"),
    ("::ffff:203.0.113.7", "203.0.113.7"),  # IPv4-mapped: the IPv4 address
    ("2001:db8:1:2:aaaa:bbbb:cccc:dddd", "2001:db8:1:2::/64"),
    ("2001:db8:1:2::1", "2001:db8:1:2::/64"),  # the same /64: one key
    ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
    ("fe80::1%eth0", "fe80::/64"),
    ("not-an-address", "not-an-address"),
])
def test_address_keys_are_ipv4_addresses_and_ipv6_slash_64s(host: str, key: str) -> None:
    assert address_key(host) == key


def test_one_ipv6_slash_64_shares_one_bucket() -> None:
    limiter = TokenBuckets(2.0, clock=FakeClock())
    hosts = [f"2001:db8:1:2::{i:x}" for i in range(1, 6)]
    assert sum(limiter.allow(address_key(h)) for h in hosts) == 2
    assert limiter.allow(address_key("2001:db8:1:3::1"))  # the next /64 is another address


def test_a_burst_of_its_own_and_costs_other_than_one() -> None:
    clock = FakeClock()
    buckets = TokenBuckets(0.25, clock, burst=4.0)
    assert buckets.take("a", 0.5) and buckets.take("a", 3.0)
    assert not buckets.take("a", 1.0)  # half a token left: nothing taken
    assert buckets.wait_s("a", 1.0) == 2.0  # the missing half at a quarter a second
    clock.now += 2
    assert buckets.wait_s("a", 1.0) == 0.0 and buckets.take("a", 1.0)
    clock.now += 3600
    assert buckets.wait_s("a", 4.0) == 0.0 and buckets.wait_s("a", 4.5) == float("inf")  # never beyond the burst


def test_wait_s_changes_nothing() -> None:
    buckets = TokenBuckets(1.0, FakeClock(), burst=2.0, max_entries=1)
    assert buckets.take("a", 2.0)
    assert buckets.wait_s("b", 1.0) == 0.0  # a key not in the table is not added ...
    assert list(buckets._buckets) == ["a"]  # ... nor does it evict one
    assert buckets.wait_s("a", 1.0) == 1.0 and buckets.wait_s("a", 1.0) == 1.0


def test_a_charge_goes_into_debt_down_to_minus_the_burst() -> None:
    clock = FakeClock()
    buckets = TokenBuckets(0.5, clock, burst=4.0)
    buckets.charge("a", 6.0)
    assert buckets.wait_s("a", 1.0) == 6.0  # from -2 to 1 at half a token a second
    buckets.charge("a", 100.0)
    assert buckets.wait_s("a", 1.0) == 10.0  # from -4
    clock.now += 10
    assert buckets.take("a", 1.0)


def test_a_zero_rate_refuses_everything() -> None:
    """The gateway's ``--max-new-per-ip 0`` refused every connection; it still does."""
    buckets = TokenBuckets(0.0, FakeClock())
    assert not buckets.allow("a")
    assert buckets.wait_s("a", 1.0) == float("inf")
    with pytest.raises(ValueError, match="at least zero"):
        TokenBuckets(-1.0)
