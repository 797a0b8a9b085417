"""The WebSocket frame layer of every Kvasir process, sans I/O: a parser of frames that works
in one buffer, and frame headers, for either end (RFC 6455 section 5).

The gateway and the hub relay every tunnel byte, so the frame layer is on their bulk path.
wsproto's general one copies each payload byte five times on the way in (its buffer, a
slice, the unmasking, ``bytes()``, the message join) and once more on the way out; here
bytes are received into :class:`FrameReader`'s buffer, unmasked in place (numpy over uint32
words) and handed out as a view, so the WebSocket copies them once, into the message it
assembles, with room in front for the header it sends them on with.

A server reads masked frames and writes unmasked ones; a client the other way round
(``FrameReader(client=True)``, ``frame_header(..., mask=key)``). No extensions (no Kvasir
process negotiates any). Protocol errors are wsproto's, with its close codes: 1002 for a
malformed frame or sequence, 1007 for invalid UTF-8 in a text message or a close reason.
"""

from __future__ import annotations

import codecs
import dataclasses
import struct

from wsproto.events import CloseConnection, Ping, Pong

from kvasir_rpc._fastmask import xor_mask_into

__all__ = ["Progress", "BINARY", "TEXT", "CLOSE", "PING", "PONG", "Data", "FrameError", "FrameReader", "close_payload",
           "frame_header", "HEADROOM"]

CONTINUATION, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_OPCODES = frozenset((CONTINUATION, TEXT, BINARY, CLOSE, PING, PONG))
_MAX_CONTROL = 125
# The longest frame header (2 + 8 bytes, and a client's 4-byte mask): a relayed message is
# assembled behind this much room, so its header goes in front of it without a copy.
HEADROOM = 14
# Close codes a peer may send (RFC 6455 7.4): the defined ones, 3000-4999, not the local-only.
_DEFINED_CODES = frozenset((1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014))
_LOCAL_ONLY = frozenset((1005, 1006, 1015))


class FrameError(Exception):
    """The peer broke the WebSocket protocol: ``code`` is the close code to answer with
    (1002, or 1007 for bad UTF-8) and the message says what was wrong."""

    def __init__(self, message: str, code: int = 1002) -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Data:
    """A piece of a data message: ``payload`` is unmasked and valid only until the reader is
    given more bytes (copy it before receiving again). ``text``: the message is text;
    ``finished``: its last piece; ``left``: bytes of this frame still to come (what the
    frame header announced, not yet received)."""

    payload: memoryview
    text: bool
    finished: bool
    left: int = 0
    # A whole single-frame message gathered in the reader's buffer: ``frame`` is its frame,
    # header included (the header's bytes are room to write another header over), and
    # ``fresh`` the payload bytes not announced before by ``Progress``.
    frame: memoryview | None = None
    fresh: int = 0


@dataclasses.dataclass
class Progress:
    """``n`` more bytes of a message being gathered whole arrived (they stay in the reader's
    buffer until the message is complete)."""

    n: int


def frame_header(opcode: int, n: int, mask: bytes | None = None) -> bytes:
    """The header of a final frame of ``n`` payload bytes: a server's (unmasked), or with
    ``mask`` (4 bytes) a client's, whose payload must then be masked with it."""
    first = 0x80 | opcode
    bit = 0x80 if mask is not None else 0
    if n <= _MAX_CONTROL:
        head = bytes((first, bit | n))
    elif n <= 0xFFFF:
        head = struct.pack("!BBH", first, bit | 126, n)
    else:
        head = struct.pack("!BBQ", first, bit | 127, n)
    return head if mask is None else head + mask


def close_payload(code: int, reason: str) -> bytes:
    """A close frame's payload as wsproto writes it: none for 1005, 1000 for the other codes
    only a local side may report, the reason cut to 123 bytes of whole characters."""
    if code == 1005:
        return b""
    if code in _LOCAL_ONLY:
        code = 1000
    raw = reason.encode()
    if len(raw) > 123:
        raw = raw[:123].decode("utf-8", "ignore").encode()
    return struct.pack("!H", code) + raw


def _unmask(view: memoryview, key: bytes, phase: int) -> None:
    """XOR ``view`` in place with ``key`` starting at key byte ``phase``."""
    if phase:
        key = key[phase:] + key[:phase]
    xor_mask_into(view, key, view)


class FrameReader:
    """Parses the frames the peer sends, out of one growable buffer: a client's (masked, the
    default) or, with ``client=True`` (this end is the client), a server's (unmasked).

    Bytes go in through :meth:`space` (a view to receive into) and :meth:`filled`, or
    :meth:`feed`; :meth:`next_event` gives ``Data``, ``Ping``, ``Pong`` or
    ``CloseConnection`` (wsproto's events), None when it needs more bytes, or raises
    :class:`FrameError`. A data frame comes out piece by piece as its bytes arrive; control
    frames (at most 125 bytes) whole. The buffer starts at ``min_bytes`` and grows to
    ``max_bytes`` while reads fill it, and shrinks back when it empties after small reads,
    so idle connections hold little."""

    def __init__(self, *, min_bytes: int = 64 << 10, max_bytes: int = 1 << 20,
                 gather_bytes: int = (1 << 20) + 14, client: bool = False) -> None:
        self._masked = not client  # what the peer's frames must be
        self._min = min_bytes
        self._max = max_bytes
        # A single-frame message whose frame is at most this long is gathered in the buffer
        # and handed out whole (``Data.frame``), so that it can be sent on from there.
        self._gather_max = gather_bytes
        self._gathering = False
        self._filled_up = False  # the last read filled the buffer to its end
        self._frame_at = 0  # where the frame being gathered starts in the buffer
        self._reported = 0  # its payload bytes announced by Progress
        self._buf = bytearray(0)  # allocated on first use: a refused connection never holds one
        self._start = 0
        self._end = 0
        # The data frame being read: payload bytes still to come, its mask and position in it.
        self._remaining = 0
        self._in_frame = False
        self._fin = False
        self._key = b""
        self._phase = 0
        self._message: int | None = None  # TEXT or BINARY while a message is unfinished
        self._utf8: codecs.BufferedIncrementalDecoder | None = None

    @property
    def buffered(self) -> int:
        """Bytes received and not parsed yet."""
        return self._end - self._start

    def space(self) -> memoryview:
        """A view of free space at the end of the buffer to receive into (then :meth:`filled`)."""
        cap = len(self._buf)
        if self._end == self._start and not self._gathering:
            self._start = self._end = 0
            if self._filled_up and cap < self._max:  # the last read filled it: the peer sends in bulk
                cap = min(2 * cap, self._max)
                self._buf = bytearray(cap)
        self._filled_up = False
        if cap == 0:
            cap = self._min
            self._buf = bytearray(cap)
        elif self._end == cap:
            keep = self._frame_at if self._gathering else self._start
            if keep > 0:  # move what is kept (a partial header or frame) to the front
                left = self._end - keep
                self._buf[:left] = self._buf[keep:self._end]
                self._start -= keep
                self._frame_at = 0
                self._end = left
            elif self._gathering:  # room for the frame: double, up to its end
                self._grow(min(cap, self._start + self._remaining - cap))
            elif cap < self._max:  # a full buffer: the peer sends in bulk
                self._grow(min(cap, self._max - cap))
        return memoryview(self._buf)[self._end:]

    def _grow(self, extra: int) -> None:
        # A new buffer, not bytearray.extend: a view handed out earlier may still be alive,
        # and a bytearray with live views cannot be resized.
        keep = self._frame_at if self._gathering else self._start
        left = self._end - keep
        buf = bytearray(len(self._buf) - keep + extra)
        buf[:left] = self._buf[keep:self._end]
        self._buf, self._start, self._end = buf, self._start - keep, left
        self._frame_at = 0

    def filled(self, n: int) -> None:
        """``n`` bytes were written at the start of the last :meth:`space`."""
        self._end += n
        self._filled_up = self._end == len(self._buf)
        if (n < self._min // 4 and len(self._buf) > self._min and self._start == 0 and self._end == n
                and not self._gathering):
            # Small reads into a big, otherwise empty buffer: give the memory back.
            kept = bytes(self._buf[:n])
            self._buf = bytearray(self._min)
            self._buf[:n] = kept

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Add ``data`` (a copy): for bytes received elsewhere, such as after an HTTP head."""
        view = memoryview(data)
        while view:
            room = self.space()
            n = min(len(room), len(view))
            if n == 0:  # only when the buffer is full and at its largest: grow past it
                self._grow(len(view))
                continue
            room[:n] = view[:n]
            self.filled(n)
            view = view[n:]

    def discard_frame(self) -> int:
        """Drop what is buffered of the data frame being read; returns how many of its bytes
        are still to come (0 when none is being read). The reader is not to be used after
        this but to discard more of the frame (the connection is being closed)."""
        if not self._in_frame:
            return 0
        m = min(self._remaining, self._end - self._start)
        self._start += m
        self._remaining -= m
        self._gathering = False
        self._in_frame = self._remaining > 0
        return self._remaining

    def release(self) -> None:
        """Drop the buffer (the connection ended)."""
        self._buf = bytearray(0)
        self._start = self._end = 0
        self._gathering = False
        self._frame_at = 0

    def next_event(self) -> Data | Progress | Ping | Pong | CloseConnection | None:
        if self._in_frame:
            return self._payload()
        avail = self._end - self._start
        if avail < 2:
            return None
        buf, s = self._buf, self._start
        b0, b1 = buf[s], buf[s + 1]
        fin = bool(b0 & 0x80)
        opcode = b0 & 0x0F
        if opcode not in _OPCODES:
            raise FrameError(f"Invalid opcode {opcode:#x}")
        control = opcode >= CLOSE
        if control and not fin:
            raise FrameError("Invalid attempt to fragment control frame")
        n = b1 & 0x7F
        if control and n > _MAX_CONTROL:
            raise FrameError("Control frame with payload len > 125")
        size = 2 + (2 if n == 126 else 8 if n == 127 else 0)
        if avail < size:
            return None
        if n == 126:
            (n,) = struct.unpack_from("!H", buf, s + 2)
            if n <= _MAX_CONTROL:
                raise FrameError("Payload length used 2 bytes when 1 would have sufficed")
        elif n == 127:
            (n,) = struct.unpack_from("!Q", buf, s + 2)
            if n <= 0xFFFF:
                raise FrameError("Payload length used 8 bytes when 2 would have sufficed")
            if n >> 63:
                raise FrameError("8-byte payload length with non-zero MSB")
        if b0 & 0x70:
            raise FrameError("Reserved bit set unexpectedly")
        if self._masked and not b1 & 0x80:
            raise FrameError("server received unexpected unmasked frame")
        if not self._masked and b1 & 0x80:
            raise FrameError("client received unexpected masked frame")
        if self._masked:
            size += 4
        if avail < size + (n if control else 0):
            return None  # control frames come out whole
        key = bytes(buf[s + size - 4:s + size]) if self._masked else b""
        self._start = s + size
        if control:
            view = memoryview(buf)[self._start:self._start + n]
            if key:
                _unmask(view, key, 0)
            payload = bytes(view)
            self._start += n
            if opcode == PING:
                return Ping(payload=payload)
            if opcode == PONG:
                return Pong(payload=payload)
            return _close_event(payload)
        if opcode == CONTINUATION:
            if self._message is None:
                raise FrameError("unexpected CONTINUATION")
        else:
            if self._message is not None:
                raise FrameError(f"expected CONTINUATION, got {opcode!r}")
            self._message = opcode
            self._utf8 = codecs.getincrementaldecoder("utf-8")() if opcode == TEXT else None
        self._in_frame, self._remaining, self._fin, self._key, self._phase = True, n, fin, key, 0
        if fin and opcode != CONTINUATION and size + n <= self._gather_max:
            self._gathering, self._frame_at, self._reported = True, s, 0
        return self._payload()

    def _gathered(self) -> Data | Progress | None:
        n = self._remaining
        have = min(n, self._end - self._start)
        if have < n:
            fresh = have - self._reported
            if not fresh:
                return None
            self._reported = have
            return Progress(fresh)
        start = self._start
        buf = memoryview(self._buf)
        view = buf[start:start + n]
        if self._key:
            _unmask(view, self._key, 0)
        text = self._message == TEXT
        if text:
            try:
                str(view, "utf-8")
            except UnicodeDecodeError as exc:
                raise FrameError(f"Invalid UTF-8 in text message: {exc}", 1007) from None
        frame = buf[self._frame_at:start + n]
        fresh = n - self._reported
        self._start = start + n
        self._remaining = 0
        self._in_frame = self._gathering = False
        self._message, self._utf8 = None, None
        return Data(payload=view, text=text, finished=True, frame=frame, fresh=fresh)

    def _payload(self) -> Data | Progress | None:
        if self._gathering:
            return self._gathered()
        m = min(self._remaining, self._end - self._start)
        if m == 0 and self._remaining:
            return None
        view = memoryview(self._buf)[self._start:self._start + m]
        if self._key:
            _unmask(view, self._key, self._phase)
        self._phase = (self._phase + m) % 4
        self._start += m
        self._remaining -= m
        frame_done = self._remaining == 0
        finished = frame_done and self._fin
        text = self._message == TEXT
        if text:
            assert self._utf8 is not None
            try:
                self._utf8.decode(view, final=finished)
            except UnicodeDecodeError as exc:
                raise FrameError(f"Invalid UTF-8 in text message: {exc}", 1007) from None
        if frame_done:
            self._in_frame = False
        if finished:
            self._message, self._utf8 = None, None
        return Data(payload=view, text=text, finished=finished, left=self._remaining)


def _close_event(payload: bytes) -> CloseConnection:
    if not payload:
        return CloseConnection(code=1005, reason="")
    if len(payload) == 1:
        raise FrameError("CLOSE with 1 byte payload")
    (code,) = struct.unpack_from("!H", payload)
    if code < 1000 or code > 4999:
        raise FrameError("CLOSE with invalid code")
    if code in _LOCAL_ONLY:
        raise FrameError("remote CLOSE with local-only reason")
    if code <= 2999 and code not in _DEFINED_CODES:
        raise FrameError("CLOSE with unknown reserved code")
    try:
        reason = payload[2:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FrameError(f"Error decoding CLOSE reason: {exc}", 1007) from None
    return CloseConnection(code=code, reason=reason)
