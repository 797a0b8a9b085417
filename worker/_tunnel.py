"""The worker's outbound tunnel: dial the hub, prove the wallet, then carry HTTP/2 bytes
between the WebSocket and the local gRPC server's Unix socket. Reconnects with jittered
exponential backoff; opens no listening TCP or UDP socket."""

from __future__ import annotations

import random
from collections.abc import Callable

import trio
from trio_websocket import ConnectionClosed, HandshakeError, WebSocketConnection

from kvasir_rpc import (
    CloseCode,
    RemoteProtocolError,
    SealedHeartbeat,
    WorkerHandshake,
    get_logger,
    keepalive,
    leaf_exception,
    open_websocket_url,
    receive_message,
    send_whole,
    TunnelCipher,
)
from kvasir_rpc.protocol import (
    KEEPALIVE_S,
    KEEPALIVE_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    READ_BYTES,
    TUNNEL_SUBPROTOCOLS,
    WORKER_HANDSHAKE_TIMEOUT_S,
    Close,
    Data,
    Open,
    WorkerTunnel,
)

__all__ = ["TunnelHolder", "run_tunnel", "serve_session"]

log = get_logger("worker.tunnel")

HANDSHAKE_TIMEOUT_S = WORKER_HANDSHAKE_TIMEOUT_S


class _Conn:
    """One HTTP/2 connection to the local gRPC server, pumped into the WebSocket."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.scope = trio.CancelScope()
        self.done = trio.Event()


async def serve_session(ws: WebSocketConnection, uds_path: str, *, keepalive_s: float = KEEPALIVE_S,
                        keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S, cipher: TunnelCipher | None = None) -> None:
    """Follow the hub's control messages until the WebSocket closes (ConnectionClosed) or
    the hub breaks the protocol or stops answering (RemoteProtocolError).

    What may be sent when is ``WorkerTunnel``'s; this moves the bytes, sealed and opened
    with ``cipher`` when the session is encrypted end to end. The hub's liveness is checked
    as the hub checks ours: a sealed heartbeat on an encrypted session (its heartbeats are
    answered in ``receive_message``), a WebSocket ping otherwise."""
    tunnel = WorkerTunnel()
    conn: _Conn | None = None
    heartbeat = SealedHeartbeat(ws, cipher) if cipher is not None else None

    async def pump(c: _Conn) -> None:
        """The local gRPC server's bytes into the tunnel, then "eof" when it ends the connection."""
        try:
            with c.scope:
                while True:
                    try:
                        data = await c.stream.receive_some(READ_BYTES)
                    except trio.BrokenResourceError as exc:
                        log.info("local gRPC connection broke", error=repr(exc))
                        data = b""
                    if not data:
                        break
                    await send_whole(ws, tunnel.send_data(bytes(data)), cipher=cipher)
                await send_whole(ws, tunnel.eof(), cipher=cipher)
        finally:
            c.done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keepalive, ws, keepalive_s, keepalive_timeout_s, heartbeat)
        try:
            while True:
                event = tunnel.receive(await receive_message(ws, cipher, heartbeat))
                if isinstance(event, Open):
                    conn = _Conn(await trio.open_unix_socket(uds_path))
                    nursery.start_soon(pump, conn)
                elif isinstance(event, Close):
                    assert conn is not None
                    conn.scope.cancel()
                    await conn.done.wait()
                    await conn.stream.aclose()
                    conn = None
                    await send_whole(ws, tunnel.closed(), cipher=cipher)
                elif isinstance(event, Data):
                    assert conn is not None
                    try:
                        await conn.stream.send_all(event.data)
                    except trio.BrokenResourceError:
                        pass  # the server ended the connection: the pump sees it too and sends "eof"
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
                subprotocols=list(TUNNEL_SUBPROTOCOLS),
                max_message_size=MAX_MESSAGE_BYTES, receive_buffer_size=READ_BYTES,
                message_queue_size=4,
                connect_timeout=HANDSHAKE_TIMEOUT_S,
                disconnect_timeout=5,
            ) as ws:
                if ws.subprotocol not in TUNNEL_SUBPROTOCOLS:
                    raise RemoteProtocolError(f"hub chose subprotocol {ws.subprotocol!r}, "
                                              f"need one of {', '.join(TUNNEL_SUBPROTOCOLS)}")
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
                log.info("session established", session_id=session_id, hub_key=hs.hub_key, url=url,
                         encrypted=hs.encrypted)
                try:
                    await serve_session(ws, uds_path, cipher=hs.cipher)
                except* ConnectionClosed as eg:
                    if holder is None or not holder.closing:
                        raise
                    # TunnelHolder.close is closing this WebSocket and waits for the hub's
                    # answer to its close frame. Leave the block without raising: an error
                    # would cancel the connection's reader task before it reads that answer,
                    # and close() would wait out its whole timeout on every shutdown.
                    reason = leaf_exception(eg).reason  # type: ignore[attr-defined]
                    log.info("tunnel closed", code=reason.code, reason=reason.reason)
                except* RemoteProtocolError as eg:
                    perr = leaf_exception(eg)
                    assert isinstance(perr, RemoteProtocolError)
                    with trio.move_on_after(2):  # the hub may be gone: do not wait on it
                        await ws.aclose(perr.close_code, perr.reason[:120])
                    raise
        except* ConnectionClosed as eg:
            reason = leaf_exception(eg).reason  # type: ignore[attr-defined]
            log.info("tunnel closed", code=reason.code, reason=reason.reason)
        except* RemoteProtocolError as eg:
            perr = leaf_exception(eg)
            assert isinstance(perr, RemoteProtocolError)
            # A refused hub key, signature or encryption policy is something to act on.
            (log.warning if perr.close_code == CloseCode.POLICY_VIOLATION else log.info)(
                "tunnel failed", error=perr.reason, code=perr.close_code)
        except* (OSError, HandshakeError, trio.TooSlowError) as eg:
            log.info("tunnel failed", error=repr(leaf_exception(eg)))
        if holder is not None and holder.closing:
            return
        delay = 0.05 if established else backoff * random.uniform(0.5, 1.5)
        if not established:
            backoff = min(backoff * 2, max_backoff_s)
        await trio.sleep(delay)
