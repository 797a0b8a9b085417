"""A TCP latency proxy for benchmarks: forwards bytes both ways, each chunk delivered
``rtt/2`` after it arrived, in order, so a loopback link behaves like a WAN link of that
round-trip time (Linux netem is not available on these machines). The delay can be changed
while it runs by rewriting ``--rtt-file`` (looked at while bytes flow, at most every 0.1 s);
bandwidth is not limited."""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
from typing import TypeVar

import trio

from kvasir_rpc import ListenError, as_listen_error, hostport, write_ready_file

__all__ = ["LatencyProxy", "main"]

CHUNK = 1 << 20
IOV_MAX = 64  # buffers per gathered write (Linux allows 1024)
# Linux: bytes go socket -> pipe -> socket by splice(2), never copied into this process. A
# direction holds what is in flight (waiting its rtt/2) in a ring of pipes of up to 1 MiB
# each (the unprivileged pipe-max-size): 16 hold 16 MiB, 640 MB/s at 50 ms round trip.
PIPES = 16
RTT_FILE_CHECK_S = 0.1
PIPE_BYTES = 1 << 20
_SPLICE_FLAGS = getattr(os, "SPLICE_F_NONBLOCK", 0) | getattr(os, "SPLICE_F_MOVE", 0)


def _open_pipes(n: int) -> list[tuple[int, int, int]]:
    """``n`` non-blocking pipes as (read fd, write fd, capacity in bytes), each as large as
    the system lets it be; OSError when they cannot be made (the caller copies instead)."""
    import fcntl

    pipes: list[tuple[int, int, int]] = []
    try:
        for _ in range(n):
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            pipes.append((r, w, 0))
            try:
                cap = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:  # over the user's pipe allowance: keep the size it has
                cap = fcntl.fcntl(w, fcntl.F_GETPIPE_SZ)
            pipes[-1] = (r, w, cap)
    except OSError:
        _close_pipes(pipes)
        raise
    return pipes


def _close_pipes(pipes: list[tuple[int, int, int]]) -> None:
    for r, w, _ in pipes:
        os.close(r)
        os.close(w)


async def _send_chunks(dst: trio.SocketStream, chunks: list[bytes]) -> None:
    """Send ``chunks`` in order with gathered writes (no joined copy of them); raises
    trio.BrokenResourceError when the peer is gone."""
    views = [memoryview(c) for c in chunks]
    while views:
        try:
            sent = await dst.socket.sendmsg(views[:IOV_MAX])
        except OSError as exc:
            raise trio.BrokenResourceError(f"latency proxy: send failed: {exc}") from exc
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


_Note = TypeVar("_Note", bound=tuple)  # (due, ...): what a direction's reader hands its writer


async def _next_due(recv: trio.MemoryReceiveChannel[_Note], carry: _Note | None) -> _Note | None:
    """The note ``carry`` (one taken early and put back), else the channel's next, once it is
    due (its first field, trio's clock); None when the reader has ended the channel."""
    if carry is None:
        try:
            carry = await recv.receive()
        except trio.EndOfChannel:
            return None
    if carry[0] > trio.current_time():
        await trio.sleep_until(carry[0])
    return carry


class LatencyProxy:
    def __init__(self, upstream: tuple[str, int], rtt_ms: float, rtt_file: pathlib.Path | None = None) -> None:
        self.upstream = upstream
        self.rtt_ms = rtt_ms
        self.rtt_file = rtt_file
        self._mtime = 0.0
        self._checked = -float("inf")

    def due(self) -> float:
        """When a chunk that came now is to be delivered (trio's clock). The RTT file is
        looked at here, at most every 0.1 s, while bytes flow: an idle proxy wakes for
        nothing (a 10 Hz poll cost ~3 ms of CPU a second, charged to every run measured)."""
        now = trio.current_time()
        if self.rtt_file is not None and now - self._checked >= RTT_FILE_CHECK_S:
            self._checked = now
            try:
                st = self.rtt_file.stat()
                if st.st_mtime != self._mtime:
                    self._mtime = st.st_mtime
                    self.rtt_ms = float(self.rtt_file.read_text().strip() or 0)
            except (OSError, ValueError):
                pass
        return now + self.rtt_ms / 2000.0

    async def _pipe(self, src: trio.SocketStream, dst: trio.SocketStream) -> None:
        """Copy ``src`` to ``dst``, each chunk ``rtt/2`` after it came: by splice(2) where
        the system has it, else through this process's memory."""
        if hasattr(os, "splice"):
            try:
                pipes = _open_pipes(PIPES)
            except OSError:
                pass
            else:
                try:
                    return await self._splice(src, dst, pipes)
                finally:
                    _close_pipes(pipes)
        await self._copy(src, dst)

    async def _splice(self, src: trio.SocketStream, dst: trio.SocketStream, pipes: list[tuple[int, int, int]]) -> None:
        """The reader splices what ``src`` has into the current pipe of the ring (the next
        one when it is full, waiting until the writer emptied it) and notes (due, pipe,
        bytes); the writer splices each note's bytes to ``dst`` once due, every note already
        due in the same pipe in one call."""
        src_fd, dst_fd = src.socket.fileno(), dst.socket.fileno()
        fill = [0] * len(pipes)
        emptied = trio.lowlevel.ParkingLot()
        send, recv = trio.open_memory_channel[tuple[float, int, int]](4 * len(pipes))

        async def reader() -> None:
            cur = 0
            waited = False
            async with send:
                while True:
                    room = pipes[cur][2] - fill[cur]
                    try:
                        got = os.splice(src_fd, pipes[cur][1], room, flags=_SPLICE_FLAGS) if room else -1
                    except BlockingIOError:
                        # Nothing to read, or the pipe is full (it counts pages, not bytes):
                        # an empty one cannot be, nor can a socket that just said readable.
                        if fill[cur] == 0 or not waited:
                            await trio.lowlevel.wait_readable(src_fd)
                            waited = True
                            continue
                        got = -1
                    except OSError:
                        got = 0
                    waited = False
                    if got < 0:  # this pipe is full: on to the next, once the writer emptied it
                        cur = (cur + 1) % len(pipes)
                        while fill[cur]:
                            await emptied.park()
                        continue
                    fill[cur] += got
                    await send.send((self.due(), cur, got))
                    if not got:
                        return

        async def writer() -> None:
            carry: tuple[float, int, int] | None = None
            async with recv:
                while True:
                    note = await _next_due(recv, carry)
                    if note is None:
                        return
                    _, pipe, size = note
                    carry = None
                    while size:  # the notes already due in the same pipe go in one splice
                        try:
                            nxt = recv.receive_nowait()
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                        if nxt[1] != pipe or not nxt[2] or nxt[0] > trio.current_time():
                            carry = nxt
                            break
                        size += nxt[2]
                    if not size:
                        try:
                            await dst.send_eof()
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            pass
                        return
                    while size:
                        try:
                            sent = os.splice(pipes[pipe][0], dst_fd, size, flags=_SPLICE_FLAGS)
                        except BlockingIOError:
                            await trio.lowlevel.wait_writable(dst_fd)
                            continue
                        except OSError:
                            nursery.cancel_scope.cancel()  # the peer is gone: so is this direction
                            return
                        if not sent:  # an empty pipe where bytes were noted: never; end, don't spin
                            nursery.cancel_scope.cancel()
                            return
                        size -= sent
                        fill[pipe] -= sent
                    emptied.unpark_all()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            nursery.start_soon(writer)

    async def _copy(self, src: trio.SocketStream, dst: trio.SocketStream) -> None:
        """Copy ``src`` to ``dst``, each chunk ``rtt/2`` after it came. The emulation must not
        charge the remote path CPU of its own (``latency_proxy_cpu_share`` in ``kvasir
        bench``): the reader reads up to 1 MiB at a time, and the writer sends every chunk
        already due in one write, sleeping only when the next one is not due yet."""
        send, recv = trio.open_memory_channel[tuple[float, bytes]](64)  # bounded: backpressure holds

        async def reader() -> None:
            # One buffer for every read (recv of 1 MiB would allocate, and fault in, 1 MiB
            # each time); a chunk is copied out at its size.
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            async with send:
                while True:
                    try:
                        got = await src.socket.recv_into(buf)
                    except OSError:
                        got = 0
                    data = bytes(view[:got])
                    await send.send((self.due(), data))
                    if not data:
                        return

        async def writer() -> None:
            carry: tuple[float, bytes] | None = None
            async with recv:
                while True:
                    note = await _next_due(recv, carry)
                    if note is None:
                        return
                    _, data = note
                    carry = None
                    # What else is due goes in the same write (the reader may be ahead).
                    batch = [data] if data else []
                    eof = not data
                    while not eof:
                        try:
                            nxt = recv.receive_nowait()
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                        if nxt[0] > trio.current_time():
                            carry = nxt
                            break
                        eof = not nxt[1]
                        if nxt[1]:
                            batch.append(nxt[1])
                    try:
                        if batch:
                            await _send_chunks(dst, batch)
                        if eof:
                            await dst.send_eof()
                            return
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        return

        async with trio.open_nursery() as n:
            n.start_soon(reader)
            n.start_soon(writer)

    async def handle(self, client: trio.SocketStream) -> None:
        try:
            upstream = await trio.open_tcp_stream(*self.upstream)
        except OSError:
            await client.aclose()
            return
        async with client, upstream, trio.open_nursery() as n:
            n.start_soon(self._pipe, client, upstream)
            n.start_soon(self._pipe, upstream, client)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvasir latency-proxy", description=__doc__)
    p.add_argument("--listen", type=hostport(), default=("127.0.0.1", 0))
    p.add_argument("--upstream", type=hostport(), required=True)
    p.add_argument("--rtt-ms", type=float, default=0.0)
    p.add_argument("--rtt-file", type=pathlib.Path, help="a file holding the RTT in ms, re-read when it changes")
    p.add_argument("--ready-file", type=pathlib.Path)
    args = p.parse_args(argv)
    proxy = LatencyProxy(args.upstream, args.rtt_ms, args.rtt_file)

    address = f"{args.listen[0]}:{args.listen[1]}"

    async def run() -> None:
        try:
            listeners = await trio.open_tcp_listeners(args.listen[1], host=args.listen[0])
        except OSError as exc:
            raise as_listen_error(address, exc) or exc from None
        write_ready_file(args.ready_file, {"port": listeners[0].socket.getsockname()[1]})
        async with trio.open_nursery() as n:
            n.start_soon(trio.serve_listeners, proxy.handle, listeners)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    n.cancel_scope.cancel()
                    return

    try:
        trio.run(run)
    except ListenError as exc:
        print(f"kvasir latency-proxy: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
