"""How fast the hub admits new sessions: identities cost something.

A wallet is a key anyone makes in a millisecond, and a worker reconnects in a tenth of a
second, so a liar quarantined by wallet would come straight back as a fresh one. Caps on live
sessions do not stop that (the liar holds one session at a time); this does: after its hello
is verified and before it is accepted, every new session takes tokens from two buckets (see
``relay._buckets``), one per source address (``kvasir_rpc.address_key``: IPv4 by address,
IPv6 by /64; through a gateway, the worker's address the gateway reports) and one for the
whole hub. Without enough tokens the session is refused with close 4205 (retry) and the wait.

Tokens are counted in new wallets, and what a session costs depends on what this hub knows
of its wallet (``Standing``, from its contribution store, ``WalletHistory``):

============  ===========================================================  =====  ====
standing      the wallet                                                   addr.  hub
============  ===========================================================  =====  ====
returning     did work here that the backbone accepted; no recent           1/2    0
              quarantine
new           anything else: never seen, or seen but never paid for work    1      1
suspect       quarantined here within ``SUSPECT_FOR_S``                     4      4
============  ===========================================================  =====  ====

A further session of a wallet that already holds one here costs what a returning one does,
whatever its standing: its identity was paid for with its first. Returning wallets take
nothing from the hub's bucket, so strangers flooding in from many addresses cannot keep out
the workers that already serve this hub (after its restart, say). "Returning" needs accepted
work, not merely a past session, or a liar could age fresh wallets for the discount by
opening sessions that do nothing. And when a session ends with its wallet quarantined (a
liar caught), its address is charged ``QUARANTINE_PENALTY`` into debt if need be: the fresh
wallet it comes back with waits for that too.

Sans-IO: ``SessionRate.admit`` is given the address, the standing and whether the wallet
already holds a session, and answers None (admitted, tokens taken) or ``Throttled``; the clock
is injectable. The hub calls it on its trio thread only.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Callable

from relay._buckets import TokenBuckets

__all__ = ["QUARANTINE_PENALTY", "SUSPECT_FOR_S", "SessionRate", "SessionRateLimits", "SessionRateStats",
           "Standing", "Throttled", "WalletHistory", "standing_of"]

# A quarantine this recent makes a wallet suspect: long past the default ban (24 h), so a
# liar's wallet pays the suspect's price when its ban ends, yet one that erred once and has
# served since is not charged for ever.
SUSPECT_FOR_S = 30 * 24 * 3600.0
# Charged to the address of a session whose wallet was quarantined while it lived, in new
# wallets: what a suspect pays, so a liar caught and back with a fresh wallet pays 1 + 4.
QUARANTINE_PENALTY = 4.0
HUB_KEY = ""  # the hub's bucket: one key in a table of one


class Standing(enum.Enum):
    RETURNING = "returning"
    NEW = "new"
    SUSPECT = "suspect"


# What one new session costs, in new wallets: (from its address's bucket, from the hub's).
COSTS: dict[Standing, tuple[float, float]] = {
    Standing.RETURNING: (0.5, 0.0),
    Standing.NEW: (1.0, 1.0),
    Standing.SUSPECT: (4.0, 4.0),
}


@dataclasses.dataclass(frozen=True)
class WalletHistory:
    """What this hub's contribution store holds about a wallet: whether the backbone accepted
    work from one of its sessions that was not quarantined, and when it was last quarantined
    here (unix ms; None: never)."""

    accepted_work: bool = False
    last_quarantined_unix_ms: int | None = None


def standing_of(history: WalletHistory, now_unix_ms: int) -> Standing:
    """The wallet's standing at ``now_unix_ms``: a quarantine within SUSPECT_FOR_S outweighs
    any work."""
    last = history.last_quarantined_unix_ms
    if last is not None and now_unix_ms - last < SUSPECT_FOR_S * 1000:
        return Standing.SUSPECT
    return Standing.RETURNING if history.accepted_work else Standing.NEW


@dataclasses.dataclass(frozen=True)
class SessionRateLimits:
    """The buckets, in new wallets: ``address_burst`` at once from one address, refilled at
    ``address_per_minute``; ``hub_burst`` and ``hub_per_minute`` for the whole hub. At most
    ``max_addresses`` addresses are remembered (the least recently admitted is forgotten).
    Raises ValueError for a rate not above zero or a burst below one new wallet."""

    # 32: the default cap on live sessions per address, so one host (or a lab behind one NAT)
    # can start its whole allowance of fresh workers at once; 6 a minute is more identities
    # than any honest operator makes, and turns a liar's 17 wallets in 1.5 s into one every 10 s
    # (every 50 s with QUARANTINE_PENALTY).
    address_burst: float = 32.0
    address_per_minute: float = 6.0
    # 256 strangers at once from anywhere, one a second after: what bounds a churn spread over
    # many addresses (an IPv6 /48 holds 65,536 /64s).
    hub_burst: float = 256.0
    hub_per_minute: float = 60.0
    max_addresses: int = 65536

    def __post_init__(self) -> None:
        for name in ("address_burst", "hub_burst"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be at least 1 new wallet (got {getattr(self, name)})")
        for name in ("address_per_minute", "hub_per_minute"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0 (got {getattr(self, name)})")
        if self.max_addresses < 1:
            raise ValueError(f"max_addresses must be at least 1 (got {self.max_addresses})")


@dataclasses.dataclass(frozen=True)
class Throttled:
    """A session refused for rate: which bucket (``"address"`` or ``"hub"``), how long until
    it would be admitted, and the close reason for the worker (close code 4205)."""

    limit: str
    wait_s: float
    reason: str


@dataclasses.dataclass(frozen=True)
class SessionRateStats:
    """Since start: sessions admitted by standing, refused by (bucket, standing), quarantine
    penalties charged; and the addresses remembered now."""

    admitted: dict[str, int]
    refused: dict[tuple[str, str], int]
    penalties: int
    addresses: int


class SessionRate:
    """The hub's limiter of new sessions (see the module's docstring)."""

    def __init__(self, limits: SessionRateLimits = SessionRateLimits(), *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        # A suspect's cost is capped at the burst, or a small burst would refuse it for ever.
        self._addresses = TokenBuckets(limits.address_per_minute / 60, clock, burst=limits.address_burst,
                                       max_entries=limits.max_addresses)
        self._hub = TokenBuckets(limits.hub_per_minute / 60, clock, burst=limits.hub_burst, max_entries=1)
        self._admitted = {s.value: 0 for s in Standing}
        self._refused: dict[tuple[str, str], int] = {}
        self._penalties = 0

    def admit(self, address: str, standing: Standing, *, holds_session: bool = False) -> Throttled | None:
        """Take the tokens of one new session from ``address`` (an ``address_key``) of a
        wallet of ``standing`` (``holds_session``: it holds another here already): None when
        admitted; else ``Throttled``, with nothing taken, so that a refused try costs nothing
        and its wait does not grow with retries. The hub's bucket is looked at first, so an
        address refused by it is not added to the table."""
        by_address, by_hub = COSTS[Standing.RETURNING if holds_session else standing]
        by_address = min(by_address, self.limits.address_burst)
        by_hub = min(by_hub, self.limits.hub_burst)
        throttled: Throttled | None = None
        if by_hub and (wait := self._hub.wait_s(HUB_KEY, by_hub)) > 0:
            throttled = Throttled("hub", wait, f"new wallets are joining this hub too fast; retry in "
                                               f"{_seconds(wait)} s")
        elif (wait := self._addresses.wait_s(address, by_address)) > 0:
            throttled = Throttled("address", wait, f"new sessions from this address come too fast (a wallet new "
                                                   f"here counts more); retry in {_seconds(wait)} s")
        if throttled is not None:
            key = (throttled.limit, standing.value)
            self._refused[key] = self._refused.get(key, 0) + 1
            return throttled
        if by_hub:
            self._hub.take(HUB_KEY, by_hub)
        self._addresses.take(address, by_address)
        self._admitted[standing.value] += 1
        return None

    def penalize(self, address: str) -> None:
        """A session from ``address`` ended with its wallet quarantined: charge the address
        QUARANTINE_PENALTY (capped at its burst), into debt if need be."""
        self._addresses.charge(address, min(QUARANTINE_PENALTY, self.limits.address_burst))
        self._penalties += 1

    def statistics(self) -> SessionRateStats:
        return SessionRateStats(admitted=dict(self._admitted), refused=dict(self._refused),
                                penalties=self._penalties, addresses=len(self._addresses))


def _seconds(wait_s: float) -> int:
    """A wait as whole seconds to tell a person, never 0 (1 s at least)."""
    return max(1, math.ceil(wait_s))
