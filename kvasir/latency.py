"""A TCP latency proxy for benchmarks: forwards bytes both ways, each chunk delivered
``rtt/2`` after it arrived, in order, so a loopback link behaves like a WAN link of that
round-trip time (Linux netem is not available on these machines). The delay can be changed
while it runs by rewriting ``--rtt-file`` (looked at while bytes flow, at most every 0.1 s);
bandwidth is not limited.

The emulation must not charge the remote path CPU of its own (``latency_proxy_cpu_share`` in
``kvasir bench``), so this is one thread around ``selectors`` and each direction's queue of
due times, not an async framework: under trio, 70% of the proxy's CPU in the decode bench was the
interpreter (trio's scheduler and the proxy's tasks, about 70 wake-ups per decode step),
against 25% for the kernel's socket work (``tools/profile_decode.py``). This way it costs
half as much: 7.9 ms of CPU per decode step at RTT 13 ms against 13.5.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import os
import pathlib
import selectors
import signal
import socket
import sys
import time

from kvasir_rpc import ListenError, as_listen_error, hostport, write_ready_file

__all__ = ["LatencyProxy", "main"]

CHUNK = 1 << 20
IOV_MAX = 64  # buffers per gathered write (Linux allows 1024)
# Linux: bytes go socket -> pipe -> socket by splice(2), never copied into this process. A
# direction holds what is in flight (waiting its rtt/2) in a ring of pipes of up to 1 MiB
# each (the unprivileged pipe-max-size): 16 hold 16 MiB, 640 MB/s at 50 ms round trip.
PIPES = 16
# Without splice, a direction holds at most this much in this process's memory.
COPY_MAX_BYTES = 16 << 20
RTT_FILE_CHECK_S = 0.1
PIPE_BYTES = 1 << 20
CONNECT_TIMEOUT_S = 10.0
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


@dataclasses.dataclass
class _Note:
    """Bytes that arrived together and are due together: ``size`` bytes in pipe ``pipe``
    (splice), or ``data`` (copy); ``size == 0`` and no data: the sender's EOF."""

    due: float
    pipe: int = -1
    size: int = 0
    data: bytes = b""


class _Direction:
    """One direction of one connection: reads ``src`` when it is readable and has room, notes
    what arrived with its due time, and writes each note to ``dst`` once due."""

    def __init__(self, proxy: LatencyProxy, src: socket.socket, dst: socket.socket, splice: bool) -> None:
        self.proxy = proxy
        self.src, self.dst = src, dst
        self.notes: collections.deque[_Note] = collections.deque()
        self.pipes: list[tuple[int, int, int]] = []
        if splice:
            try:
                self.pipes = _open_pipes(PIPES)
            except OSError:
                pass
        self.fill = [0] * len(self.pipes)
        self.cur = 0
        self.held = 0  # bytes held in copy mode
        self.buf = bytearray(CHUNK) if not self.pipes else bytearray()
        self.ring_full = False  # every pipe holds bytes not yet due: reading waits for the writer
        self.src_eof = False  # the sender's EOF was read (and noted)
        self.done = False  # the EOF went out, or this direction failed
        self.want_write = False  # dst was full: waiting for it to drain

    def close(self) -> None:
        _close_pipes(self.pipes)
        self.pipes = []

    def can_read(self) -> bool:
        if self.src_eof or self.done:
            return False
        return not self.ring_full if self.pipes else self.held < COPY_MAX_BYTES

    def _advance(self) -> bool:
        """On to the next pipe of the ring, if the writer has emptied it; else the ring is
        full and reading waits for the writer."""
        nxt = (self.cur + 1) % len(self.pipes)
        if self.fill[nxt]:
            self.ring_full = True
            return False
        self.cur = nxt
        return True

    def _src_has_bytes(self) -> bool:
        try:
            return bool(self.src.recv(1, socket.MSG_PEEK))
        except OSError:  # BlockingIOError included: nothing there
            return False

    def read(self, now: float) -> None:
        """Take what ``src`` has, up to the room there is; one note per pipe filled."""
        due = self.proxy.due(now)
        while self.can_read():
            if self.pipes:
                room = self.pipes[self.cur][2] - self.fill[self.cur]
                if room == 0:
                    if not self._advance():
                        return
                    continue
                try:
                    got = os.splice(self.src.fileno(), self.pipes[self.cur][1], room, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    # Nothing to read, or the pipe is full (it counts pages, not bytes, so
                    # that can happen before ``room`` is used up); an empty one cannot be.
                    if self.fill[self.cur] == 0 or not self._src_has_bytes() or not self._advance():
                        return
                    continue
                except OSError:
                    got = 0
                if got:
                    self.fill[self.cur] += got
                    last = self.notes[-1] if self.notes else None
                    if last is not None and last.pipe == self.cur and last.due == due and last.size:
                        last.size += got
                    else:
                        self.notes.append(_Note(due, self.cur, got))
                    continue
            else:
                try:
                    got = self.src.recv_into(self.buf)
                except BlockingIOError:
                    return
                except OSError:
                    got = 0
                if got:
                    self.held += got
                    self.notes.append(_Note(due, data=bytes(memoryview(self.buf)[:got])))
                    continue
            self.src_eof = True
            self.notes.append(_Note(due))
            return

    def next_due(self) -> float | None:
        if self.done or self.want_write or not self.notes:
            return None
        return self.notes[0].due

    def write(self, now: float) -> None:
        """Send every note already due, in order, as far as ``dst`` takes them."""
        while self.notes and self.notes[0].due <= now and not self.done:
            note = self.notes[0]
            if note.size == 0 and not note.data:
                self.notes.popleft()
                try:
                    self.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                self.done = True
                return
            try:
                if self.pipes:
                    # The notes already due in the same pipe go in one splice.
                    size = note.size
                    for nxt in itertools.islice(self.notes, 1, None):
                        if nxt.pipe != note.pipe or not nxt.size or nxt.due > now:
                            break
                        size += nxt.size
                    sent = os.splice(self.pipes[note.pipe][0], self.dst.fileno(), size, flags=_SPLICE_FLAGS)
                    if not sent:  # an empty pipe where bytes were noted: never; end, don't spin
                        self.done = True
                        return
                    self.fill[note.pipe] -= sent
                    if not self.fill[note.pipe]:
                        self.ring_full = False
                    while sent:
                        head = self.notes[0]
                        if sent >= head.size:
                            sent -= head.size
                            self.notes.popleft()
                        else:
                            head.size -= sent
                            sent = 0
                else:
                    views: list[memoryview] = []
                    for nxt in self.notes:
                        if not nxt.data or nxt.due > now or len(views) == IOV_MAX:
                            break
                        views.append(memoryview(nxt.data))
                    sent = self.dst.sendmsg(views)
                    self.held -= sent
                    while sent:
                        head = self.notes[0]
                        if sent >= len(head.data):
                            sent -= len(head.data)
                            self.notes.popleft()
                        else:
                            head.data = head.data[sent:]
                            sent = 0
            except BlockingIOError:
                self.want_write = True
                return
            except OSError:
                self.done = True  # the peer is gone: so is this direction
                return


class _Connection:
    def __init__(self, proxy: LatencyProxy, client: socket.socket, upstream: socket.socket, splice: bool) -> None:
        self.socks = (client, upstream)
        self.ways = (_Direction(proxy, client, upstream, splice), _Direction(proxy, upstream, client, splice))

    @property
    def over(self) -> bool:
        return all(w.done for w in self.ways)

    def close(self) -> None:
        for w in self.ways:
            w.close()
        for s in self.socks:
            s.close()


class LatencyProxy:
    def __init__(self, upstream: tuple[str, int], rtt_ms: float, rtt_file: pathlib.Path | None = None,
                 *, splice: bool | None = None) -> None:
        self.upstream = upstream
        self.rtt_ms = rtt_ms
        self.rtt_file = rtt_file
        self.splice = hasattr(os, "splice") if splice is None else splice
        self._mtime = 0.0
        self._checked = -float("inf")
        self._sel = selectors.DefaultSelector()
        self._conns: set[_Connection] = set()
        self._masks: dict[int, int] = {}

    def due(self, now: float) -> float:
        """When a chunk that came ``now`` is to be delivered (monotonic clock). The RTT file is
        looked at here, at most every 0.1 s, while bytes flow: an idle proxy wakes for
        nothing (a 10 Hz poll cost ~3 ms of CPU a second, charged to every run measured)."""
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

    def _watch(self, sock: socket.socket, mask: int, data: object) -> None:
        """Register or change what ``sock`` is watched for (nothing: unregistered)."""
        fd = sock.fileno()
        old = self._masks.get(fd, 0)
        if mask == old:
            return
        if not mask:
            self._sel.unregister(fd)
            del self._masks[fd]
        elif not old:
            self._sel.register(fd, mask, data)
            self._masks[fd] = mask
        else:
            self._sel.modify(fd, mask, data)
            self._masks[fd] = mask

    def _rewatch(self, conn: _Connection) -> None:
        for sock in conn.socks:
            mask = 0
            for way in conn.ways:
                if way.src is sock and way.can_read():
                    mask |= selectors.EVENT_READ
                if way.dst is sock and way.want_write and not way.done:
                    mask |= selectors.EVENT_WRITE
            self._watch(sock, mask, conn)

    def _accept(self, listener: socket.socket) -> None:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        try:
            upstream = socket.create_connection(self.upstream, timeout=CONNECT_TIMEOUT_S)
        except OSError:
            client.close()
            return
        for s in (client, upstream):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Connection(self, client, upstream, self.splice)
        self._conns.add(conn)
        self._rewatch(conn)

    def _end(self, conn: _Connection) -> None:
        for sock in conn.socks:
            self._watch(sock, 0, None)
        conn.close()
        self._conns.discard(conn)

    def _step(self, conn: _Connection, now: float) -> None:
        """Read what can be read and write what is due on ``conn``; end it when both ways are."""
        for way in conn.ways:
            way.read(now)
            way.write(now)
        if conn.over:
            self._end(conn)
        else:
            self._rewatch(conn)

    def serve(self, listener: socket.socket) -> None:
        """Run until a signal handler raises (SIGTERM, SIGINT): every connection is closed."""
        listener.setblocking(False)
        self._sel.register(listener.fileno(), selectors.EVENT_READ, None)
        try:
            while True:
                due = [d for c in self._conns for w in c.ways if (d := w.next_due()) is not None]
                timeout = max(0.0, min(due) - time.monotonic()) if due else None
                events = self._sel.select(timeout)
                now = time.monotonic()
                touched: set[_Connection] = set()
                for key, mask in events:
                    conn = key.data
                    if conn is None:
                        self._accept(listener)
                        continue
                    if mask & selectors.EVENT_WRITE:
                        for way in conn.ways:
                            if way.dst.fileno() == key.fd:
                                way.want_write = False
                    touched.add(conn)
                for conn in list(self._conns):
                    if conn in touched or any((d := w.next_due()) is not None and d <= now for w in conn.ways):
                        self._step(conn, now)
        finally:
            for conn in list(self._conns):
                self._end(conn)
            self._sel.close()


class _Stop(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvasir latency-proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", type=hostport(), default=("127.0.0.1", 0))
    p.add_argument("--upstream", type=hostport(), required=True)
    p.add_argument("--rtt-ms", type=float, default=0.0)
    p.add_argument("--rtt-file", type=pathlib.Path, help="a file holding the RTT in ms, re-read when it changes")
    p.add_argument("--ready-file", type=pathlib.Path)
    p.add_argument("--copy", action="store_true", help="copy through this process instead of splice(2)")
    args = p.parse_args(argv)
    proxy = LatencyProxy(args.upstream, args.rtt_ms, args.rtt_file, splice=False if args.copy else None)

    address = f"{args.listen[0]}:{args.listen[1]}"
    try:
        listener = socket.create_server(args.listen, backlog=128)
    except OSError as exc:
        err: ListenError | None = as_listen_error(address, exc)
        print(f"kvasir latency-proxy: {err or exc}", file=sys.stderr)
        return 1

    def stop(*_: object) -> None:
        raise _Stop

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    write_ready_file(args.ready_file, {"port": listener.getsockname()[1]})
    with listener:
        try:
            proxy.serve(listener)
        except _Stop:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
