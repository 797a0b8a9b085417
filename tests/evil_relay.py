"""A malicious relay for the tests: a WebSocket server that a worker dials instead of its
gateway or hub, and that dials onward, as a compromised gateway or CDN edge would.

    python tests/evil_relay.py MODE --upstream ws(s)://HOST:PORT [--ca-file PEM] --workdir DIR [--flip-at N]

MODE is one of:
  record       copies every message both ways, and writes each one after the hub's accept
               to DIR/after_accept.bin (what an eavesdropper learns)
  flip         as record, and flips one bit in the worker's N-th binary message after the
               accept (once per relay process)
  strip        as record, and clears ``encrypted`` in the hub's SessionAccept
  mute         as record, but forwards nothing from the worker after its hello: the hub
               keeps a WebSocket whose pings the relay answers itself (trio-websocket
               answers them, as any WebSocket endpoint does) to a worker that is, for
               the hub, gone
  impersonate  dials nowhere: answers the worker as a hub with its own key

Events (one JSON object per line) go to DIR/events.jsonl: every close with its code and
reason, whether a hello ever reached an impersonator, what was tampered with. The relay is
ready when DIR/ready.json holds its port.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import ssl
import sys

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, open_websocket_url, serve_websocket

MAX_MESSAGE = 8 << 20


class Relay:
    def __init__(self, args: argparse.Namespace) -> None:
        self.mode = args.mode
        self.upstream = args.upstream.rstrip("/")
        self.ssl = ssl.create_default_context(cafile=args.ca_file) if self.upstream.startswith("wss://") else None
        self.dir = pathlib.Path(args.workdir)
        self.flip_at = args.flip_at
        self.flipped = False
        self.muted: set[int] = set()  # connections whose worker was silenced
        self.events = open(self.dir / "events.jsonl", "a", buffering=1)
        self.record = open(self.dir / "after_accept.bin", "ab", buffering=0)
        self.connections = 0

    def event(self, **fields: object) -> None:
        self.events.write(json.dumps(fields) + "\n")

    async def handle(self, request: WebSocketRequest) -> None:
        self.connections += 1
        conn = self.connections
        if self.mode == "impersonate":
            await self.impersonate(await request.accept(subprotocol=request.proposed_subprotocols[0]), conn)
            return
        try:
            async with open_websocket_url(self.upstream + request.path, ssl_context=self.ssl,
                                          subprotocols=list(request.proposed_subprotocols),
                                          max_message_size=MAX_MESSAGE, connect_timeout=10,
                                          disconnect_timeout=5) as up:
                down = await request.accept(subprotocol=up.subprotocol)
                self.event(conn=conn, event="paired", path=request.path, subprotocol=up.subprotocol)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.pump, down, up, "worker", conn, nursery.cancel_scope)
                    nursery.start_soon(self.pump, up, down, "hub", conn, nursery.cancel_scope)
        except (OSError, trio.TooSlowError, ConnectionClosed) as exc:
            self.event(conn=conn, event="upstream failed", error=repr(exc)[:200])

    async def pump(self, src: WebSocketConnection, dst: WebSocketConnection, sender: str, conn: int,
                   scope: trio.CancelScope) -> None:
        """``sender``'s messages from ``src`` to ``dst``; the hub's first two are the challenge and
        the accept, the worker's first is the hello."""
        n = 0
        handshake = 2 if sender == "hub" else 1
        try:
            while True:
                msg = await src.get_message()
                n += 1
                if n == 2 and sender == "hub" and self.mode == "strip" and isinstance(msg, bytes):
                    msg = self.strip(msg)
                    self.event(conn=conn, event="stripped encrypted from the accept")
                if n > handshake and self.mode == "mute" and sender == "worker":
                    if conn not in self.muted:
                        self.muted.add(conn)
                        self.event(conn=conn, event="muted the worker")
                    continue
                if n > handshake:
                    data = msg.encode() if isinstance(msg, str) else msg
                    if isinstance(msg, str):
                        self.event(conn=conn, event="text after the handshake", sender=sender, text=msg[:32])
                    self.record.write(data)
                    after = n - handshake
                    if (self.mode == "flip" and sender == "worker" and not self.flipped and isinstance(msg, bytes)
                            and after >= self.flip_at):
                        flipped = bytearray(msg)
                        flipped[len(flipped) // 2] ^= 0x10
                        msg = bytes(flipped)
                        self.flipped = True
                        self.event(conn=conn, event="flipped a bit", sender=sender, message=after, size=len(msg))
                await dst.send_message(msg)
        except ConnectionClosed as exc:
            reason = exc.reason
            self.event(conn=conn, event="closed", by=sender, code=reason.code, reason=reason.reason)
            with trio.move_on_after(2):
                await dst.aclose(reason.code if reason.code not in (1005, 1006) else 1001, reason.reason or "")
            scope.cancel()

    @staticmethod
    def strip(accept: bytes) -> bytes:
        from kvasir_rpc import session_pb2

        msg = session_pb2.SessionAccept.FromString(accept)
        msg.encrypted = False
        return msg.SerializeToString()

    async def impersonate(self, ws: WebSocketConnection, conn: int) -> None:
        from kvasir_rpc import HubHandshake, Wallet

        hs = HubHandshake(Wallet.generate(), e2e="on")
        try:
            await ws.send_message(hs.challenge())
            self.event(conn=conn, event="challenge sent", hub_key=hs.hub_key)
            with trio.fail_after(15):
                await ws.get_message()
            self.event(conn=conn, event="hello received")
        except ConnectionClosed as exc:
            self.event(conn=conn, event="closed", by="worker", code=exc.reason.code, reason=exc.reason.reason)
        except trio.TooSlowError:
            self.event(conn=conn, event="no hello")


async def main(args: argparse.Namespace) -> None:
    relay = Relay(args)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(lambda task_status: serve_websocket(
            relay.handle, "127.0.0.1", 0, ssl_context=None, max_message_size=MAX_MESSAGE,
            task_status=task_status))
        port = server.port
        (relay.dir / "ready.json.tmp").write_text(json.dumps({"port": port}))
        (relay.dir / "ready.json.tmp").rename(relay.dir / "ready.json")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["record", "flip", "strip", "impersonate", "mute"])
    p.add_argument("--upstream", default="")
    p.add_argument("--ca-file")
    p.add_argument("--workdir", required=True)
    p.add_argument("--flip-at", type=int, default=1)
    trio.run(main, p.parse_args())
    sys.exit(0)
