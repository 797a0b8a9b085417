"""The worker's outbound tunnel: dial the hub, prove the wallet, then carry HTTP/2 bytes
between the WebSocket and the local gRPC server's Unix socket. Reconnects with jittered
exponential backoff; opens no listening TCP or UDP socket."""

from __future__ import annotations

import random
from collections.abc import Callable

import trio
from trio_websocket import ConnectionClosed, HandshakeError, WebSocketConnection

from kvasir_rpc import open_websocket_url
from kvasir_rpc import CloseCode, RemoteProtocolError, WorkerHandshake, get_logger, leaf_exception
from kvasir_rpc._tunnel import (
    CTRL_CLOSE,
    CTRL_CLOSED,
    CTRL_EOF,
    CTRL_OPEN,
    MAX_MESSAGE_BYTES,
    READ_BYTES,
    SUBPROTOCOL,
    keepalive,
    pump_stream_to_ws,
    send_whole,
)

__all__ = ["TunnelHolder", "run_tunnel", "serve_session"]

log = get_logger("worker.tunnel")

HANDSHAKE_TIMEOUT_S = 15.0


class _Conn:
    """One HTTP/2 connection to the local gRPC server, pumped into the WebSocket."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.scope = trio.CancelScope()
        self.done = trio.Event()


async def serve_session(ws: WebSocketConnection, uds_path: str, *, keepalive_s: float = 15.0,
                        keepalive_timeout_s: float = 10.0) -> None:
    """Follow the hub's control messages until the WebSocket closes (ConnectionClosed) or
    the hub stops answering pings (RemoteProtocolError)."""
    conn: _Conn | None = None

    async def pump(c: _Conn) -> None:
        try:
            with c.scope:
                await pump_stream_to_ws(c.stream, ws)
                # Our gRPC server ended the connection: tell the hub.
                await send_whole(ws, CTRL_EOF)
        finally:
            c.done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keepalive, ws, keepalive_s, keepalive_timeout_s)
        try:
            while True:
                msg = await ws.get_message()
                if msg == CTRL_OPEN:
                    if conn is not None:
                        raise RemoteProtocolError("hub sent 'open' while a connection is open")
                    stream = await trio.open_unix_socket(uds_path)
                    conn = _Conn(stream)
                    nursery.start_soon(pump, conn)
                elif msg == CTRL_CLOSE:
                    if conn is None:
                        raise RemoteProtocolError("hub sent 'close' with no connection open")
                    conn.scope.cancel()
                    await conn.done.wait()
                    await conn.stream.aclose()
                    conn = None
                    await ws.send_message(CTRL_CLOSED)
                elif isinstance(msg, bytes):
                    if conn is None:
                        raise RemoteProtocolError("tunnel bytes with no connection open")
                    try:
                        await conn.stream.send_all(msg)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass  # the pump sees the end too and reports "eof"
                else:
                    raise RemoteProtocolError(f"unknown control message {msg!r}")
        finally:
            nursery.cancel_scope.cancel()
            if conn is not None:
                await conn.stream.aclose()


class TunnelHolder:
    """The live WebSocket of ``run_tunnel``, so shutdown can close it with 1001 (going away)."""

    def __init__(self) -> None:
        self.ws: WebSocketConnection | None = None
        self.closing = False

    async def close(self, reason: str = "worker shutting down") -> None:
        """Close with 1001 and stop ``run_tunnel`` from dialling again (it would register
        a new session in the moment before the process exits)."""
        self.closing = True
        if self.ws is not None:
            with trio.move_on_after(2):
                await self.ws.aclose(CloseCode.GOING_AWAY, reason)


async def run_tunnel(
    url: str,
    make_handshake: Callable[[], WorkerHandshake],
    uds_path: str,
    *,
    ssl_context=None,  # type: ignore[no-untyped-def]
    min_backoff_s: float = 0.25,
    max_backoff_s: float = 30.0,
    holder: TunnelHolder | None = None,
) -> None:
    """Keep one session with the hub up until cancelled."""
    backoff = min_backoff_s
    while True:
        established = False
        try:
            async with open_websocket_url(
                url,
                ssl_context=ssl_context,
                subprotocols=[SUBPROTOCOL],
                max_message_size=MAX_MESSAGE_BYTES, receive_buffer_size=READ_BYTES,
                message_queue_size=4,
                connect_timeout=HANDSHAKE_TIMEOUT_S,
                disconnect_timeout=5,
            ) as ws:
                if ws.subprotocol != SUBPROTOCOL:
                    raise RemoteProtocolError(f"hub chose subprotocol {ws.subprotocol!r}, need {SUBPROTOCOL}")
                hs = make_handshake()
                try:
                    with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                        challenge = await ws.get_message()
                        if not isinstance(challenge, bytes):
                            raise RemoteProtocolError("challenge must be a binary message")
                        await ws.send_message(hs.receive_challenge(challenge))
                        accept = await ws.get_message()
                        if not isinstance(accept, bytes):
                            raise RemoteProtocolError("accept must be a binary message")
                        session_id = hs.receive_accept(accept)
                except RemoteProtocolError as exc:
                    await ws.aclose(exc.close_code, exc.reason[:120])
                    raise
                established = True
                backoff = min_backoff_s
                if holder is not None:
                    holder.ws = ws
                log.info("session established", session_id=session_id, hub_key=hs.hub_key, url=url)
                try:
                    await serve_session(ws, uds_path)
                except* RemoteProtocolError as eg:
                    perr = leaf_exception(eg)
                    assert isinstance(perr, RemoteProtocolError)
                    with trio.move_on_after(2):  # the hub may be gone: do not wait on it
                        await ws.aclose(perr.close_code, perr.reason[:120])
                    raise
        except* ConnectionClosed as eg:
            reason = leaf_exception(eg).reason  # type: ignore[attr-defined]
            log.info("tunnel closed", code=reason.code, reason=reason.reason)
        except* (OSError, HandshakeError, trio.TooSlowError, RemoteProtocolError) as eg:
            log.info("tunnel failed", error=repr(leaf_exception(eg)))
        if holder is not None and holder.closing:
            return
        delay = 0.05 if established else backoff * random.uniform(0.5, 1.5)
        if not established:
            backoff = min(backoff * 2, max_backoff_s)
        await trio.sleep(delay)
