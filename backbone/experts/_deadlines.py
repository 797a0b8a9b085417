"""How long the backbone waits on one worker's call: deadlines that follow the worker's
measured round trips. No I/O and no clock: the caller passes the seconds it measured.

A link keeps an ``RttEstimator`` of the calls answered in time (RFC 6298's smoothed round
trip ``srtt`` and its variation ``rttvar``, plus the smoothed rows per call, since a call of
many rows takes longer). A call's deadline is

    clamp(factor * (srtt + 4 * rttvar) * max(1, rows / smoothed rows), floor, cap)

and ``initial`` (at most ``cap``) while the link has no measurement yet. Past its deadline a
call is *late*: the backbone computes it here and drops the answer if it still comes. The
cap is the call timeout: a call that waited that long is *lost* and its link dropped.
"""

from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT_STRAGGLER_FACTOR", "DEFAULT_STRAGGLER_FLOOR_S", "RttEstimator", "StragglerPolicy"]

DEFAULT_STRAGGLER_FACTOR = 3.0
# Above the stalls an honest worker on a loaded machine shows (scheduling, GC), far below
# the call timeout: a stalled call costs this much, not 30 s.
DEFAULT_STRAGGLER_FLOOR_S = 2.0


@dataclasses.dataclass(frozen=True)
class StragglerPolicy:
    """When a call is late (hedged: computed here) and when it is lost (its link dropped).

    ``factor`` 0 turns hedging off: every call waits ``cap_s``, as a lost one. ``initial_s``
    is the deadline of a link without a measured round trip (RFC 2988's classic 3 s).
    ``max_misses``: late calls in a row, with no answer on time between them, after which
    the link is dropped as if lost; one late call alone never drops it.
    """

    factor: float = DEFAULT_STRAGGLER_FACTOR
    floor_s: float = DEFAULT_STRAGGLER_FLOOR_S
    cap_s: float = 30.0
    initial_s: float = 3.0
    max_misses: int = 3

    def __post_init__(self) -> None:
        if not self.factor >= 0.0:
            raise ValueError(f"straggler factor must be 0 (off) or positive, got {self.factor}")
        if not 0.0 < self.floor_s:
            raise ValueError(f"straggler floor must be positive seconds, got {self.floor_s}")
        if not 0.0 < self.cap_s:
            raise ValueError(f"call timeout must be positive seconds, got {self.cap_s}")
        if not 0.0 < self.initial_s:
            raise ValueError(f"initial deadline must be positive seconds, got {self.initial_s}")
        if self.max_misses < 1:
            raise ValueError(f"max_misses must be at least 1, got {self.max_misses}")

    @property
    def hedging(self) -> bool:
        return self.factor > 0.0


class RttEstimator:
    """Smoothed round trip and variation of one link's answered calls (not thread-safe: the
    link's lock guards it)."""

    ALPHA = 1 / 8  # gain of srtt (RFC 6298)
    BETA = 1 / 4  # gain of rttvar

    def __init__(self) -> None:
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.rows = 0.0  # smoothed rows per call
        self.samples = 0

    def observe(self, seconds: float, rows: int) -> None:
        """One call of ``rows`` assignments was answered ``seconds`` after it left."""
        if not seconds >= 0.0:
            raise ValueError(f"a round trip cannot be negative, got {seconds}")
        if self.srtt is None:
            self.srtt, self.rttvar, self.rows = seconds, seconds / 2, float(rows)
        else:
            self.rttvar = (1 - self.BETA) * self.rttvar + self.BETA * abs(self.srtt - seconds)
            self.srtt = (1 - self.ALPHA) * self.srtt + self.ALPHA * seconds
            self.rows = (1 - self.ALPHA) * self.rows + self.ALPHA * rows
        self.samples += 1

    def deadline_s(self, policy: StragglerPolicy, rows: int) -> float:
        """Seconds a call of ``rows`` assignments may take before it is late (or, at
        ``policy.cap_s``, lost)."""
        if not policy.hedging:
            return policy.cap_s
        if self.srtt is None:
            return min(max(policy.initial_s, policy.floor_s), policy.cap_s)
        scale = max(1.0, rows / self.rows) if self.rows > 0 else 1.0
        wait = policy.factor * (self.srtt + 4 * self.rttvar) * scale
        return min(max(wait, policy.floor_s), policy.cap_s)
