"""The tunnel's byte movers for trio: one WebSocket (subprotocol ``kvasir.tunnel.v1``) that
carries, after the session handshake, the raw bytes of HTTP/2 connections between the
backbone (client, via the hub) and a worker's gRPC server.

What may be sent when, and every wire constant, is in ``kvasir_rpc.protocol`` (sans-IO);
this module only sends whole messages, pings and pumps bytes.
"""

from __future__ import annotations

import trio
from trio_websocket import WebSocketConnection

from kvasir_rpc._channel import TunnelCipher
from kvasir_rpc._errors import CloseCode, RemoteProtocolError

__all__ = ["keepalive", "receive_message", "send_whole"]

# How long one message may take to leave once started (a peer that reads nothing for this
# long is gone; the keepalive says the same sooner).
SEND_TIMEOUT_S = 60.0


async def send_whole(ws: WebSocketConnection, message: bytes | str, timeout_s: float = SEND_TIMEOUT_S, *,
                     cipher: TunnelCipher | None = None) -> None:
    """Send one message on the tunnel so that a cancellation cannot cut it in half.

    Pumps are cancelled when the other side of a connection ends, often while they are
    sending. A frame cut in the middle (or a TLS record encrypted and never sent) corrupts
    the WebSocket for every message after it, and the session dies with it: a worker then
    re-registers as a new session. The send is shielded from the caller's cancellation,
    which takes effect at the next checkpoint; a send that cannot finish in ``timeout_s``
    raises RemoteProtocolError (close 1001), as the stream is no longer usable.

    With ``cipher`` (an encrypted session) the message is sealed first; sealing and the send
    are not separated by a checkpoint, so concurrent senders keep the counter's order."""
    with trio.CancelScope(shield=True) as scope:
        scope.deadline = trio.current_time() + timeout_s
        await ws.send_message(message if cipher is None else cipher.seal(message))
    if scope.cancelled_caught:
        raise RemoteProtocolError(f"a tunnel message could not be sent within {timeout_s:g} s",
                                  close_code=CloseCode.GOING_AWAY)
    await trio.lowlevel.checkpoint_if_cancelled()


async def receive_message(ws: WebSocketConnection, cipher: TunnelCipher | None = None) -> bytes | str:
    """The next tunnel message, opened with ``cipher`` when the session is encrypted (which
    raises RemoteProtocolError, 1008, for anything not sealed by the peer in order)."""
    message = await ws.get_message()
    return message if cipher is None else cipher.open(message)


async def keepalive(ws: WebSocketConnection, interval_s: float, timeout_s: float) -> None:
    """Ping the peer every ``interval_s``; raise RemoteProtocolError (close 1001) when a pong
    does not come back within ``timeout_s``: the peer froze or its path silently broke, and
    nothing else would notice while the tunnel is idle."""
    while True:
        await trio.sleep(interval_s)
        with trio.move_on_after(timeout_s) as scope:
            await ws.ping()
        if scope.cancelled_caught:
            raise RemoteProtocolError(f"keepalive: no pong within {timeout_s:g} s", close_code=CloseCode.GOING_AWAY)
