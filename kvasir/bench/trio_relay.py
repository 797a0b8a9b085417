"""The cheapest relay trio allows, for ``kvasir bench --hops``: a TCP relay that forwards each
read on at once, with the primitives the hub and the gateway move bytes with
(``kvasir_rpc.ReadBuffer``, ``write_parts``) and nothing else: no WebSocket frames, no mask, no
tunnel, no TLS. Its CPU per byte is what any relay written on trio pays for the same calls'
bytes on this machine, beyond the kernel copies of the floor: the scheduler, the wake-ups,
the interpreter. The hub's figure over it is what the hub's own work adds.

``python -m kvasir.bench.trio_relay --upstream HOST:PORT --ready-file F``: listens on
127.0.0.1, an ephemeral port (written to F as ``{"port": N}``), and relays each connection
to ``--upstream``. A benchmark tool, not a product part.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import trio

from kvasir_rpc import ReadBuffer, hostport, write_parts, write_ready_file

__all__ = ["main", "relay"]

CONNECT_TIMEOUT_S = 10.0


async def _pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
    """``src``'s bytes to ``dst`` as they come, then ``dst``'s write side closed."""
    buf = ReadBuffer()
    try:
        while True:
            view = await buf.receive(src)
            if not view:
                break
            await write_parts(dst, (view,))
        await dst.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def _serve(client: trio.SocketStream, upstream: tuple[str, int]) -> None:
    async with client:
        with trio.move_on_after(CONNECT_TIMEOUT_S) as connecting:
            up = await trio.open_tcp_stream(*upstream)
        if connecting.cancelled_caught:
            return
        async with up, trio.open_nursery() as nursery:
            nursery.start_soon(_pump, client, up)
            nursery.start_soon(_pump, up, client)


async def relay(upstream: tuple[str, int], ready: pathlib.Path | None) -> None:
    """Relay every connection made to a fresh port on 127.0.0.1 to ``upstream``, until cancelled."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    write_ready_file(ready, {"port": listeners[0].socket.getsockname()[1]})

    async def handler(stream: trio.SocketStream) -> None:
        await _serve(stream, upstream)

    await trio.serve_listeners(handler, listeners)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvasir.bench.trio_relay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, type=hostport(),
                        help="HOST:PORT every connection is relayed to")
    parser.add_argument("--ready-file", type=pathlib.Path, help="where to write {\"port\": N} once listening")
    args = parser.parse_args(argv)
    try:
        trio.run(relay, args.upstream, args.ready_file)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
