"""The gateway's per-address limit on new connections, on a fake clock: a burst of ``rate``,
refilled at ``rate`` a second, each address on its own, quiet addresses forgotten."""

from __future__ import annotations

import pytest

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


def test_quiet_addresses_are_forgotten_so_memory_stays_bounded() -> None:
    clock = FakeClock()
    limiter = _RateLimiter(1.0, clock=clock)

    def address(i: int) -> str:
        return f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}"

    for i in range(32_768):
        assert limiter.allow(address(i))
    clock.now += 11  # those went quiet for longer than the table remembers (10 s)
    for i in range(32_768, 65_537):  # one more than the table holds before it prunes
        assert limiter.allow(address(i))
    # This call prunes; the recent addresses are remembered, so this one is still refused.
    assert not limiter.allow(address(65_536))
    table = limiter._buckets  # bounded memory is the point here
    assert len(table) == 65_537 - 32_768 and address(0) not in table
    assert limiter.allow(address(0))  # a forgotten address starts afresh with a full bucket
