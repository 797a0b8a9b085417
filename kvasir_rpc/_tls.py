"""TLS for the relays, lean on the bulk path.

``trio.SSLStream.receive_some`` returns at most one TLS record (16 KiB) per call and
refills 64 KiB at a time through a general retry loop: a 1 MiB tunnel message cost 64
trips through that loop and 64 feeds of the WebSocket parser above it. :class:`TLSStream`
reads up to 1 MiB off the socket per refill and returns every record already buffered, up
to ``max_bytes``; it is ``ssl.MemoryBIO`` and ``SSLObject`` over a trio socket stream,
nothing more. Measured (one-way 1 MiB writes, loopback, 2 cores, MB/s read):
``SSLStream`` 205-258, ``SSLStream`` drained of its buffered records 399-484,
:class:`TLSStream` 449-487.

``kvasir_rpc.open_websocket`` dials ``wss://`` over this stream (:func:`open_tls_over_tcp`),
so the hub and the workers reach the gateway through it too.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Callable, Sequence

import trio

from kvasir_rpc._sockio import ReadBuffer, write_parts
from kvasir_rpc.protocol import READ_BYTES

__all__ = ["TLSStream", "open_tls_over_tcp"]

# send_all encrypts and sends this much at a time (16 TLS records).
_WRITE_SLICE = 256 << 10


class TLSStream(trio.abc.Stream):
    """TLS over a trio socket stream with ``ssl.MemoryBIO``: one socket read of up to 1 MiB
    per refill and every buffered record decrypted per ``receive_some``.

    trio's ``SSLStream`` returns one 16 KiB record per read and refills 64 KiB at a time
    through a general retry loop; on the relays' bulk path that loop, not the cipher, was
    the cost (see the module doc for the figures). One task receives at a time and one
    sends at a time (as the library's WebSocket uses it); bytes the TLS object wants
    to send in answer to a record it read (a TLS 1.3 key update) go out under the same
    lock as ordinary sends, so records never interleave. A transport EOF without
    close_notify reads as EOF: the WebSocket above has its own closing handshake.
    """

    def __init__(self, transport: trio.SocketStream, ssl_context: ssl.SSLContext, *, server_side: bool = False,
                 server_hostname: str | None = None) -> None:
        self.transport_stream = transport
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = ssl_context.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                         server_hostname=server_hostname)
        self._send_lock = trio.Lock()
        # What the socket gives, up to READ_BYTES a read, before the TLS object takes a copy.
        self._reads = ReadBuffer(max_bytes=READ_BYTES)
        self._handshake_done = False
        self._handshake_lock = trio.Lock()
        self._transport_eof = False
        # Set when a send stopped between encrypting and sending (cancelled, or the socket
        # failed): the peer would see a gap in the record sequence, so nothing more may go.
        self._broken: str | None = None

    async def _flush(self) -> None:
        """Send what the TLS object produced, in order, under the send lock; bytes added
        while a send is in progress go out before the lock is let go."""
        async with self._send_lock:
            await self._send_pending()

    async def _send_pending(self) -> None:
        """Send the TLS object's output; the send lock is held. A send cut short leaves the
        stream broken (see ``_broken``)."""
        if self._broken is not None:
            raise trio.BrokenResourceError(self._broken)
        while self._outgoing.pending:
            data = self._outgoing.read()
            try:
                await write_parts(self.transport_stream, (data,))
            except BaseException as exc:
                self._broken = f"TLS stream unusable: a send was cut short ({type(exc).__name__})"
                raise

    async def _flush_if_free(self) -> None:
        """The receiving side's output (a key-update answer): sent now if no send is in
        progress, else left to that send, which sends it before it lets go of the lock.
        Waiting for the lock here could deadlock: a sender blocked on a full socket waits
        for the peer, and the peer for us to read."""
        if not self._outgoing.pending:
            return
        try:
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            return
        try:
            await self._send_pending()
        finally:
            self._send_lock.release()

    async def _refill(self) -> bool:
        """Read once from the socket into the TLS object; False at the transport's EOF."""
        if self._transport_eof:
            return False
        data = await self._reads.receive(self.transport_stream)
        if not data:
            self._transport_eof = True
            self._incoming.write_eof()
            return False
        self._incoming.write(data)
        return True

    async def do_handshake(self) -> None:
        async with self._handshake_lock:
            while not self._handshake_done:
                try:
                    self._tls.do_handshake()
                    self._handshake_done = True
                except ssl.SSLWantReadError:
                    await self._flush()
                    if not await self._refill():
                        raise trio.BrokenResourceError("the peer closed the connection during the TLS handshake") from None
                    continue
                except ssl.SSLError as exc:
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        await self._flush()  # our alert, best effort
                    raise trio.BrokenResourceError(f"TLS handshake failed: {exc}") from exc
                await self._flush()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        chunks: list[bytes] = []

        def take(room: int) -> int:
            data = self._tls.read(room)
            if data:
                chunks.append(data)
            return len(data)

        if not await self._decrypt(max_bytes or READ_BYTES, take):
            return b""
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def receive_into(self, buffer: memoryview) -> int:
        """``receive_some`` into ``buffer``: the records buffered are decrypted straight into
        it (no bytes object per record, no join). Returns how many bytes; 0 at EOF."""
        offset = 0

        def take(room: int) -> int:
            nonlocal offset
            n: int = self._tls.read(room, buffer[offset:])  # type: ignore[assignment]  # with a buffer: a count
            offset += n
            return n

        return await self._decrypt(len(buffer), take)

    async def _decrypt(self, limit: int, take: Callable[[int], int]) -> int:
        """Decrypt what the records hold, up to ``limit`` bytes, through ``take(room)`` (which
        reads at most ``room`` bytes and returns how many), waiting for the socket only while
        nothing is decrypted yet. Returns the total; 0 at EOF."""
        if not self._handshake_done:
            await self.do_handshake()
        size = 0
        while size < limit:
            try:
                n = take(limit - size)
            except ssl.SSLWantReadError:
                if size:
                    break  # return what is decrypted; the socket may have nothing more yet
                await self._flush_if_free()
                if await self._refill():
                    continue
                break  # transport EOF without close_notify: EOF
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                break  # close_notify, or the transport's EOF without it: EOF
            except ssl.SSLError as exc:
                raise trio.BrokenResourceError(f"TLS error: {exc}") from exc
            if not n:
                break
            size += n
        await self._flush_if_free()
        if not size:
            await trio.lowlevel.checkpoint()
        return size

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.send_all_parts((data,))

    async def send_all_parts(self, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        """``send_all`` of the parts one after the other (a WebSocket frame's header and
        payload): encrypted together, so the header does not cost a send of its own."""
        if not self._handshake_done:
            await self.do_handshake()
        lock = self._send_lock
        try:
            lock.acquire_nowait()  # no task switch when no other send is under way
        except trio.WouldBlock:
            await lock.acquire()
        try:
            if self._broken is not None:
                raise trio.BrokenResourceError(self._broken)
            # Encrypt under the lock, so the outgoing buffer holds our records only while
            # we send them (see _flush_if_free); a slice at a time, sent while the cache
            # still holds it, rather than the whole message encrypted into one more copy.
            queued = 0
            for data in parts:
                with memoryview(data) as view:
                    for at in range(0, len(view), _WRITE_SLICE):
                        piece = view[at:at + _WRITE_SLICE]
                        try:
                            self._tls.write(piece)
                        except ssl.SSLError as exc:
                            raise trio.BrokenResourceError(f"TLS error: {exc}") from exc
                        queued += len(piece)
                        piece.release()
                        if queued >= _WRITE_SLICE:
                            await self._send_pending()
                            queued = 0
            await self._send_pending()
        finally:
            lock.release()

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport_stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        """Send close_notify (best effort, without waiting for the peer's) and close."""
        try:
            if self._handshake_done:
                with contextlib.suppress(ssl.SSLError):
                    self._tls.unwrap()
                with trio.move_on_after(1), contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError,
                                                                 OSError):
                    await self._flush()
        finally:
            await self.transport_stream.aclose()


async def open_tls_over_tcp(host: str, port: int, ssl_context: ssl.SSLContext) -> TLSStream:
    """Connect and complete the TLS handshake."""
    tcp = await trio.open_tcp_stream(host, port)
    try:
        stream = TLSStream(tcp, ssl_context, server_hostname=host)
        await stream.do_handshake()
    except BaseException:
        await trio.aclose_forcefully(tcp)
        raise
    return stream
