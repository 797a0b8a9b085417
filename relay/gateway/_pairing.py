"""The gateway's pairings, without I/O: which worker waits under which pairing id.

``Pairings`` owns every worker the gateway holds from the capacity check until the worker's
connection ends. Each one is a ``Pairing`` with a state:

* ``ADMITTING``: it passed the capacity check and its WebSocket upgrade is under way;
* ``WAITING``: upgraded, announced (or being announced) to the hub, no hub data connection yet;
* ``PAIRED``: a hub data connection took it; the two are spliced;
* ``REFUSED``: no hub, the hub went away or the pairing time passed: its connection is being
  closed with the close code the refusal names, and it still holds its place;
* ``DONE``: its connection ended; it is out of the table.

``PAIRING_TRANSITIONS`` is the one place the moves live; every move is checked against it and
an illegal one raises ``LocalProtocolError`` (the gateway's own mistake). A hub data
connection naming a pairing that is unknown or already taken raises ``RemoteProtocolError``
carrying 4210 (``PAIRING_GONE``). Time is passed in (``now``), never read here. The trio code
in ``_gateway`` moves the bytes, waits on its own events and calls these methods; each is a
plain synchronous step, so no other task runs between a check and the move it allows.

The capacity rules count exactly what the gateway holds: a worker still upgrading will wait,
and every waiting worker is a session to be, so ADMITTING counts towards both the unpaired and
the session limits; REFUSED ones count as they did before their refusal (unpaired).
"""

from __future__ import annotations

import dataclasses
import enum
import secrets
from collections.abc import Callable
from typing import Generic, TypeVar

from kvasir_rpc import CloseCode, LocalProtocolError, RemoteProtocolError

__all__ = ["PAIRING_TRANSITIONS", "EVENTS", "Pairing", "PairingState", "Pairings", "Verdict"]


class PairingState(enum.Enum):
    ADMITTING = "ADMITTING"
    WAITING = "WAITING"
    PAIRED = "PAIRED"
    REFUSED = "REFUSED"
    DONE = "DONE"


_S = PairingState

# (state, event) -> next state. Events: "upgraded" (the worker's WebSocket is open),
# "upgrade failed", "no hub" (none connected when the worker came), "hub gone" (the
# announcement could not be sent), "timeout" (the pairing time passed), "hub took" (a hub data
# connection took the pairing), "left" (the worker's connection ended, however).
PAIRING_TRANSITIONS: dict[tuple[PairingState, str], PairingState] = {
    (_S.ADMITTING, "upgraded"): _S.WAITING,
    (_S.ADMITTING, "upgrade failed"): _S.DONE,
    (_S.ADMITTING, "left"): _S.DONE,
    (_S.WAITING, "no hub"): _S.REFUSED,
    (_S.WAITING, "hub gone"): _S.REFUSED,
    (_S.WAITING, "timeout"): _S.REFUSED,
    (_S.WAITING, "hub took"): _S.PAIRED,
    (_S.WAITING, "left"): _S.DONE,
    (_S.PAIRED, "left"): _S.DONE,
    (_S.REFUSED, "left"): _S.DONE,
}
EVENTS = ("upgraded", "upgrade failed", "no hub", "hub gone", "timeout", "hub took", "left")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Close the worker with ``close_code`` and ``reason``; count the refusal under
    ``refusal`` (None: not counted as a refusal)."""

    close_code: int
    reason: str
    refusal: str | None = None


# The refusals and the close code each one answers with (docs/PROTOCOL.md).
REFUSALS: dict[str, Verdict] = {
    "no hub": Verdict(CloseCode.NO_HUB, "no hub connected"),
    "hub gone": Verdict(CloseCode.NO_HUB, "hub went away"),
    "timeout": Verdict(CloseCode.PAIRING_TIMEOUT, "no hub took the session in time", "pairing_timeout"),
}
PAIRING_GONE = Verdict(CloseCode.PAIRING_GONE, "pairing gone")

L = TypeVar("L")  # what the I/O code keeps with a pairing (its connections and events)


@dataclasses.dataclass
class Pairing(Generic[L]):
    pid: str
    state: PairingState = PairingState.ADMITTING
    remote: str = ""
    link: L | None = None  # the I/O code's, from "upgraded" on
    deadline: float = float("inf")  # when the pairing time ends, from "upgraded" on


class Pairings(Generic[L]):
    """Every worker the gateway holds, by pairing id, and the capacity rules."""

    def __init__(self, max_unpaired: int, max_sessions: int, pairing_timeout_s: float, *,
                 new_id: Callable[[], str] = lambda: secrets.token_urlsafe(18)) -> None:
        self.max_unpaired = max_unpaired
        self.max_sessions = max_sessions
        self.pairing_timeout_s = pairing_timeout_s
        self._new_id = new_id
        self._table: dict[str, Pairing[L]] = {}
        self._counts = dict.fromkeys(PairingState, 0)
        self.issued = 0  # pairing ids handed out since start

    # -- counts ---------------------------------------------------------------------------

    def count(self, state: PairingState) -> int:
        return self._counts[state]

    @property
    def admitting(self) -> int:
        """Workers between the capacity check and their upgrade's end."""
        return self._counts[_S.ADMITTING]

    @property
    def unpaired(self) -> int:
        """Upgraded workers no hub data connection took (waiting, or being refused)."""
        return self._counts[_S.WAITING] + self._counts[_S.REFUSED]

    def __len__(self) -> int:
        return len(self._table)

    def get(self, pid: str) -> Pairing[L] | None:
        return self._table.get(pid)

    def live(self) -> dict[str, Pairing[L]]:
        """The upgraded workers' pairings (waiting, paired or being refused), by id."""
        return {pid: p for pid, p in self._table.items() if p.state is not _S.ADMITTING}

    # -- capacity and admission ------------------------------------------------------------

    def has_room(self) -> bool:
        """Whether one more worker may start its upgrade: the unpaired (with those still
        upgrading: every one will wait) stay under ``max_unpaired``, and all held under
        ``max_sessions``."""
        return (self.unpaired + self.admitting < self.max_unpaired
                and len(self._table) < self.max_sessions)

    def admit(self) -> str:
        """Take a place for a worker about to upgrade: its new pairing id (ADMITTING)."""
        if not self.has_room():
            raise LocalProtocolError("no room for another worker: ask has_room() first")
        pid = self._new_id()
        while pid in self._table:  # a repeat is all but impossible; never reuse a live id
            pid = self._new_id()
        self.issued += 1
        self._table[pid] = Pairing(pid)
        self._counts[_S.ADMITTING] += 1
        return pid

    # -- moves ----------------------------------------------------------------------------

    def _step(self, pid: str, event: str) -> Pairing[L]:
        p = self._table.get(pid)
        if p is None:
            raise LocalProtocolError(f"pairing {pid[:8]}…: {event!r} for a pairing not held")
        nxt = PAIRING_TRANSITIONS.get((p.state, event))
        if nxt is None:
            raise LocalProtocolError(f"pairing {pid[:8]}…: {event!r} in state {p.state.value}")
        self._counts[p.state] -= 1
        p.state = nxt
        if nxt is _S.DONE:
            del self._table[pid]
        else:
            self._counts[nxt] += 1
        return p

    def upgrade_failed(self, pid: str) -> None:
        self._step(pid, "upgrade failed")

    def upgraded(self, pid: str, remote: str, link: L, *, now: float) -> float:
        """The worker's WebSocket is open: it waits from ``now``; returns its deadline."""
        p = self._step(pid, "upgraded")
        p.remote, p.link = remote, link
        p.deadline = now + self.pairing_timeout_s
        return p.deadline

    def refuse(self, pid: str, event: str) -> Verdict:
        """``event`` is "no hub" or "hub gone": the worker is refused; close it as the verdict says."""
        if event not in ("no hub", "hub gone"):
            raise LocalProtocolError(f"{event!r} is not a refusal")
        self._step(pid, event)
        return REFUSALS[event]

    def settle(self, pid: str, *, now: float) -> Verdict | None:
        """The worker's wait ended (taken, or the deadline came): None if a hub data
        connection took it (splice), else the timeout's verdict."""
        p = self._table.get(pid)
        if p is not None and p.state is _S.PAIRED:
            return None
        if p is not None and p.state is _S.WAITING and now < p.deadline:
            raise LocalProtocolError(f"pairing {pid[:8]}…: neither taken nor past its deadline")
        self._step(pid, "timeout")
        return REFUSALS["timeout"]

    def can_take(self, pid: str) -> bool:
        """Whether a hub data connection may take ``pid`` (a worker waits under it)."""
        p = self._table.get(pid)
        return p is not None and p.state is _S.WAITING

    def take(self, pid: str) -> L:
        """A hub data connection takes ``pid``: the worker's link, to splice. An unknown
        pairing, or one already taken or refused, raises RemoteProtocolError (4210)."""
        if not self.can_take(pid):
            raise RemoteProtocolError(PAIRING_GONE.reason, close_code=PAIRING_GONE.close_code)
        p = self._step(pid, "hub took")
        assert p.link is not None  # set by "upgraded", the only way into WAITING
        return p.link

    def leave(self, pid: str) -> bool:
        """The worker's connection ended, in whatever state: its place is free. False (and
        nothing done) if ``pid`` is not held (already left)."""
        if pid not in self._table:
            return False
        self._step(pid, "left")
        return True
