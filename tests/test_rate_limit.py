"""The gateway's per-address limit on new connections, on a fake clock: a burst of ``rate``,
refilled at ``rate`` a second, each address (an IPv4 address, an IPv6 /64) on its own, in a
table of bounded size that forgets the least recently seen address first."""

from __future__ import annotations

import pytest

from kvasir_rpc import address_key
from relay._gateway import _RateLimiter


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def allowed(limiter: _RateLimiter, key: str, tries: int) -> int:
    return sum(limiter.allow(key) for _ in range(tries))


@pytest.mark.parametrize("rate", [1.0, 5.0, 50.0])
def test_a_burst_of_rate_then_refused(rate: float) -> None:
    limiter = _RateLimiter(rate, clock=FakeClock())
    assert allowed(limiter, "10.0.0.1", int(rate) + 20) == int(rate)
    assert not limiter.allow("10.0.0.1")


def test_tokens_refill_at_rate_per_second_up_to_the_burst() -> None:
    clock = FakeClock()
    limiter = _RateLimiter(8.0, clock=clock)  # steps of 1/16 s: exact in binary floating point
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
    limiter = _RateLimiter(2.0, clock=FakeClock())
    assert allowed(limiter, "a", 5) == 2
    assert allowed(limiter, "b", 5) == 2
    assert not limiter.allow("a") and not limiter.allow("b")


def test_the_table_is_hard_bounded_and_forgets_the_least_recently_seen() -> None:
    clock = FakeClock()
    limiter = _RateLimiter(1.0, clock=clock, max_entries=1000)

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
    limiter = _RateLimiter(1.0, clock=clock, max_entries=3)
    assert limiter.allow("a") and limiter.allow("b") and limiter.allow("c")
    assert not limiter.allow("a")  # seen again (refused): now the most recent
    assert limiter.allow("d")  # evicts "b", the least recently seen
    assert list(limiter._buckets) == ["c", "a", "d"]
    assert not limiter.allow("a")  # still remembered, still limited


def test_a_table_of_no_entries_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        _RateLimiter(1.0, max_entries=0)


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
    limiter = _RateLimiter(2.0, clock=FakeClock())
    hosts = [f"2001:db8:1:2::{i:x}" for i in range(1, 6)]
    assert sum(limiter.allow(address_key(h)) for h in hosts) == 2
    assert limiter.allow(address_key("2001:db8:1:3::1"))  # the next /64 is another address
