"""A TCP latency proxy for benchmarks: forwards bytes both ways, each chunk delivered
``rtt/2`` after it arrived, in order, so a loopback link behaves like a WAN link of that
round-trip time (Linux netem is not available on these machines). The delay can be changed
while it runs by rewriting ``--rtt-file``; bandwidth is not limited."""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys

import trio

from kvasir_rpc import ListenError, as_listen_error, hostport, write_ready_file

__all__ = ["LatencyProxy", "main"]

CHUNK = 1 << 20


class LatencyProxy:
    def __init__(self, upstream: tuple[str, int], rtt_ms: float, rtt_file: pathlib.Path | None = None) -> None:
        self.upstream = upstream
        self.rtt_ms = rtt_ms
        self.rtt_file = rtt_file
        self._mtime = 0.0

    async def watch_rtt_file(self) -> None:
        while self.rtt_file is not None:
            try:
                st = self.rtt_file.stat()
                if st.st_mtime != self._mtime:
                    self._mtime = st.st_mtime
                    self.rtt_ms = float(self.rtt_file.read_text().strip() or 0)
            except (OSError, ValueError):
                pass
            await trio.sleep(0.1)

    async def _pipe(self, src: trio.SocketStream, dst: trio.SocketStream) -> None:
        send, recv = trio.open_memory_channel[tuple[float, bytes]](64)  # bounded: backpressure holds

        async def reader() -> None:
            async with send:
                while True:
                    try:
                        data = await src.receive_some(CHUNK)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        data = b""
                    await send.send((trio.current_time() + self.rtt_ms / 2000.0, data))
                    if not data:
                        return

        async def writer() -> None:
            async with recv:
                async for due, data in recv:
                    await trio.sleep_until(due)
                    if not data:
                        try:
                            await dst.send_eof()
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            pass
                        return
                    try:
                        await dst.send_all(data)
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
            n.start_soon(proxy.watch_rtt_file)
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
