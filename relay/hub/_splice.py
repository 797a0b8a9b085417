"""A worker session's splices, without I/O: which backbone connection rides which channel of
the worker's tunnel, and what each tunnel message from the worker asks the hub to do.

``Splices`` owns the channels of one session from its accept to its end. Each channel has a
phase:

* ``FREE``: no backbone connection (its tunnel state machine IDLE);
* ``BRIDGING``: a backbone connection was admitted on it ("open" sent or being sent); bytes flow
  both ways;
* ``ENDING``: one side ended (the worker said "eof", or the backbone's connection broke when the
  hub wrote to it): the splice must stop and send "close";
* ``CLOSING``: "close" sent; the worker's late bytes are dropped and its "closed" is due by a
  deadline (past it the session ends).

``SPLICE_TRANSITIONS`` is the one place the moves live; a move not in it raises
``LocalProtocolError`` (the hub's own mistake). What the worker may send is still its
channel's ``HubTunnel``'s to judge: anything out of turn raises ``RemoteProtocolError`` (1002)
before a phase moves. A plain tunnel (one connection at a time) is a tunnel of one channel, 0,
through ``OneChannel``, so the I/O code is the same for both: one task reads the WebSocket for
the session's life and hands each message to ``from_worker``; each admitted backbone
connection ``claim``s a channel, sends what ``to_worker`` frames, and ``close``s it. Every
method is a plain synchronous step: no other task runs between a check and the move it allows
(``claim`` is the busy check and the open in one). Time is passed in (``now``), never read.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Generic, Protocol, TypeVar

from kvasir_rpc import LocalProtocolError
from kvasir_rpc.protocol import Closed, Data, Discarded, Eof, Event, HubTunnel, MuxHubTunnel, TunnelState, kept

__all__ = ["SPLICE_EVENTS", "SPLICE_TRANSITIONS", "Closing", "Dropped", "Ended", "Forward", "OneChannel", "Released",
           "SplicePhase", "Splices"]


class SplicePhase(enum.Enum):
    FREE = "FREE"
    BRIDGING = "BRIDGING"
    ENDING = "ENDING"
    CLOSING = "CLOSING"


_P = SplicePhase

# (phase, event) -> next phase. Events: "claim" (a backbone connection takes the channel),
# "to worker" (backbone bytes framed for the worker), "worker data", "worker eof", "broke"
# (writing to the backbone failed), "close" (the splice sends "close"), "worker closed".
SPLICE_TRANSITIONS: dict[tuple[SplicePhase, str], SplicePhase] = {
    (_P.FREE, "claim"): _P.BRIDGING,
    (_P.BRIDGING, "to worker"): _P.BRIDGING,
    (_P.BRIDGING, "worker data"): _P.BRIDGING,
    (_P.BRIDGING, "worker eof"): _P.ENDING,
    (_P.BRIDGING, "broke"): _P.ENDING,
    (_P.BRIDGING, "close"): _P.CLOSING,
    # Backbone bytes read before the splice saw the end (it stops at its next checkpoint).
    (_P.ENDING, "to worker"): _P.ENDING,
    # The backbone's side broke, the tunnel is still open: the worker's bytes have nowhere to go.
    (_P.ENDING, "worker data"): _P.ENDING,
    (_P.ENDING, "worker eof"): _P.ENDING,
    (_P.ENDING, "broke"): _P.ENDING,
    (_P.ENDING, "close"): _P.CLOSING,
    (_P.CLOSING, "worker data"): _P.CLOSING,  # late: dropped
    (_P.CLOSING, "worker eof"): _P.CLOSING,  # late: dropped
    (_P.CLOSING, "broke"): _P.CLOSING,  # a write that was under way when the splice closed
    (_P.CLOSING, "worker closed"): _P.FREE,
}
SPLICE_EVENTS = ("claim", "to worker", "worker data", "worker eof", "broke", "close", "worker closed")


L = TypeVar("L")  # what the I/O code keeps with a claimed channel (its connection, its scope)


# What a message from the worker asks of the I/O code; ``link`` is the one ``claim`` kept.
@dataclasses.dataclass(frozen=True)
class Forward(Generic[L]):
    """Write ``data`` to the channel's backbone connection (before reading the next message:
    a slow backbone slows the reader, and with it the worker)."""

    channel: int
    data: bytes | memoryview
    link: L


@dataclasses.dataclass(frozen=True)
class Ended(Generic[L]):
    """The worker ended the channel's connection ("eof"): stop its splice, which closes it."""

    channel: int
    link: L


@dataclasses.dataclass(frozen=True)
class Released(Generic[L]):
    """The worker dropped the channel's connection ("closed"): the splice waiting for it ends;
    the channel is free."""

    channel: int
    link: L


@dataclasses.dataclass(frozen=True)
class Dropped:
    """Bytes (or an "eof") of a connection already ending or closed: nothing to do, counted."""

    channel: int
    nbytes: int


Action = Forward[L] | Ended[L] | Released[L] | Dropped


@dataclasses.dataclass(frozen=True)
class Closing:
    """What ``close`` returns: the message to send, the deadline for the worker's "closed",
    and who ended the connection (for the log)."""

    message: str
    deadline: float
    ended_by: str


class Framing(Protocol):
    """The hub's side of a tunnel as channels: ``MuxHubTunnel``, or ``OneChannel``."""

    channels: list[HubTunnel]

    def open(self, channel: int) -> str: ...

    def close(self, channel: int) -> str: ...

    def send_parts(self, channel: int, data: bytes) -> tuple[bytes, ...]: ...

    def receive(self, msg: bytes | memoryview | str) -> tuple[int, Event]: ...


class OneChannel:
    """The plain tunnel (one connection at a time) as a tunnel of one channel, 0: its messages
    carry no channel; data goes out as it came (no copy)."""

    def __init__(self) -> None:
        self.channels = [HubTunnel()]

    def open(self, channel: int) -> str:
        return self.channels[channel].open()

    def close(self, channel: int) -> str:
        return self.channels[channel].close()

    def send_parts(self, channel: int, data: bytes) -> tuple[bytes, ...]:
        return (self.channels[channel].send_data(data),)

    def receive(self, msg: bytes | memoryview | str) -> tuple[int, Event]:
        return 0, self.channels[0].receive(msg)


@dataclasses.dataclass
class Channel(Generic[L]):
    index: int
    phase: SplicePhase = SplicePhase.FREE
    link: L | None = None  # the I/O code's, from "claim" until "worker closed"
    ended_by: str = ""  # who ended the connection, once one side has


class Splices(Generic[L]):
    """The channels of one worker session: a plain tunnel (``channels`` 0 or 1) or a
    multiplexed one of ``channels``."""

    def __init__(self, channels: int, close_timeout_s: float) -> None:
        self.framing: Framing = MuxHubTunnel(channels) if channels >= 2 else OneChannel()  # type: ignore[assignment]
        self.close_timeout_s = close_timeout_s
        self._channels = [Channel[L](i) for i in range(len(self.framing.channels))]

    def __len__(self) -> int:
        """Backbone connections the tunnel carries at once."""
        return len(self._channels)

    @property
    def opened(self) -> int:
        """Backbone connections claimed since the session began (each channel's tunnel counts
        its own opens)."""
        return sum(tunnel.connections for tunnel in self.framing.channels)

    @property
    def multiplexed(self) -> bool:
        return isinstance(self.framing, MuxHubTunnel)

    def phase(self, channel: int) -> SplicePhase:
        return self._channels[channel].phase

    def tunnel_state(self, channel: int) -> TunnelState:
        return self.framing.channels[channel].state

    def link(self, channel: int) -> L | None:
        return self._channels[channel].link

    def free(self) -> int | None:
        """The lowest free channel, or None: every channel carries a connection."""
        return next((c.index for c in self._channels if c.phase is _P.FREE), None)

    @property
    def busy(self) -> bool:
        return self.free() is None

    def _step(self, channel: int, event: str) -> Channel[L]:
        c = self._channels[channel]
        nxt = SPLICE_TRANSITIONS.get((c.phase, event))
        if nxt is None:
            raise LocalProtocolError(f"channel {channel}: {event!r} while it is {c.phase.value}")
        c.phase = nxt
        return c

    # -- the backbone's side (the splice of one admitted connection) -----------------------

    def claim(self, link: L) -> tuple[int, str] | None:
        """Take the lowest free channel for an admitted backbone connection, keeping ``link``
        with it: (channel, the message that opens it on the worker), or None when every
        channel carries one (the connection is refused, busy)."""
        channel = self.free()
        if channel is None:
            return None
        opening = self.framing.open(channel)
        c = self._step(channel, "claim")
        c.link, c.ended_by = link, ""
        return channel, opening

    def to_worker(self, channel: int, data: bytes | bytearray | memoryview) -> tuple[bytes | memoryview, ...]:
        """Backbone bytes as the tunnel message that carries them to the worker, in pieces sent
        as one message (a multiplexed tunnel's channel prefix, then the data: bytes and
        read-only views as they are, for the caller to send before it reads into that buffer
        again; anything writable copied, as its owner may reuse it at any time)."""
        message = self.framing.send_parts(channel, kept(data))  # type: ignore[arg-type]
        self._step(channel, "to worker")
        return message

    def broke(self, channel: int, why: str) -> None:
        """Writing the worker's bytes to the channel's backbone connection failed: the splice
        must end (the I/O code stops it)."""
        c = self._step(channel, "broke")
        c.ended_by = c.ended_by or why

    def close(self, channel: int, *, now: float, ended_by: str = "backbone") -> Closing:
        """The splice is over (``ended_by``, unless a side ended it first): the "close" to send,
        and when the worker's "closed" is due."""
        message = self.framing.close(channel)
        c = self._step(channel, "close")
        c.ended_by = c.ended_by or ended_by
        return Closing(message, now + self.close_timeout_s, c.ended_by)

    # -- the worker's side (every message it sends) ------------------------------------------

    def from_worker(self, msg: bytes | memoryview | str) -> Action[L]:
        """What the worker's message asks for; RemoteProtocolError (1002) for anything it may
        not send now (the session ends)."""
        channel, event = self.framing.receive(msg)
        c = self._channels[channel]
        link = c.link
        if isinstance(event, Data):
            self._step(channel, "worker data")
            if c.phase is _P.BRIDGING:
                assert link is not None  # kept from "claim" on
                return Forward(channel, event.data, link)
            return Dropped(channel, len(event.data))
        if isinstance(event, Eof):
            self._step(channel, "worker eof")
            c.ended_by = c.ended_by or "worker"
            assert link is not None
            return Ended(channel, link)
        if isinstance(event, Discarded):
            self._step(channel, "worker eof" if event.nbytes == 0 else "worker data")
            return Dropped(channel, event.nbytes)
        assert isinstance(event, Closed) and link is not None  # the hub's tunnel yields nothing else
        self._step(channel, "worker closed")
        c.link = None
        return Released(channel, link)
