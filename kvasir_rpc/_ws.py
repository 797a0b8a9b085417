"""The WebSocket of every Kvasir process, both ends: frames (``kvasir_rpc._ws_frames``, one
buffer, unmasked in place), the keepalive, the idle timeout and the close handshake, written
once; trio moves the bytes. A server (the gateway, the hub) accepts with ``accept_websocket`` (``kvasir_rpc._ws_http``);
a worker, or a hub dialing its gateway, connects with :func:`open_websocket` (the client's
HTTP/1.1 upgrade is h11's, here).

No protobuf, no gRPC: relays pass messages on without looking inside them.

Two ways a connection ends without a close frame are told apart: the peer (or the network)
broke it (``trio.BrokenResourceError``: WsClosed 1006, ``local`` False, counted as
``broken``), or this side closed the stream (``trio.ClosedResourceError``: shutdown, or a
task that closed it under another; WsClosed ``local`` True, counted as ``closed_locally``).

Partial messages are what a peer can make a relay hold without finishing anything: a
``MessageBudget`` shared by every WebSocket of a process bounds their sum (close 4208) and
how long one may stay unfinished (close 4209).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import enum
import hashlib
import os
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable, Sequence

import h11
import trio
from wsproto.events import CloseConnection, Ping, Pong

from kvasir_rpc._errors import CloseCode
from kvasir_rpc._fastmask import xor_mask_into
from kvasir_rpc._sockio import read_into, write_now, write_rest
from kvasir_rpc._ws_frames import (
    BINARY,
    CLOSE,
    HEADROOM,
    PING,
    PONG,
    TEXT,
    Data,
    FrameError,
    FrameReader,
    Progress,
    close_payload,
    frame_header,
)

__all__ = ["BudgetStats", "Held", "MessageBudget", "OWN_PING", "SEND_TIMEOUT_S", "WebSocket", "WsClosed",
           "WsConnectTimeout", "WsHandshakeError", "WsRejected", "WsStats", "open_websocket"]

# A WebSocket's receive buffer (kvasir_rpc._ws_frames.FrameReader): it starts at READ_BYTES, grows
# to BULK_READ_BYTES while reads fill it (a peer sending in bulk: fewer, larger reads), and
# shrinks back when small reads find it empty, so an idle connection holds READ_BYTES. (A
# single-frame message, the tunnel's bulk path, is gathered whole: the buffer grows to
# hold its frame whatever this bound.)
READ_BYTES = 64 << 10
BULK_READ_BYTES = 256 << 10
# A peer that reads nothing for this long while we send to it is gone: the WebSocket is
# closed (a send cut off mid-frame leaves nothing usable behind it).
SEND_TIMEOUT_S = 60.0
# What this side's own keepalive pings carry: this, then a few random bytes of each
# WebSocket's own (``WebSocket.own_ping``). A pong carrying them answers that WebSocket, not
# a ping relayed from the other side of a splice, nor one of a relay on the way: a worker's
# pings pass through a gateway to the hub and their pongs back, though all three ping alike.
OWN_PING = b"kvasir-keepalive"


class WsClosed(Exception):
    """The WebSocket is closed: by the peer (``code`` from its close frame, 1006 if it
    vanished) or by us (``local`` is True)."""

    def __init__(self, code: int, reason: str = "", *, local: bool = False) -> None:
        super().__init__(f"{code} {reason}".strip())
        self.code = code
        self.reason = reason
        self.local = local

    def fresh(self) -> WsClosed:
        """A new exception saying the same. A WebSocket keeps the WsClosed that ended it and
        raises a fresh one each time: raising the kept one would tie it, through its traceback,
        to the frames that hold the WebSocket, a cycle that keeps every closed WebSocket (its
        TLS and wsproto buffers, ~1 MiB after a large message) until the garbage collector's
        next full pass."""
        return WsClosed(self.code, self.reason, local=self.local)


@dataclasses.dataclass(frozen=True)
class WsStats:
    """A WebSocket's counters (see ``WebSocket.statistics``).

    ``messages_*`` and ``payload_bytes_*`` count whole data messages and their payload;
    ``wire_bytes_*`` every byte read from or written to the stream (frame headers, control
    frames, the close handshake). ``pings_sent``: keepalive pings to a silent peer;
    ``pings_answered``: the peer's pings we answered; ``pongs_received``: the peer's pongs.
    ``control_relayed``: the peer's pings and pongs handed out to be relayed (a splice);
    ``buffered``: bytes of the unfinished message held now;
    ``broken``: 1 when the peer or the network broke the connection (no close frame);
    ``closed_locally``: 1 when a read or write found the stream already closed by us."""

    messages_in: int
    messages_out: int
    payload_bytes_in: int
    payload_bytes_out: int
    wire_bytes_in: int
    wire_bytes_out: int
    pings_sent: int
    pings_answered: int
    pongs_received: int
    control_relayed: int
    buffered: int
    broken: int
    closed_locally: int


@dataclasses.dataclass(frozen=True)
class BudgetStats:
    """A ``MessageBudget``'s counters: ``buffered`` bytes of unfinished messages held now,
    their ``peak`` and ``limit``; connections closed because a fragment would have passed
    the limit (``refused_buffer``, 4208) or a message stayed unfinished past the deadline
    (``refused_deadline``, 4209)."""

    buffered: int
    peak: int
    limit: int
    deadline_s: float
    refused_buffer: int
    refused_deadline: int


class MessageBudget:
    """Bounds shared by every WebSocket given it: at most ``limit`` bytes of partially
    received messages in all, and at most ``deadline_s`` from a message's first fragment to
    its last. Single-threaded (trio): no lock. ``on_release`` is told of every byte given back
    (a ``relay._heap_trim.Trimmer`` returns the heap's free pages after many). ``holder``
    names the process in the reason of a close 4208 ("the gateway holds too many...")."""

    def __init__(self, limit: int, deadline_s: float, *, on_release: Callable[[int], None] | None = None,
                 holder: str = "this relay") -> None:
        if limit <= 0 or deadline_s <= 0:
            raise ValueError("a message budget needs a positive limit and deadline")
        self.holder = holder
        self.limit = limit
        self.deadline_s = deadline_s
        self._buffered = 0
        self._peak = 0
        self.refused_buffer = 0
        self.refused_deadline = 0
        self._on_release = on_release

    def take(self, n: int) -> bool:
        """Reserve ``n`` bytes; False (nothing reserved) if that would pass the limit."""
        if self._buffered + n > self.limit:
            return False
        self._buffered += n
        self._peak = max(self._peak, self._buffered)
        return True

    def give(self, n: int) -> None:
        """Return ``n`` bytes reserved with ``take``."""
        self._buffered -= n
        if n and self._on_release is not None:
            self._on_release(n)

    def statistics(self) -> BudgetStats:
        return BudgetStats(buffered=self._buffered, peak=self._peak, limit=self.limit, deadline_s=self.deadline_s,
                           refused_buffer=self.refused_buffer, refused_deadline=self.refused_deadline)


class Held:
    """A binary message as ``WebSocket.receive_held`` gives it: ``buf`` holds ``room`` bytes
    (space for a frame header) and then the payload. It may be a view of the receiving
    WebSocket's own buffer: valid until that WebSocket's next receive."""

    __slots__ = ("buf", "room")

    def __init__(self, buf: bytearray | memoryview, room: int) -> None:
        self.buf = buf
        self.room = room

    def __len__(self) -> int:
        return len(self.buf) - self.room

    def __bytes__(self) -> bytes:
        return bytes(memoryview(self.buf)[self.room:])


class _State(enum.Enum):
    OPEN = "open"
    LOCAL_CLOSING = "local closing"  # our close frame is sent
    CLOSED = "closed"  # the peer's close frame came


# After closing a peer caught mid-message, what it still sends is read and dropped for this
# long at most (see WebSocket._refuse).
_LINGER_S = 2.0
# A message up to this size is sent as one buffer (header and payload joined); a larger one
# as its pieces, written together (``kvasir_rpc._sockio.write_parts``), without a copy.
_JOIN_BYTES = 4 << 10
# A binary message as pieces sent one after the other (a tunnel channel's prefix, then data).
Parts = tuple[bytes | bytearray | memoryview, ...]


class WebSocket:
    """A WebSocket over a trio stream, the server's end or (``client=True``) the client's,
    whose frames it masks. One task receives; any task may send.

    ``receive_message`` answers pings, enforces the largest message (close 1009), pings
    a peer silent for ``keepalive_s`` (and again every ``keepalive_s``) and closes it (1001)
    after ``idle_timeout_s`` without activity: a message, a fragment, a ping of its own, or a
    pong. ``receive_relayed`` is the same for a splice: the peer's pings and pongs (except
    answers to our own pings) are returned to be relayed to the other side instead of being
    answered here, and answers to our own pings no longer count as activity, so that
    liveness is what the two ends see of each other. With a ``budget``, unfinished messages
    are bounded in bytes over all WebSockets sharing it (close 4208) and in time (close
    4209), and their buffers are freed whenever this WebSocket ends. A send that the peer
    does not take within ``send_timeout_s`` ends the WebSocket (1001). Every failure
    surfaces as WsClosed with the code to report.

    The frames are ``kvasir_rpc._ws_frames``': received into one buffer and unmasked there,
    a message is copied once, into a buffer with room for the header it is sent on with
    (``receive_held``/``send_held``, the splice's path), or read in place
    (``receive_view``). A socket is read straight into that buffer, and a stream with
    ``receive_into`` (``kvasir_rpc.TLSStream``) decrypts into it; a frame's header and
    payload go out in one write (``kvasir_rpc._sockio``). A client masks what it
    sends as it copies it into the frame it writes (one pass), and a held message in place.

    ``on_rtt`` is told each keepalive ping's round trip (seconds), when its pong comes.
    """

    def __init__(self, stream: trio.abc.Stream, *, max_message_bytes: int,
                 keepalive_s: float, idle_timeout_s: float, send_timeout_s: float = SEND_TIMEOUT_S,
                 budget: MessageBudget | None = None, client: bool = False,
                 on_rtt: Callable[[float], None] | None = None) -> None:
        self._stream = stream
        self.client = client
        self.on_rtt = on_rtt  # may be set later too (a hub sets it once the session is known)
        self.last_rtt_s: float | None = None  # the last keepalive ping's round trip
        self.subprotocol: str | None = None  # what the handshake settled on (open_websocket)
        self._send_timeout = send_timeout_s
        self._cut: WsClosed | None = None
        self._reader = FrameReader(min_bytes=READ_BYTES, max_bytes=BULK_READ_BYTES, client=client)
        self._state = _State.OPEN
        self._max = max_message_bytes
        self._keepalive = keepalive_s
        self._idle_timeout = idle_timeout_s
        self._budget = budget
        self._send_lock = trio.StrictFIFOLock()
        # The unfinished message, when it comes in pieces (fragmented, or too large to be
        # gathered in the reader's buffer): copies of the pieces, joined when it ends. Held
        # as pieces, it costs about what arrived (what the budget counts).
        self._parts: list[bytes] = []
        self._size = 0
        # Bytes of the unfinished message (in _parts, or being gathered in the reader's buffer)
        # reserved in the budget.
        self._charged = 0
        self._started_at: float | None = None  # when the unfinished message began
        self._relaying = False
        now = trio.current_time()
        self._last_active = now  # the idle timer: the peer's own doing (see the class docstring)
        self._last_heard = now  # any bytes at all: the keepalive's timer
        self._last_ping = now
        self._ping_out = False  # one of our keepalive pings awaits its pong
        self._pong_waiter: trio.Event | None = None  # ping_and_wait's
        self.own_ping = OWN_PING + b"/" + os.urandom(4).hex().encode()
        self._closed: WsClosed | None = None
        self._messages_in = 0
        self._messages_out = 0
        self._payload_in = 0
        self._payload_out = 0
        self._wire_in = 0
        self._wire_out = 0
        self._pings_sent = 0
        self._pings_answered = 0
        self._pongs = 0
        self._relayed_control = 0
        self._broken = 0
        self._closed_locally = 0

    @property
    def max_message_bytes(self) -> int:
        """The largest message this side takes (more: close 1009). A hub raises it once a
        worker's hello is verified: before, one hello is all it may send."""
        return self._max

    @max_message_bytes.setter
    def max_message_bytes(self, n: int) -> None:
        self._max = n

    def statistics(self) -> WsStats:
        """A frozen snapshot of this WebSocket's counters."""
        return WsStats(messages_in=self._messages_in, messages_out=self._messages_out,
                       payload_bytes_in=self._payload_in, payload_bytes_out=self._payload_out,
                       wire_bytes_in=self._wire_in, wire_bytes_out=self._wire_out, pings_sent=self._pings_sent,
                       pings_answered=self._pings_answered, pongs_received=self._pongs,
                       control_relayed=self._relayed_control, buffered=self._size, broken=self._broken,
                       closed_locally=self._closed_locally)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes of this WebSocket read before it existed (what followed the upgrade's head)."""
        self._reader.feed(data)
        self._wire_in += len(data)

    def forget_partial(self) -> None:
        """Drop the unfinished message, if any, and give its bytes back to the budget.
        Called whenever the WebSocket ends; idempotent."""
        if self._budget is not None:
            self._budget.give(self._charged)
        self._parts, self._size, self._charged, self._started_at = [], 0, 0, None

    def _lost(self, exc: trio.BrokenResourceError | trio.ClosedResourceError) -> WsClosed:
        """The WsClosed for a stream that failed under a read or write, chained to ``exc``.

        Broken: the peer or the network ended it (1006, not local). Closed: we closed the
        stream, either through ``close`` (its WsClosed stands) or under this WebSocket (a
        local 1006: shutdown, or a bug in whoever closed it)."""
        self.forget_partial()
        if isinstance(exc, trio.BrokenResourceError):
            self._broken = 1
            self._closed = self._closed or WsClosed(1006, "connection lost")
        else:
            self._closed_locally = 1
            self._closed = self._closed or WsClosed(1006, "the stream was closed on this side", local=True)
        return self._closed

    async def _write(self, *parts: bytes | bytearray | memoryview, shielded_for: float | None = None) -> bool:
        """Send ``parts`` in order, nothing between them (one ``writev`` on a socket). What
        the socket takes at once goes out with no timer or scope to set up (the common
        case); a wait (for another send, or for room) is bounded by the send timeout.

        ``shielded_for``: the caller's cancellation cannot stop the message once this is
        called: the waits are shielded, for that many seconds at most. Returns False when
        that ran out first (the frame may be cut: the WebSocket is unusable), else True."""
        size = sum(len(p) for p in parts)
        if not size:
            return True
        lock = self._send_lock
        left: list[memoryview] | None = None  # what the first try left, once made
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            pass
        else:
            try:
                left = self._write_now(parts)
            except BaseException:
                lock.release()
                raise
            if not left:
                self._wire_out += size
                lock.release()
                return True
        with trio.CancelScope(shield=shielded_for is not None) as guard:
            if shielded_for is not None:
                guard.deadline = trio.current_time() + shielded_for
            if left is None:
                await lock.acquire()
            try:
                if left is None:  # another send was under way: the first try is now
                    left = self._write_now(parts)
                with trio.move_on_after(self._send_timeout) as scope:
                    try:
                        await write_rest(self._stream, left)
                    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                        raise self._lost(exc).fresh() from exc
                    except BaseException:
                        # Cancelled (unshielded) with part of the frame out: what follows
                        # would be read as its rest, so nothing more may be sent.
                        if sum(len(v) for v in left) < size:
                            self._cut = self._cut or WsClosed(1006, "a send was cut off mid-frame", local=True)
                        raise
                if scope.cancelled_caught:
                    self._cut = WsClosed(1001, "send timed out: the peer read nothing for "
                                         f"{self._send_timeout:g} s", local=True)
                    self._closed = self._closed or self._cut
                    await self._close_stream()
                    raise self._cut.fresh()
                self._wire_out += size
            finally:
                lock.release()
        if guard.cancelled_caught:
            self._cut = WsClosed(1001, f"a message could not be sent within {shielded_for:g} s", local=True)
            return False
        return True

    def _write_now(self, parts: Parts) -> list[memoryview]:
        """With the send lock held: write what the stream takes of ``parts`` right now
        (``kvasir_rpc._sockio.write_now``); what is left."""
        if self._cut is not None:
            raise self._cut  # an earlier send was cut off mid-frame: nothing usable follows
        try:
            return write_now(self._stream, parts)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise self._lost(exc).fresh() from exc

    async def send_message(self, message: bytes | bytearray | memoryview | str | Parts, *,
                           shielded_for: float | None = None) -> bool:
        """Send one message, text for a str; a tuple of buffers is one binary message, their
        concatenation, sent without joining them. Raises WsClosed.

        ``shielded_for``: once called, the caller's cancellation cannot cut the message nor
        stop it: it goes out whole, or, past that many seconds, False is returned and the
        WebSocket is unusable (a frame may be cut). Otherwise True."""
        if self._closed is not None:
            raise self._closed.fresh()
        if isinstance(message, str):
            parts: Parts = (message.encode(),)
            opcode = TEXT
        else:
            parts = message if isinstance(message, tuple) else (message,)
            opcode = BINARY
        n = sum(len(p) for p in parts)
        self._messages_out += 1
        self._payload_out += n
        if self.client:
            return await self._write(_masked_frame(opcode, parts), shielded_for=shielded_for)
        header = frame_header(opcode, n)
        if n <= _JOIN_BYTES:
            return await self._write(b"".join((header, *parts)), shielded_for=shielded_for)
        return await self._write(header, *parts, shielded_for=shielded_for)

    async def send_held(self, held: Held) -> None:
        """Send a binary message as ``receive_held`` gives it: its header goes into the room
        in front of the payload and the whole goes out in one write, without a copy (a
        client masks it in place; one relaying a server's frame, whose header is shorter than
        its own, copies it as it masks it)."""
        if self._closed is not None:
            raise self._closed.fresh()
        n = len(held)
        key = os.urandom(4) if self.client else None
        header = frame_header(BINARY, n, key)
        start = held.room - len(header)
        if start < 0:  # a client relays a server's frame: its header is shorter than ours
            with memoryview(held.buf) as view:
                payload = view[held.room:]
                self._messages_out += 1
                self._payload_out += n
                await self._write(_masked_frame(BINARY, (payload,)))
                payload.release()
            return
        with memoryview(held.buf) as view:
            if key is not None:
                xor_mask_into(view[held.room:], key, view[held.room:])
            view[start:held.room] = header
            self._messages_out += 1
            self._payload_out += n
            await self._write(view[start:])

    async def _send_frame(self, opcode: int, payload: bytes) -> None:
        if self.client:
            await self._write(_masked_frame(opcode, (payload,)))
        else:
            await self._write(frame_header(opcode, len(payload)) + payload)

    async def send_control(self, event: Ping | Pong) -> None:
        """Send a ping or pong received on the other side of a splice, payload unchanged.
        Raises WsClosed if this WebSocket is closed."""
        if self._closed is not None:
            raise self._closed.fresh()
        if self._state is _State.OPEN:
            await self._send_frame(PING if isinstance(event, Ping) else PONG, bytes(event.payload))

    async def ping(self, payload: bytes | None = None) -> None:
        payload = self.own_ping if payload is None else payload
        if self._closed is None and self._state is _State.OPEN:
            self._pings_sent += 1
            self._last_ping = trio.current_time()
            self._ping_out = payload == self.own_ping
            await self._send_frame(PING, payload)

    async def ping_and_wait(self) -> float:
        """Ping now and wait for the pong: its round trip in seconds. The pong is read by the
        task receiving on this WebSocket (there must be one); bound the wait with a timeout."""
        answered = self._pong_waiter = trio.Event()
        await self.ping()
        await answered.wait()
        assert self.last_rtt_s is not None
        return self.last_rtt_s

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Send a close frame (if still open) and close the stream. Idempotent."""
        await self._close(code, reason, linger=False)

    async def _close(self, code: int, reason: str, *, linger: bool) -> None:
        if self._closed is None:
            self._closed = WsClosed(code, reason, local=True)
        if self._state is _State.OPEN:
            self._state = _State.LOCAL_CLOSING
            try:
                await self._send_frame(CLOSE, close_payload(code, reason[:120]))
            except WsClosed:
                pass
            else:
                if linger:
                    await self._linger()
        await self._close_stream()

    async def _close_stream(self) -> None:
        # The peer may already be gone (broken) or the stream closed already (aclose is
        # idempotent, but a wrapper may say so): closing is best effort and never raises.
        self.forget_partial()
        self._reader.release()
        try:
            await self._stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    async def receive_message(self) -> bytes | str:
        """The next whole message; pings are answered here. Raises WsClosed."""
        got = await self._receive(relay=False)
        assert isinstance(got, (Held, str))  # without relay, control frames never come out
        return got if isinstance(got, str) else bytes(got)

    async def receive_view(self) -> memoryview | str:
        """``receive_message`` without a copy: a binary message comes as a read-only view of
        this WebSocket's buffer, valid until it receives again (pass it on before that)."""
        got = await self._receive(relay=False)
        if isinstance(got, str):
            return got
        assert isinstance(got, Held)  # without relay, control frames never come out
        return memoryview(got.buf)[got.room:].toreadonly()

    async def receive_relayed(self) -> bytes | str | Ping | Pong:
        """The next whole message, or a ping or pong for the caller to relay to the other
        side of a splice (``send_control``); answers to our own pings stay here. From the
        first call on, only the peer's own traffic keeps it from being idle. Raises WsClosed."""
        got = await self.receive_held()
        return bytes(got) if isinstance(got, Held) else got

    async def receive_held(self) -> Held | str | Ping | Pong:
        """``receive_relayed`` without a copy: a binary message comes as a :class:`Held`,
        for ``send_held`` (on another WebSocket) before this one receives again."""
        self._relaying = True
        return await self._receive(relay=True)

    async def _receive(self, *, relay: bool) -> Held | str | Ping | Pong:
        reader = self._reader
        while True:
            if self._closed is not None:
                raise self._closed.fresh()
            try:
                while (event := reader.next_event()) is not None:
                    result = await self._handle(event, relay)
                    if result is not None:
                        return result
            except FrameError as exc:
                # As wsproto does: the peer's protocol error ends it like a close from the peer
                # with that code (1002, or 1007), answered with the same code.
                await self._handle(CloseConnection(code=exc.code, reason=str(exc)), relay)
            await self._receive_more()

    async def _expire(self, code: int, reason: str, *, mid_message: bool = False) -> WsClosed:
        if mid_message:  # the peer may be sending still: its bytes are read before the stream closes
            await self._refuse(code, reason)
        else:
            await self.close(code, reason)
        return WsClosed(code, reason, local=True)

    async def _read_into(self, view: memoryview) -> int:
        return await read_into(self._stream, view)

    async def _receive_more(self) -> None:
        """Read once into the frame reader's buffer, keeping the timers (see the class doc)."""
        budget = self._budget
        while True:
            now = trio.current_time()
            ends = (self._started_at + budget.deadline_s
                    if budget is not None and self._started_at is not None else float("inf"))
            if now >= ends:
                assert budget is not None
                budget.refused_deadline += 1
                raise await self._expire(CloseCode.MESSAGE_TIMEOUT,
                                         f"message not finished within {budget.deadline_s:g} s", mid_message=True)
            if now >= self._last_active + self._idle_timeout:
                raise await self._expire(1001, "idle timeout")
            next_ping = max(self._last_heard, self._last_ping) + self._keepalive
            if now >= next_ping:
                await self.ping()
                continue
            with trio.move_on_at(min(ends, next_ping, self._last_active + self._idle_timeout)) as scope:
                try:
                    n = await self._read_into(self._reader.space())
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    raise self._lost(exc).fresh() from exc
            if scope.cancelled_caught:
                continue
            if not n:
                # A clean EOF without a close frame: the peer's side ended it.
                self._broken = 1
                self._closed = self._closed or WsClosed(1006, "connection closed without a close frame")
                await self._close_stream()
                raise self._closed.fresh()
            self._reader.filled(n)
            self._wire_in += n
            self._last_heard = trio.current_time()
            return

    async def _count(self, n: int) -> None:
        """``n`` more bytes of the message being received: closes 1009 past the largest."""
        self._size += n
        if self._size > self._max:
            await self._refuse(1009, f"message larger than {self._max} bytes")
            raise WsClosed(1009, "message too big", local=True)

    async def _refuse(self, code: int, reason: str) -> None:
        """Close ``code`` for a peer caught mid-message (too big, over the budget, past its
        deadline): our close frame, then what the peer still sends is read and dropped until
        its close frame or its end, for _LINGER_S at most, and only then the stream closes.
        Closing a socket with unread bytes in it resets the connection, and a reset can
        destroy our close frame before the peer reads it. Only the receiving task calls it."""
        self.forget_partial()  # its bytes go back to the budget now, not after the linger
        await self._close(code, reason, linger=True)

    async def _linger(self) -> None:
        reader = self._reader
        with trio.move_on_after(_LINGER_S):
            while True:
                try:
                    reader.discard_frame()
                    while (event := reader.next_event()) is not None:
                        if isinstance(event, CloseConnection):
                            return
                        reader.discard_frame()  # a data frame's bytes: dropped as they come
                except FrameError:
                    return
                try:
                    n = await self._read_into(reader.space())
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                if not n:
                    return
                reader.filled(n)
                self._wire_in += n

    async def _unfinished(self, n: int) -> None:
        """``n`` bytes of a message that is not finished yet arrived: bound its size, start
        its deadline, and reserve the bytes in the budget (closes 1009, 4208)."""
        self._last_active = trio.current_time()
        await self._count(n)
        if self._started_at is None:
            self._started_at = self._last_active
        if self._budget is not None:
            if not self._budget.take(n):
                self._budget.refused_buffer += 1
                await self._refuse(CloseCode.BUFFERS_FULL,
                                   f"{self._budget.holder} holds too many unfinished messages; try again later")
                raise WsClosed(CloseCode.BUFFERS_FULL, "message buffers full", local=True)
            self._charged += n

    async def _handle(self, event: object, relay: bool) -> Held | str | Ping | Pong | None:
        if isinstance(event, Progress):
            await self._unfinished(event.n)
            return None
        if isinstance(event, Data) and event.frame is not None:  # a whole message, gathered
            self._last_active = trio.current_time()
            await self._count(event.fresh)
            self._messages_in += 1
            self._payload_in += self._size
            self.forget_partial()
            if event.text:
                return str(event.payload, "utf-8")
            return Held(event.frame, len(event.frame) - len(event.payload))
        if isinstance(event, Data):
            # Sizes are bytes: a text message is bounded by its UTF-8 length, not its characters.
            n = len(event.payload)
            if not event.finished:
                await self._unfinished(n)
                self._parts.append(bytes(event.payload))
                return None
            self._last_active = trio.current_time()
            await self._count(n)
            msg = bytearray(HEADROOM + self._size)
            at = HEADROOM
            for part in (*self._parts, event.payload):
                msg[at:at + len(part)] = part
                at += len(part)
            self._messages_in += 1
            self._payload_in += self._size
            self.forget_partial()
            if event.text:
                return msg[HEADROOM:].decode()  # the reader checked the UTF-8
            return Held(msg, HEADROOM)
        if isinstance(event, Ping):
            self._last_active = trio.current_time()
            if relay:
                self._relayed_control += 1
                return event
            self._pings_answered += 1
            if self._state is _State.OPEN:
                await self._send_frame(PONG, bytes(event.payload))
            return None
        if isinstance(event, Pong):
            self._pongs += 1
            ours = event.payload == self.own_ping
            if ours and self._ping_out:
                self._ping_out = False
                self.last_rtt_s = trio.current_time() - self._last_ping
                if self.on_rtt is not None:
                    self.on_rtt(self.last_rtt_s)
                if self._pong_waiter is not None:
                    self._pong_waiter.set()
                    self._pong_waiter = None
            if not (ours and self._relaying):
                # Answers to our pings prove only this hop: they count while we are the end.
                self._last_active = trio.current_time()
            if relay and not ours:
                self._relayed_control += 1
                return event
            return None
        if isinstance(event, CloseConnection):
            if self._state is _State.OPEN:  # answer it; a close of ours already answers it
                self._state = _State.CLOSED
                try:
                    await self._send_frame(CLOSE, close_payload(event.code, event.reason or ""))
                except WsClosed:
                    pass
            self._state = _State.CLOSED
            self._closed = WsClosed(event.code, event.reason or "")
            await self._close_stream()
            raise self._closed.fresh()
        return None


def _masked_frame(opcode: int, parts: Parts) -> bytearray:
    """A client's frame: header, fresh mask key, and the payload (``parts`` one after the
    other) masked as it is copied in."""
    key = os.urandom(4)
    header = frame_header(opcode, sum(len(p) for p in parts), key)
    at = len(header)
    frame = bytearray(at + sum(len(p) for p in parts))
    frame[:at] = header
    out = memoryview(frame)
    for part in parts:
        n = len(part)
        shift = (at - len(header)) % 4  # the mask runs on across parts
        xor_mask_into(part, key[shift:] + key[:shift], out[at:at + n])
        at += n
    return frame


class WsHandshakeError(Exception):
    """The WebSocket upgrade did not complete: the TCP connect failed (the OSError is the
    cause), or the server's answer is not a WebSocket's (the message says how)."""


class WsConnectTimeout(WsHandshakeError):
    """No WebSocket within the connect timeout (TCP, TLS and the upgrade together)."""


class WsRejected(WsHandshakeError):
    """The server answered the upgrade with an HTTP status other than 101: ``status_code``,
    its ``headers`` and the start of its ``body`` (at most MAX_REJECTION_BODY bytes)."""

    def __init__(self, status_code: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        first = body.decode(errors="replace").strip().splitlines()
        super().__init__(f"HTTP {status_code}" + (f": {first[0][:200]}" if first else ""))
        self.status_code = status_code
        self.headers = headers
        self.body = body


# The largest response head a server may answer an upgrade with, and the most of a
# refusal's body kept (its first line is what a person is shown).
MAX_RESPONSE_HEAD = 16 << 10
MAX_REJECTION_BODY = 16 << 10
_ACCEPT_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 section 1.3


def _header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    values = [v for k, v in headers if k.lower() == name]
    return b", ".join(values) if values else None


async def _client_upgrade(stream: trio.abc.Stream, host: str, resource: str, subprotocols: Sequence[str],
                          extra_headers: Sequence[tuple[bytes, bytes]]) -> tuple[str | None, bytes]:
    """Send the HTTP/1.1 upgrade and read the answer (h11): ``(subprotocol, bytes after the
    head)``. Raises WsRejected for a status other than 101, WsHandshakeError for an answer
    that is not a valid acceptance of this upgrade."""
    key = base64.b64encode(os.urandom(16))
    headers = [(b"host", host.encode()), (b"upgrade", b"websocket"), (b"connection", b"Upgrade"),
               (b"sec-websocket-key", key), (b"sec-websocket-version", b"13")]
    if subprotocols:
        headers.append((b"sec-websocket-protocol", ", ".join(subprotocols).encode()))
    headers += list(extra_headers)
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_RESPONSE_HEAD)
    await stream.send_all(conn.send(h11.Request(method="GET", target=resource, headers=headers))
                          + (conn.send(h11.EndOfMessage()) or b""))
    response: h11.Response | None = None
    answered = False  # any byte came back
    body = bytearray()
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            if response is not None:  # a refusal whose body is cut short: the status is what counts
                raise WsRejected(response.status_code, list(response.headers), bytes(body)) from None
            raise WsHandshakeError(f"the server answered in something other than HTTP/1.1 ({exc})") from None
        if event is h11.NEED_DATA:
            data = await stream.receive_some(MAX_RESPONSE_HEAD)
            if not data and response is None and not answered:
                raise WsHandshakeError("the server closed the connection without answering the upgrade")
            answered = answered or bool(data)
            conn.receive_data(bytes(data) if data else b"")  # b"": the server closed (a body read to its end)
            continue
        if isinstance(event, h11.InformationalResponse) and event.status_code == 101:
            got = list(event.headers)
            expected = base64.b64encode(hashlib.sha1(key + _ACCEPT_GUID).digest())
            if (_header(got, b"upgrade") or b"").lower() != b"websocket":
                raise WsHandshakeError("the server switched protocols, but not to a WebSocket")
            if _header(got, b"sec-websocket-accept") != expected:
                raise WsHandshakeError("the server's Sec-WebSocket-Accept does not answer this upgrade's key")
            chosen = _header(got, b"sec-websocket-protocol")
            subprotocol = chosen.decode("latin-1").strip() if chosen else None
            if subprotocol is not None and subprotocol not in subprotocols:
                raise WsHandshakeError(f"the server chose subprotocol {subprotocol!r}, which was not offered")
            if _header(got, b"sec-websocket-extensions"):
                raise WsHandshakeError("the server chose a WebSocket extension, and none was offered")
            return subprotocol, bytes(conn.trailing_data[0])
        if isinstance(event, h11.InformationalResponse):
            continue  # 100 Continue and the like: the answer follows
        if isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data[:MAX_REJECTION_BODY - len(body)]
            if len(body) >= MAX_REJECTION_BODY:
                event = h11.EndOfMessage()
        if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed) and response is not None:
            raise WsRejected(response.status_code, list(response.headers), bytes(body))


@contextlib.asynccontextmanager
async def open_websocket(
    url: str,
    ssl_context: ssl.SSLContext | None = None,
    *,
    subprotocols: Sequence[str] = (),
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
    max_message_bytes: int = 1 << 20,
    keepalive_s: float = 20.0,
    idle_timeout_s: float = 60.0,
    send_timeout_s: float = SEND_TIMEOUT_S,
    connect_timeout: float = 10.0,
    disconnect_timeout: float = 5.0,
    on_rtt: Callable[[float], None] | None = None,
) -> AsyncIterator[WebSocket]:
    """A client WebSocket to ``url`` (``ws://`` or ``wss://``, whose TLS is
    :class:`kvasir_rpc.TLSStream`'s), closed (1000, unless closed before) when the block ends.

    Raises WsConnectTimeout when TCP, TLS and the upgrade take longer than
    ``connect_timeout``; WsHandshakeError for a connect that fails (the OSError as its cause)
    or an answer that is not a WebSocket's; WsRejected for an HTTP refusal; a failed TLS
    handshake comes as TLSStream raises it (trio.BrokenResourceError, the ssl error in its
    text and as its cause). ``keepalive_s``, ``idle_timeout_s``: see :class:`WebSocket`."""
    from kvasir_rpc._tls import open_tls_over_tcp

    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"not a ws:// or wss:// URL: {url!r}")
    secure = parts.scheme == "wss"
    host = parts.hostname
    port = parts.port or (443 if secure else 80)
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    shown = f"[{host}]" if ":" in host else host
    host_header = shown if port in (80, 443) else f"{shown}:{port}"
    stream: trio.abc.Stream | None = None
    try:
        with trio.fail_after(connect_timeout):
            try:
                if secure:
                    stream = await open_tls_over_tcp(host, port, ssl_context or ssl.create_default_context())
                else:
                    stream = await trio.open_tcp_stream(host, port)
            except OSError as exc:
                raise WsHandshakeError(f"cannot connect to {host_header}: {exc}") from exc
            subprotocol, trailing = await _client_upgrade(stream, host_header, resource, subprotocols, extra_headers)
    except trio.TooSlowError:
        if stream is not None:
            await trio.aclose_forcefully(stream)
        raise WsConnectTimeout(f"no WebSocket from {host_header} within {connect_timeout:g} s") from None
    except BaseException:
        if stream is not None:
            await trio.aclose_forcefully(stream)
        raise
    ws = WebSocket(stream, max_message_bytes=max_message_bytes, keepalive_s=keepalive_s,
                   idle_timeout_s=idle_timeout_s, send_timeout_s=send_timeout_s, client=True, on_rtt=on_rtt)
    ws.subprotocol = subprotocol
    if trailing:
        ws.feed(trailing)
    try:
        yield ws
    finally:
        with trio.move_on_after(disconnect_timeout) as scope:
            scope.shield = True
            await ws.close(1000)
