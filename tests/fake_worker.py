"""A "worker" with no weights and no gRPC server, for the tests.

    python tests/fake_worker.py --hub ws://HOST:PORT --hub-grpc HOST:PORT --wallet PATH --copy SESSION_ID

It copies an honest session's slices and weights digest from ListSessions (they are public),
proves its own wallet, and answers each backbone connection the way a cheat would: the
HTTP/2 server preface (SETTINGS), a SETTINGS ACK, then frames of an unknown type (which
HTTP/2 clients must ignore), 64 KiB every 20 ms, for at most 60 seconds per connection.
"""

from __future__ import annotations

import argparse
import sys

import grpc
import trio

from kvasir_rpc import (
    Wallet,
    WorkerHandshake,
    WsClosed,
    open_websocket,
    session_pb2,
    session_pb2_grpc,
    slices_from_proto,
)
from kvasir_rpc.protocol import TUNNEL_SUBPROTOCOL as SUBPROTOCOL
from kvasir_rpc.protocol import Control

SETTINGS = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
SETTINGS_ACK = bytes([0, 0, 0, 4, 1, 0, 0, 0, 0])
JUNK = (1 << 16).to_bytes(3, "big") + bytes([0xFA, 0, 0, 0, 0, 0]) + b"\x00" * (1 << 16)


async def serve(url: str, hello: WorkerHandshake) -> None:
    async with open_websocket(url, subprotocols=[SUBPROTOCOL]) as ws:
        await ws.send_message(hello.receive_challenge(await ws.receive_message()))  # type: ignore[arg-type]
        print("fake session", hello.receive_accept(await ws.receive_message()), flush=True)  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            scope: trio.CancelScope | None = None

            async def junk(scope: trio.CancelScope) -> None:
                with scope, trio.move_on_after(60):
                    await ws.send_message(SETTINGS + SETTINGS_ACK)
                    while True:
                        await ws.send_message(JUNK)
                        await trio.sleep(0.02)

            # The one task that receives: it also answers the hub's keepalive pings.
            while True:
                msg = await ws.receive_message()
                if msg == Control.OPEN.value:
                    scope = trio.CancelScope()
                    nursery.start_soon(junk, scope)
                elif msg == Control.CLOSE.value:
                    if scope is not None:
                        scope.cancel()
                    await ws.send_message(Control.CLOSED.value)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hub", required=True)
    p.add_argument("--hub-grpc", required=True)
    p.add_argument("--wallet", required=True)
    p.add_argument("--copy", required=True, help="session id whose slices and digest to announce")
    args = p.parse_args()
    with grpc.insecure_channel(args.hub_grpc) as ch:
        sessions = session_pb2_grpc.SessionServiceStub(ch).ListSessions(session_pb2.ListSessionsRequest(), timeout=10)
    victim = next(s for s in sessions.sessions if s.session_id == args.copy)
    hello = WorkerHandshake(Wallet.load_or_create(args.wallet), slices=slices_from_proto(victim.slices),
                            weights_digest=victim.weights_digest, device=victim.device,
                            model_type=victim.model_type, worker_version="0.1.0")
    try:
        trio.run(serve, args.hub, hello)
    except* WsClosed:  # the hub ended the session: raised here, or by the sender, inside the nursery
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
