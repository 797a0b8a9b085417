"""Token buckets keyed by a string (a source address, or one key for a whole service), in a
table of bounded size that forgets the least recently seen key first. The gateway limits new
connections per source address with it; the hub, new sessions per address and in all.

Sans-IO: the clock is injectable and nothing here awaits, so the logic is tested on a fake
clock (tests/test_rate_limit.py, tests/test_session_rate.py).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["TokenBuckets"]


class TokenBuckets:
    """A token bucket per key: ``rate`` tokens a second, up to ``burst`` (default: ``rate``);
    a key seen for the first time starts full.

    The table holds at most ``max_entries`` keys, least recently seen first: a new one beyond
    that evicts the oldest, so a caller rotating keys (an attacker rotating addresses) cannot
    grow it. An evicted key starts again with a full bucket, which is what it would have after
    a quiet spell anyway; with the default size, evicting a still-limited one takes tens of
    thousands of keys within its refill time.

    ``allow`` takes a token or refuses; ``wait_s`` says how long until a cost could be taken,
    changing nothing; ``take`` takes it; ``charge`` takes a penalty whatever the balance, into
    debt down to ``-burst``. Raises ValueError for a negative rate or burst, or a table of no
    entries (a rate or burst of zero refuses everything)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic, *, burst: float | None = None,
                 max_entries: int = 65536) -> None:
        if max_entries < 1:
            raise ValueError("the rate limiter needs room for at least one address")
        if not rate >= 0 or not (burst is None or burst >= 0):
            raise ValueError(f"a token bucket needs a rate and a burst of at least zero (got {rate}, {burst})")
        self.rate = rate
        self.burst = rate if burst is None else burst
        self.max_entries = max_entries
        self._clock = clock
        # key -> (tokens, when last refilled), least recently seen first.
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def _tokens(self, key: str, now: float) -> float:
        tokens, last = self._buckets.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - last) * self.rate)

    def _store(self, key: str, tokens: float, now: float) -> None:
        self._buckets.pop(key, None)
        self._buckets[key] = (tokens, now)  # now the most recent
        if len(self._buckets) > self.max_entries:
            self._buckets.popitem(last=False)

    def allow(self, key: str) -> bool:
        """Take one token for ``key`` if it has one. A refused try keeps what the bucket holds
        and counts as seeing the key (it becomes the most recent)."""
        now = self._clock()
        tokens = self._tokens(key, now)
        allowed = tokens >= 1.0
        self._store(key, tokens - 1.0 if allowed else tokens, now)
        return allowed

    def wait_s(self, key: str, cost: float) -> float:
        """Seconds until ``key``'s bucket holds ``cost`` tokens: 0.0 when it does now. Changes
        nothing (a key not in the table is not added). A cost above the burst is never met:
        ``math.inf``."""
        missing = cost - self._tokens(key, self._clock())
        if missing <= 0:
            return 0.0
        return missing / self.rate if cost <= self.burst and self.rate > 0 else math.inf

    def take(self, key: str, cost: float) -> bool:
        """Take ``cost`` tokens from ``key``'s bucket if it holds them (True), else change
        nothing (False)."""
        now = self._clock()
        tokens = self._tokens(key, now)
        if tokens < cost:
            return False
        self._store(key, tokens - cost, now)
        return True

    def charge(self, key: str, cost: float) -> None:
        """Take ``cost`` tokens from ``key``'s bucket whatever it holds, down to ``-burst`` at
        most: a debt its refill must pay back before it can take anything again."""
        now = self._clock()
        self._store(key, max(-self.burst, self._tokens(key, now) - cost), now)
