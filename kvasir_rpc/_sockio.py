"""Moving bytes through a trio socket with as few copies and task switches as the kernel allows.

``trio.SocketStream.send_all`` takes one buffer and yields to the scheduler after every
``send``; ``receive_some`` returns a fresh ``bytes`` that the WebSocket then copies into its
frame buffer. On the relays' bulk path each of those is paid per message, twice per hop:
:func:`write_parts` writes a frame's header and payload (and a tunnel channel's prefix)
with one ``writev``, straight away while the socket has room, and waits (and so yields)
only when it has none; :func:`read_into` receives into the caller's buffer. Errors read as
trio's streams raise them: ``BrokenResourceError`` for a peer or network that broke the
connection, ``ClosedResourceError`` for a socket this side closed.

Any other stream (TLS, memory streams in tests) goes through its own ``send_all`` and
``receive_some``: nothing changes for it but the number of calls.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

import trio

__all__ = ["ReadBuffer", "read_into", "write_now", "write_parts", "write_rest"]

Buffer = bytes | bytearray | memoryview

# What a closed socket's calls fail with (as trio's SocketStream reads them).
_CLOSED = frozenset((errno.EBADF, errno.ENOTSOCK))
# os.writev's limit on buffers per call (IOV_MAX is 1024 on Linux): a message has a few.
_MAX_PARTS = 64


def _translate(exc: OSError) -> trio.BrokenResourceError | trio.ClosedResourceError:
    if exc.errno in _CLOSED:
        return trio.ClosedResourceError("this socket was already closed")
    return trio.BrokenResourceError(f"socket connection broken: {exc}")


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (what went out), from the front."""
    while n:
        first = views[0]
        if n >= len(first):
            n -= len(first)
            views.pop(0)
        else:
            views[0] = first[n:]
            n = 0


def write_now(stream: trio.abc.SendStream, parts: Sequence[Buffer]) -> list[memoryview]:
    """Write what a ``trio.SocketStream`` takes of ``parts`` right now, without waiting:
    the views of what is left (empty: everything went out), for :func:`write_rest`. Any
    other stream is not written to: everything is left. Raises as trio's streams do."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    if not isinstance(stream, trio.SocketStream) or len(views) > _MAX_PARTS:
        return views
    sock = stream.socket
    while views:
        fd = sock.fileno()
        if fd < 0:
            raise trio.ClosedResourceError("this socket was already closed")
        try:
            n = os.writev(fd, views)
        except BlockingIOError:
            break  # full: the rest waits for room
        except OSError as exc:
            raise _translate(exc) from exc
        # After a partial write the peer is usually draining already: the next try goes at
        # once, as trio's own send loop does.
        _advance(views, n)
    return views


async def write_rest(stream: trio.abc.SendStream, views: list[memoryview]) -> None:
    """Send what :func:`write_now` left: on a socket, waiting for room each time it is full
    (``views`` keeps what is still to go); on a stream with ``send_all_parts``
    (``TLSStream``) that; otherwise ``send_all`` per piece."""
    if not views:
        return
    if not isinstance(stream, trio.SocketStream) or len(views) > _MAX_PARTS:
        send_all_parts = getattr(stream, "send_all_parts", None)
        if send_all_parts is not None:  # TLSStream: encrypted together, sent as one
            await send_all_parts(views)
            return
        for view in views:
            await stream.send_all(view)
        return
    while views:
        await trio.lowlevel.wait_writable(stream.socket)
        views[:] = write_now(stream, views)  # in place: a caller cut short sees what is left


async def write_parts(stream: trio.abc.SendStream, parts: Sequence[Buffer]) -> None:
    """Send ``parts`` in order, nothing between them (one caller at a time: the caller holds
    its own send lock). On a ``trio.SocketStream`` one ``writev`` per try, without a task
    switch while the socket takes everything; on a stream with ``send_all_parts``
    (``TLSStream``) that; otherwise ``send_all`` per part."""
    await trio.lowlevel.checkpoint_if_cancelled()
    await write_rest(stream, write_now(stream, parts))


async def read_into(stream: trio.abc.ReceiveStream, view: memoryview) -> int:
    """Receive into ``view``: how many bytes (0 at EOF). Into the buffer itself on a
    ``trio.SocketStream`` (and on a stream with ``receive_into``, such as ``TLSStream``);
    otherwise a ``receive_some`` copied in."""
    if isinstance(stream, trio.SocketStream):
        try:
            return await stream.socket.recv_into(view)
        except OSError as exc:
            raise _translate(exc) from exc
    receive_into = getattr(stream, "receive_into", None)
    if receive_into is not None:
        n: int = await receive_into(view)
        return n
    data = await stream.receive_some(len(view))
    view[:len(data)] = data
    return len(data)


class ReadBuffer:
    """One reusable receive buffer for a stream read in bulk and in small pieces alike.

    ``trio.SocketStream.receive_some(1 MiB)`` allocates a 1 MiB ``bytes`` for every read
    and shrinks it to what came: for an 8 KiB message that costs 23 us here against 3 us
    for a receive into a buffer that is already there. This buffer starts at ``min_bytes``,
    doubles (up to ``max_bytes``) while reads fill it, and falls back to ``min_bytes`` after
    a small read, so a connection that carries little holds little."""

    def __init__(self, *, min_bytes: int = 64 << 10, max_bytes: int = 1 << 20) -> None:
        self._min = min_bytes
        self._max = max_bytes
        self._buf = memoryview(bytearray(0))

    async def receive(self, stream: trio.abc.ReceiveStream) -> memoryview:
        """The next bytes ``stream`` has, as a read-only view valid until the next call (empty
        at EOF). Raises as trio's streams do."""
        if not len(self._buf):
            self._buf = memoryview(bytearray(self._min))
        n = await read_into(stream, self._buf)
        size = len(self._buf)
        view = self._buf[:n].toreadonly()
        if n == size and size < self._max:  # filled: the peer sends in bulk
            self._buf = memoryview(bytearray(min(2 * size, self._max)))
        elif n < self._min // 4 and size > self._min:  # small now: give the memory back
            self._buf = memoryview(bytearray(self._min))
        return view
