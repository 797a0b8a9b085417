"""The tunnel's byte movers for trio: one WebSocket (subprotocol ``kvasir.tunnel.v1``) that
carries, after the session handshake, the raw bytes of HTTP/2 connections between the
backbone (client, via the hub) and a worker's gRPC server.

What may be sent when, and every wire constant, is in ``kvasir_rpc.protocol`` (sans-IO);
this module only sends whole messages, checks an encrypted session's peer with sealed
heartbeats (a clear session's liveness is the WebSocket's own keepalive) and pumps bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from kvasir_rpc._channel import Heartbeat, HeartbeatAck, HeartbeatMonitor, TunnelCipher
from kvasir_rpc._errors import CloseCode, LocalProtocolError, RemoteProtocolError
from kvasir_rpc._ws import SEND_TIMEOUT_S, Parts, WebSocket

__all__ = ["SealedHeartbeat", "keepalive", "receive_message", "send_whole"]


async def send_whole(ws: WebSocket, message: bytes | memoryview | str | Parts | Heartbeat | HeartbeatAck,
                     timeout_s: float = SEND_TIMEOUT_S, *,
                     cipher: TunnelCipher | None = None) -> None:
    """Send one message on the tunnel so that a cancellation cannot cut it in half.

    Pumps are cancelled when the other side of a connection ends, often while they are
    sending. A frame cut in the middle (or a TLS record encrypted and never sent) corrupts
    the WebSocket for every message after it, and the session dies with it: a worker then
    re-registers as a new session. The send is shielded from the caller's cancellation,
    which takes effect at the next checkpoint; a send that cannot finish in ``timeout_s``
    raises RemoteProtocolError (close 1001), as the stream is no longer usable.

    With ``cipher`` (an encrypted session) the message is sealed first; sealing and the send
    are not separated by a checkpoint, so concurrent senders keep the counter's order. A
    heartbeat (or its ack) exists only sealed: without ``cipher`` it raises LocalProtocolError.
    A tuple of buffers is one message, their concatenation (a channel's prefix and its data):
    sent as they are in clear, joined only into what is sealed."""
    wire: bytes | memoryview | str | Parts
    if cipher is not None:
        wire = cipher.seal(message)
    elif isinstance(message, (Heartbeat, HeartbeatAck)):
        raise LocalProtocolError("a heartbeat is sent only sealed, on an encrypted session")
    else:
        wire = message
    # Shielded inside the WebSocket, and only where it waits: a message the socket takes at
    # once costs no cancel scope.
    if not await ws.send_message(wire, shielded_for=timeout_s):
        raise RemoteProtocolError(f"a tunnel message could not be sent within {timeout_s:g} s",
                                  close_code=CloseCode.GOING_AWAY)
    await trio.lowlevel.checkpoint_if_cancelled()


class SealedHeartbeat:
    """The liveness check of one encrypted session, from the side that sends it: a sealed
    heartbeat the peer must answer. A relay (a gateway, a CDN edge) can answer WebSocket pings
    for a peer that is gone, but cannot seal an ack without the session's keys.

    ``check`` sends one heartbeat and waits for its ack; ``receive_message`` hands the acks it
    opens to ``acknowledged``. The numbering and the checks are ``HeartbeatMonitor``'s."""

    def __init__(self, ws: WebSocket, cipher: TunnelCipher) -> None:
        self._ws = ws
        self._cipher = cipher
        self.monitor = HeartbeatMonitor(peer=cipher.peer)
        self._answered = trio.Event()
        self.rtt_s: float | None = None  # the last heartbeat's round trip
        self._sent_at = 0.0

    def acknowledged(self, ack: HeartbeatAck) -> None:
        """An ack from the peer; raises RemoteProtocolError (1008) unless it answers the
        heartbeat waiting."""
        self.monitor.receive_ack(ack)
        self.rtt_s = trio.current_time() - self._sent_at
        self._answered.set()

    async def check(self, timeout_s: float) -> None:
        """Send the next heartbeat and wait for its ack; raise RemoteProtocolError (1001) when
        none comes within ``timeout_s`` (counted from before the send)."""
        self._answered = trio.Event()
        with trio.move_on_after(timeout_s):
            self._sent_at = trio.current_time()
            await send_whole(self._ws, self.monitor.beat(), cipher=self._cipher)
            await self._answered.wait()
        if not self._answered.is_set():
            raise RemoteProtocolError(f"no sealed heartbeat answer within {timeout_s:g} s: the {self._cipher.peer} "
                                      "is gone or a relay is answering for it", close_code=CloseCode.GOING_AWAY)


async def receive_message(ws: WebSocket, cipher: TunnelCipher | None = None,
                          heartbeat: SealedHeartbeat | None = None) -> bytes | memoryview | str:
    """The next tunnel message, opened with ``cipher`` when the session is encrypted (which
    raises RemoteProtocolError, 1008, for anything not sealed by the peer in order). Data
    comes as a read-only view, valid until the next receive on ``ws``: pass it on first.

    On an encrypted session the sealed heartbeats are handled here, below the tunnel's
    control state machine: a heartbeat is answered at once with its ack, and an ack goes to
    ``heartbeat`` (an ack that answers nothing waiting raises RemoteProtocolError, 1008)."""
    while True:
        message = await ws.receive_view()
        if cipher is None:
            return message
        opened = cipher.open(message)
        if isinstance(opened, Heartbeat):
            await send_whole(ws, HeartbeatAck(opened.seq), cipher=cipher)
        elif isinstance(opened, HeartbeatAck):
            if heartbeat is None:
                raise RemoteProtocolError(f"the {cipher.peer} acknowledged heartbeat {opened.seq}, but no heartbeat "
                                          "was sent", close_code=CloseCode.POLICY_VIOLATION)
            heartbeat.acknowledged(opened)
        else:
            return opened


async def keepalive(ws: WebSocket, interval_s: float, timeout_s: float, heartbeat: SealedHeartbeat, *,
                    on_rtt: Callable[[float], None] | None = None) -> None:
    """Check an encrypted session's peer every ``interval_s`` with a sealed heartbeat, which
    only the peer itself can answer; raise RemoteProtocolError (close 1001) when it does not
    answer within ``timeout_s``: the peer froze, its path silently broke, or a relay answers
    WebSocket pings for a peer that is gone. A clear session's liveness is the WebSocket's
    own (its ``keepalive_s`` and ``idle_timeout_s``). ``on_rtt`` gets each check's round trip
    in seconds."""
    while True:
        await trio.sleep(interval_s)
        await heartbeat.check(timeout_s)
        if on_rtt is not None and heartbeat.rtt_s is not None:
            on_rtt(heartbeat.rtt_s)
