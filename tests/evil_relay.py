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
               keeps a WebSocket whose pings the relay answers itself (the library's
               WebSocket answers them while it receives, as any WebSocket endpoint does)
               to a worker that is, for the hub, gone
  impersonate  dials nowhere: answers the worker as a hub with its own key

Events (one JSON object per line) go to DIR/events.jsonl: every close with its code and
reason, whether a hello ever reached an impersonator, what was tampered with. The relay is
ready when DIR/ready.json holds its port.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import ssl
import sys

import trio

from kvasir_rpc import (
    HttpError,
    HttpRequest,
    WebSocket,
    WsClosed,
    WsHandshakeError,
    accept_websocket,
    open_websocket,
    read_request,
    send_response,
)

MAX_MESSAGE = 8 << 20
# Both of the relay's WebSockets are plain endpoints, with no keepalive pings or idle timeout
# of their own: the worker's and the hub's keepalives run through it, each hop's pings
# answered here by the pump receiving on that WebSocket.
NO_KEEPALIVE_S = math.inf


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

    async def serve(self, stream: trio.SocketStream) -> None:
        """A trio.serve_tcp handler: the worker's WebSocket upgrade (anything else is refused)."""
        async with stream:
            try:
                request = await read_request(stream)
            except HttpError as exc:
                if exc.status is not None:
                    await send_response(stream, exc.status, f"{exc}\n")
                return
            if not request.is_upgrade:
                await send_response(stream, 426, "a WebSocket only\n")
                return
            await self.handle(stream, request)

    async def accept(self, stream: trio.SocketStream, request: HttpRequest, subprotocol: str | None) -> WebSocket:
        """The worker's WebSocket; HttpError (nothing sent) for an upgrade wsproto refuses."""
        return await accept_websocket(stream, request, subprotocol=subprotocol,  # type: ignore[arg-type]
                                      max_message_bytes=MAX_MESSAGE, keepalive_s=NO_KEEPALIVE_S,
                                      idle_timeout_s=NO_KEEPALIVE_S)

    async def handle(self, stream: trio.SocketStream, request: HttpRequest) -> None:
        self.connections += 1
        conn = self.connections
        if self.mode == "impersonate":
            if not request.subprotocols:
                await send_response(stream, 400, "no subprotocol offered\n")
                return
            ws = await self.accept(stream, request, request.subprotocols[0])
            try:
                await self.impersonate(ws, conn)
            finally:
                await ws.close()
            return
        try:
            # The target, query included, as the worker sent it.
            async with open_websocket(self.upstream + request.target, ssl_context=self.ssl,
                                      subprotocols=request.subprotocols, max_message_bytes=MAX_MESSAGE,
                                      keepalive_s=NO_KEEPALIVE_S, idle_timeout_s=NO_KEEPALIVE_S,
                                      connect_timeout=10, disconnect_timeout=5) as up:
                down = await self.accept(stream, request, up.subprotocol)
                self.event(conn=conn, event="paired", path=request.target, subprotocol=up.subprotocol)
                closing: set[str] = set()  # the pump that passed its side's close on to the other side
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self.pump, down, up, "worker", conn, nursery.cancel_scope, closing)
                        nursery.start_soon(self.pump, up, down, "hub", conn, nursery.cancel_scope, closing)
                finally:
                    with trio.move_on_after(2, shield=True):
                        await down.close()
        except (OSError, trio.TooSlowError, trio.BrokenResourceError, WsHandshakeError, WsClosed, HttpError) as exc:
            # The upstream unreachable, refusing or not a WebSocket (its TLS handshake failing:
            # BrokenResourceError), or the worker's upgrade not to be accepted.
            self.event(conn=conn, event="upstream failed", error=repr(exc)[:200])

    async def pump(self, src: WebSocket, dst: WebSocket, sender: str, conn: int, scope: trio.CancelScope,
                   closing: set[str]) -> None:
        """``sender``'s messages from ``src`` to ``dst``; the hub's first two are the challenge and
        the accept, the worker's first is the hello. ``src`` is the one WebSocket this task
        receives on (its pings answered here), ``dst`` one it sends on."""
        n = 0
        handshake = 2 if sender == "hub" else 1
        while True:
            try:
                msg = await src.receive_message()
            except WsClosed as exc:
                if not (exc.local and closing):  # else the other pump closed ``src``: not ``sender``'s doing
                    self.event(conn=conn, event="closed", by=sender, code=exc.code, reason=exc.reason)
                    closing.add(sender)
                    with trio.move_on_after(2):
                        if exc.code in (1005, 1006):  # no close code to pass on: the peer is gone
                            await dst.close(1001)
                        else:
                            await dst.close(exc.code, exc.reason)
                scope.cancel()
                return
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
            try:
                await dst.send_message(msg)
            except WsClosed:
                return  # ``dst`` ended: the pump receiving on it reports that close and ends the pair

    @staticmethod
    def strip(accept: bytes) -> bytes:
        from kvasir_rpc import session_pb2

        msg = session_pb2.SessionAccept.FromString(accept)
        msg.encrypted = False
        return msg.SerializeToString()

    async def impersonate(self, ws: WebSocket, conn: int) -> None:
        from kvasir_rpc import HubHandshake, Wallet

        hs = HubHandshake(Wallet.generate(), e2e="on")
        try:
            await ws.send_message(hs.challenge())
            self.event(conn=conn, event="challenge sent", hub_key=hs.hub_key)
            with trio.fail_after(15):
                await ws.receive_message()
            self.event(conn=conn, event="hello received")
        except WsClosed as exc:
            self.event(conn=conn, event="closed", by="worker", code=exc.code, reason=exc.reason)
        except trio.TooSlowError:
            self.event(conn=conn, event="no hello")


async def main(args: argparse.Namespace) -> None:
    relay = Relay(args)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, relay.serve, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
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
