"""The hub's side of the public gateway: a control WebSocket kept up with jittered backoff;
for each worker the gateway announces, a data WebSocket served exactly like a LAN session."""

from __future__ import annotations

import random
import ssl
from collections.abc import Awaitable, Callable

import trio
from trio_websocket import ConnectionClosed, HandshakeError, WebSocketConnection

from kvasir_rpc import get_logger, leaf_exception, open_websocket_url
from kvasir_rpc.protocol import (
    GATEWAY_SUBPROTOCOL,
    HUB_CONTROL_PATH,
    HUB_DATA_PREFIX,
    MAX_MESSAGE_BYTES,
    READ_BYTES,
    TUNNEL_SUBPROTOCOLS,
    RemoteProtocolError,
    decode_pair,
)

__all__ = ["GatewayLink"]

log = get_logger("relay.hub.gateway")
_NETWORK_ERRORS = (ConnectionClosed, HandshakeError, OSError, trio.TooSlowError)

ServeConnection = Callable[[WebSocketConnection, str], Awaitable[None]]


class GatewayLink:
    """Keeps this hub reachable through a gateway (``wss://HOST:PORT``) until cancelled.

    ``serve_connection(ws, remote)`` is the hub's own session entry point; sessions run in a
    nursery of their own, so a lost control connection does not cut live sessions.
    """

    def __init__(self, serve_connection: ServeConnection, gateway_url: str, token: str, *,
                 ssl_context: ssl.SSLContext | None = None, min_backoff_s: float = 0.25,
                 max_backoff_s: float = 15.0) -> None:
        self._serve = serve_connection
        self.base = gateway_url.rstrip("/")
        self._headers = [(b"Authorization", f"Bearer {token}".encode())]
        self._ssl = ssl_context
        self._min_backoff = min_backoff_s
        self._max_backoff = max_backoff_s

    async def run(self) -> None:
        backoff = self._min_backoff
        async with trio.open_nursery() as sessions:
            while True:
                connected = await self._control_once(sessions)
                backoff = self._min_backoff if connected else min(backoff * 2, self._max_backoff)
                await trio.sleep(backoff * random.uniform(0.5, 1.5))

    async def _control_once(self, sessions: trio.Nursery) -> bool:
        """One life of the control connection; True if it was established."""
        connected = False
        try:
            async with open_websocket_url(
                f"{self.base}{HUB_CONTROL_PATH}", ssl_context=self._ssl, subprotocols=[GATEWAY_SUBPROTOCOL],
                extra_headers=self._headers, connect_timeout=10, disconnect_timeout=5,
            ) as ctrl:
                connected = True
                log.info("gateway control connected", gateway=self.base)
                while True:
                    try:
                        pair = decode_pair(await ctrl.get_message())
                    except RemoteProtocolError as exc:
                        log.warning("gateway sent a malformed control message; ignoring it", reason=exc.reason)
                        continue
                    sessions.start_soon(self._serve_pair, pair.pair_id, pair.remote)
        except* _NETWORK_ERRORS as eg:
            log.info("gateway control connection lost", gateway=self.base, error=repr(leaf_exception(eg))[:200])
        return connected

    async def _serve_pair(self, pid: str, remote: str) -> None:
        try:
            async with open_websocket_url(
                f"{self.base}{HUB_DATA_PREFIX}{pid}", ssl_context=self._ssl, subprotocols=list(TUNNEL_SUBPROTOCOLS),
                extra_headers=self._headers, max_message_size=MAX_MESSAGE_BYTES, receive_buffer_size=READ_BYTES,
                message_queue_size=4,
                connect_timeout=10, disconnect_timeout=5,
            ) as ws:
                await self._serve(ws, f"gateway:{remote}")
        except* _NETWORK_ERRORS as eg:
            log.info("gateway data connection ended", pair=pid, error=repr(leaf_exception(eg))[:200])
        except* Exception:  # one session's failure must never stop the hub
            log.exception("gateway session failed", pair=pid)
