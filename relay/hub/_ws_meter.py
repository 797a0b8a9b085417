"""Bounds on what a worker can make the hub's WebSocket library hold.

The hub's worker WebSockets are trio-websocket's, which gathers an unfinished message's
fragments itself (up to ``max_message_size``) and keeps whole ones in a queue: nothing in it
bounds their sum over connections, how long a message may stay unfinished, or what a
connection sends before its session is accepted. ``MeteredStream`` sits under it, between
the socket and trio-websocket, and counts what the worker sends as it goes by, with
``FrameMeter`` (sans-IO: bytes in, frame boundaries out). It enforces, as the gateway's own
WebSocket does (``kvasir_rpc.MessageBudget``):

* bytes of unfinished messages over all connections within a shared budget (close 4208);
* a deadline from a message's first byte to its last (close 4209);
* before the session is accepted (``verified``), at most ``hello_limit`` bytes of messages
  in all: a hello and nothing more (close 1009).

It closes a connection by writing the close frame itself (between two of trio-websocket's
frames: every send passes through here under one lock) and then ending the stream, which
trio-websocket sees as the connection lost; the refusal is counted and logged (rate-limited)
with its real code and reason.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import trio

from kvasir_rpc import CloseCode, MessageBudget
from relay._refusals import RefusalLog

__all__ = ["FrameMeter", "MeteredStream"]

_CONTINUATION, _TEXT, _BINARY = 0x0, 0x1, 0x2
# How long writing our close frame, and waiting for the worker to hang up, may take.
CLOSE_WRITE_S = 2.0
LINGER_READ = 64 << 10


class FrameMeter:
    """Follows the frames a client sends (RFC 6455 5.2) and counts data payload bytes.

    Feed it the bytes as they arrive, in any pieces. It never judges: a malformed frame is
    wsproto's to refuse; the meter only stops counting (``lost`` True) from there on."""

    def __init__(self) -> None:
        self._head = bytearray()  # an incomplete frame header
        self._left = 0  # payload bytes still to come in the current frame
        self._data = False  # the current frame is a data frame
        self._fin = False
        self.in_message = False
        self.message_bytes = 0  # payload bytes of the message in progress
        self.data_bytes = 0  # payload bytes of every data frame so far
        self.messages = 0  # data messages begun
        self.lost = False

    def _header_size(self) -> int | None:
        """The whole header's size once enough of it is here, else None."""
        if len(self._head) < 2:
            return None
        n = self._head[1] & 0x7F
        size = 2 + (2 if n == 126 else 8 if n == 127 else 0) + (4 if self._head[1] & 0x80 else 0)
        return size

    def feed(self, data: bytes) -> None:
        """Follow ``data``, the next bytes from the client."""
        view = memoryview(data)
        while view and not self.lost:
            if self._left:
                take = min(self._left, len(view))
                self._left -= take
                view = view[take:]
                if self._data:
                    self.message_bytes += take
                    self.data_bytes += take
                if not self._left:
                    self._end_frame()
                continue
            need = self._header_size()
            while need is None or len(self._head) < need:
                if not view:
                    return
                self._head.append(view[0])
                view = view[1:]
                need = self._header_size()
            opcode = self._head[0] & 0x0F
            self._fin = bool(self._head[0] & 0x80)
            n = self._head[1] & 0x7F
            if n == 126:
                n = struct.unpack_from("!H", self._head, 2)[0]
            elif n == 127:
                n = struct.unpack_from("!Q", self._head, 2)[0]
            self._head.clear()
            self._data = opcode in (_CONTINUATION, _TEXT, _BINARY)
            if self._data:
                if (opcode == _CONTINUATION) != self.in_message:
                    self.lost = True  # a continuation out of place, or a new message inside one: wsproto refuses it
                    return
                if not self.in_message:
                    self.in_message, self.message_bytes = True, 0
                    self.messages += 1
            self._left = n
            if not n:
                self._end_frame()

    def _end_frame(self) -> None:
        if self._data and self._fin:
            self.in_message, self.message_bytes = False, 0


class MeteredStream(trio.abc.Stream):
    """``inner`` (a worker's connection, its upgrade request replayed) with the bounds of the
    module docstring. ``on_end`` is called once, when the session is accepted
    (``verified``) or the stream closes, whichever is first. The first ``head_bytes`` (the
    upgrade request, replayed by the intake) are not frames. ``repr`` is ``remote`` (what
    trio-websocket reports as the peer of a stream it cannot place)."""

    def __init__(self, inner: trio.abc.Stream, remote: str, budget: MessageBudget, refusals: RefusalLog, *,
                 hello_limit: int, head_bytes: int = 0, on_end: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self._inner = inner
        self._head_left = head_bytes  # the HTTP upgrade request comes first: no frames in it
        self._remote = remote
        self._budget = budget
        self._refusals = refusals
        self._hello_limit = hello_limit
        self._on_end: Callable[[], None] | None = on_end
        self._clock = clock
        self._meter = FrameMeter()
        self._charged = 0  # budget bytes held for the message in progress
        self._started_at: float | None = None
        self._verified = False
        self._send_lock = trio.Lock()
        self._refused: tuple[int, str] | None = None

    def __repr__(self) -> str:
        return self._remote

    @property
    def refused(self) -> tuple[int, str] | None:
        """(close code, reason) if this stream ended the connection for breaking a bound."""
        return self._refused

    def verified(self) -> None:
        """The session is accepted: from now on only the budget and the deadline apply."""
        self._verified = True
        self._end()

    def _end(self) -> None:
        if self._on_end is not None:
            on_end, self._on_end = self._on_end, None
            on_end()

    def _give_back(self) -> None:
        self._budget.give(self._charged)
        self._charged = 0

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._refused is not None:
            raise trio.BrokenResourceError(f"closed by the hub: {self._refused[1]}")
        deadline = (self._started_at + self._budget.deadline_s) if self._started_at is not None else float("inf")
        with trio.move_on_at(deadline) as scope:
            data = bytes(await self._inner.receive_some(max_bytes))
        if scope.cancelled_caught:
            self._budget.refused_deadline += 1
            await self._refuse(CloseCode.MESSAGE_TIMEOUT, "message_deadline",
                               f"message not finished within {self._budget.deadline_s:g} s")
        if not data:
            self._give_back()
            return data
        meter = self._meter
        begun = meter.messages
        if self._head_left:
            skip = min(self._head_left, len(data))
            self._head_left -= skip
            meter.feed(data[skip:])
        else:
            meter.feed(data)
        if not meter.in_message:
            self._started_at = None
        elif meter.messages != begun:
            self._started_at = self._clock()  # the deadline runs from a message's first bytes
        if not self._verified and meter.data_bytes > self._hello_limit:
            await self._refuse(CloseCode.MESSAGE_TOO_BIG, "hello_too_big",
                               f"at most {self._hello_limit} bytes may come before the session is accepted")
        # The budget holds the unfinished message's bytes; a whole one leaves it (trio-websocket
        # queues at most message_queue_size whole messages per connection).
        held = meter.message_bytes if meter.in_message else 0
        if held < self._charged:
            self._budget.give(self._charged - held)
            self._charged = held
        elif held > self._charged:
            if not self._budget.take(held - self._charged):
                self._budget.refused_buffer += 1
                await self._refuse(CloseCode.BUFFERS_FULL, "buffer_full",
                                   "the hub holds too many unfinished messages; try again later")
            self._charged = held
        return data

    async def _refuse(self, code: int, why: str, reason: str) -> None:
        """Close the connection with ``code`` (our close frame, then the stream), count and log
        it, and raise BrokenResourceError for trio-websocket to drop the connection."""
        self._refused = (code, reason)
        self._refusals.refused(why, remote=self._remote, code=code, detail=reason)
        payload = struct.pack("!H", code) + reason.encode()[:123]
        self._give_back()
        with trio.move_on_after(CLOSE_WRITE_S):
            try:
                async with self._send_lock:
                    await self._inner.send_all(bytes([0x88, len(payload)]) + payload)
                # Closing with the worker's bytes unread would reset the connection, and a
                # reset can destroy our close frame before the worker reads it: read on,
                # dropping what comes, until it hangs up (or for CLOSE_WRITE_S at most).
                while await self._inner.receive_some(LINGER_READ):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        await self.aclose()
        raise trio.BrokenResourceError(f"closed by the hub ({code}): {reason}")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        async with self._send_lock:
            if self._refused is not None:
                raise trio.BrokenResourceError(f"closed by the hub: {self._refused[1]}")
            await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        self._give_back()
        self._end()
        await self._inner.aclose()
