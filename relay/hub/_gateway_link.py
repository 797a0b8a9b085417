"""The hub's side of the public gateway: a control WebSocket kept up with jittered backoff;
for each worker the gateway announces, a data WebSocket served exactly like a LAN session.

A gateway that cannot be reached, or drops the connection, is retried (one warning per
attempt, naming the gateway and what failed, and that it speaks TLS when a ``ws://`` URL was
given for a port that does). One that refuses this hub's token (HTTP 401)
or presents a certificate this machine does not trust is not: retrying cannot mend either,
so ``GatewayLink.run`` raises ``GatewayRefused`` with the line to show the operator.
"""

from __future__ import annotations

import dataclasses
import random
import socket
import ssl
import time
import urllib.parse
from collections.abc import Awaitable, Callable

import trio

from kvasir_rpc import (
    TLSStream,
    WebSocket,
    WsClosed,
    WsConnectTimeout,
    WsHandshakeError,
    WsRejected,
    get_logger,
    hostport_text,
    leaf_exception,
    open_websocket,
)
from kvasir_rpc.protocol import (
    GATEWAY_SUBPROTOCOL,
    HUB_CONTROL_PATH,
    HUB_DATA_PREFIX,
    KEEPALIVE_S,
    KEEPALIVE_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    TUNNEL_SUBPROTOCOLS,
    RemoteProtocolError,
    decode_pair,
)

__all__ = ["GatewayLink", "GatewayLinkState", "GatewayRefused"]

log = get_logger("relay.hub.gateway")
# trio.BrokenResourceError: a TLS handshake that failed (TLSStream raises it, the SSLError chained).
# WsHandshakeError: among others an answer that is not HTTP (a TLS alert, say); retried as the
# others are, never a crash of the hub.
_NETWORK_ERRORS = (WsClosed, WsHandshakeError, OSError, trio.TooSlowError, trio.BrokenResourceError)
_CONNECT_TIMEOUT_S = 10.0
# How long a ws:// gateway that failed is given to answer a TLS handshake (tls_hint).
_TLS_PROBE_TIMEOUT_S = 3.0


class GatewayRefused(Exception):
    """The gateway refused this hub in a way that retrying cannot mend (its token, or a
    certificate this machine does not trust); ``str()`` is the one line for the operator,
    naming the flag to fix."""


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc``, its causes and contexts, and the members of any group among them (trio's
    "all attempts to connect failed" holds one OSError per address), outermost first."""
    seen: list[BaseException] = []
    todo: list[BaseException] = [exc]
    while todo and len(seen) < 64:
        cur = todo.pop(0)
        if any(cur is s for s in seen):
            continue
        seen.append(cur)
        if isinstance(cur, BaseExceptionGroup):
            todo.extend(cur.exceptions)
        nxt = cur.__cause__ or cur.__context__
        if nxt is not None:
            todo.append(nxt)
    return seen


def refusal_line(gateway: str, exc: BaseException) -> str | None:
    """The operator's line when ``exc`` (a failed connection to ``gateway``) is one that
    retrying cannot mend; None when it is worth retrying."""
    if isinstance(exc, WsRejected) and exc.status_code in (401, 403):
        return (f"hub: the gateway at {gateway} refused this hub's token ({exc.status_code}): "
                "--gateway-token-file must hold the token the gateway reads from its --hub-token-file")
    for link in _chain(exc):
        if isinstance(link, ssl.SSLCertVerificationError):
            why = (link.verify_message or str(link)).rstrip(".")
            if "mismatch" in why.lower():
                host = urllib.parse.urlsplit(gateway).hostname or gateway
                return (f"hub: the gateway at {gateway} presented a certificate that is not for {host} ({why}): "
                        f"make it with kvasir certs --host {host}, or give --gateway the name it was made for")
            return (f"hub: the gateway at {gateway} presented a certificate this machine does not trust ({why}): "
                    "pass --ca-file with its CA (kvasir certs writes ca.pem)")
    return None


def describe(exc: BaseException) -> str:
    """What went wrong with a connection to the gateway, in words (not a repr)."""
    if isinstance(exc, WsRejected):
        return f"HTTP {exc.status_code}"
    if isinstance(exc, WsConnectTimeout | trio.TooSlowError):
        return f"no answer within {_CONNECT_TIMEOUT_S:g} s"
    if isinstance(exc, WsClosed):
        return f"closed ({exc.code}{' ' + exc.reason if exc.reason else ''})"
    if isinstance(exc, WsHandshakeError) and not isinstance(exc.__cause__, OSError):
        return str(exc).removeprefix("the server ")  # "answered in something other than HTTP/1.1 (...)"
    errors = [link for link in _chain(exc) if isinstance(link, OSError)]
    for link in errors:
        if link.strerror:  # "Connection refused", not "all attempts to connect to ... failed"
            return link.strerror[:200]
    return (str(errors[0] if errors else exc) or type(exc).__name__)[:200]


async def tls_hint(gateway: str, exc: BaseException, *, timeout_s: float = _TLS_PROBE_TIMEOUT_S) -> str:
    """`` — the gateway may speak TLS: use wss://HOST:PORT`` when the dial to the ``ws://`` URL
    ``gateway`` failed with ``exc`` and its port speaks TLS; else "".

    A TLS port takes the WebSocket request for a broken handshake and closes, or answers with
    a TLS alert: the dial finds the connection closed without an answer, or bytes that are
    not HTTP, and neither says TLS. So the port is asked, once per failed dial: a TLS
    handshake with it that completes, or that it answers with a TLS alert, is TLS. Nothing is
    asked of a refused connection or an unknown name, nor of a port that answered HTTP."""
    parts = urllib.parse.urlsplit(gateway)
    if parts.scheme != "ws" or not parts.hostname or isinstance(exc, WsRejected):
        return ""
    if any(isinstance(link, ConnectionRefusedError | socket.gaierror) for link in _chain(exc)):
        return ""
    host, port = parts.hostname, parts.port or 80
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only whether it speaks TLS: nothing is sent over it
    speaks = False
    with trio.move_on_after(timeout_s):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            return ""
        try:
            await TLSStream(stream, context, server_hostname=host).do_handshake()
            speaks = True
        except trio.BrokenResourceError as broken:  # the SSLError chained, if TLS got that far
            cause = broken.__cause__
            speaks = isinstance(cause, ssl.SSLError) and "ALERT" in (cause.reason or "")
        except OSError:
            pass
        finally:
            stream.socket.close()
    return f" — the gateway may speak TLS: use wss://{hostport_text(host, port)}" if speaks else ""


ServeConnection = Callable[[WebSocket, str], Awaitable[None]]


@dataclasses.dataclass
class GatewayLinkState:
    """What the hub's page shows of one gateway link: ``state`` is "connecting" (the first
    attempt), "connected" or "retrying"; since when (unix ms); what ended the last control
    connection; pairs (worker connections through it) live now and served in all."""

    gateway: str
    state: str = "connecting"
    since_unix_ms: int = dataclasses.field(default_factory=lambda: time.time_ns() // 1_000_000)
    last_error: str = ""
    connects: int = 0
    pairs_live: int = 0
    pairs_served: int = 0

    def to(self, state: str, error: str = "") -> None:
        if state != self.state:
            self.state, self.since_unix_ms = state, time.time_ns() // 1_000_000
        if error:
            self.last_error = error[:300]


class GatewayLink:
    """Keeps this hub reachable through a gateway (``wss://HOST:PORT``) until cancelled.

    ``serve_connection(ws, remote)`` is the hub's own session entry point; sessions run in a
    nursery of their own, so a lost control connection does not cut live sessions.
    ``run`` raises GatewayRefused when the gateway refuses this hub's token or presents a
    certificate this machine does not trust; every other failure is retried.
    """

    def __init__(self, serve_connection: ServeConnection, gateway_url: str, token: str, *,
                 ssl_context: ssl.SSLContext | None = None, min_backoff_s: float = 0.25,
                 max_backoff_s: float = 15.0, keepalive_s: float = KEEPALIVE_S,
                 keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S) -> None:
        self._serve = serve_connection
        # Every WebSocket to the gateway pings once silent this long and ends (1001) when
        # nothing comes within the timeout after: a data connection's pings go through the
        # gateway to the worker and back (PROTOCOL.md section 6).
        self._keepalive_s = keepalive_s
        self._idle_timeout_s = keepalive_s + keepalive_timeout_s
        self.base = gateway_url.rstrip("/")
        self._headers = [(b"Authorization", f"Bearer {token}".encode())]
        self._ssl = ssl_context
        self._min_backoff = min_backoff_s
        self._max_backoff = max_backoff_s
        self._task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
        self.state = GatewayLinkState(self.base)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the control connection up until cancelled. Reports started once the first
        attempt has connected or failed in a way worth retrying, so that a refusal
        (GatewayRefused, raised) comes before the hub says it is listening."""
        self._task_status = task_status
        backoff = self._min_backoff
        async with trio.open_nursery() as sessions:
            while True:
                connected, error = await self._control_once(sessions)
                self.state.to("retrying", error)
                self._started()
                backoff = self._min_backoff if connected else min(backoff * 2, self._max_backoff)
                delay = backoff * random.uniform(0.5, 1.5)
                log.warning("gateway control connection lost; reconnecting" if connected
                            else "cannot reach the gateway; retrying (check --gateway and that the gateway runs)",
                            gateway=self.base, error=error, retry_in_s=round(delay, 1))
                await trio.sleep(delay)

    def _started(self) -> None:
        self._task_status.started()
        self._task_status = trio.TASK_STATUS_IGNORED

    async def _control_once(self, sessions: trio.Nursery) -> tuple[bool, str]:
        """One life of the control connection: whether it was established, and what ended it.
        Raises GatewayRefused where retrying cannot help."""
        connected = False
        error = "closed"
        try:
            async with open_websocket(
                f"{self.base}{HUB_CONTROL_PATH}", ssl_context=self._ssl, subprotocols=[GATEWAY_SUBPROTOCOL],
                extra_headers=self._headers, connect_timeout=_CONNECT_TIMEOUT_S, disconnect_timeout=5,
                keepalive_s=self._keepalive_s, idle_timeout_s=self._idle_timeout_s,
            ) as ctrl:
                connected = True
                self.state.connects += 1
                self.state.to("connected")
                log.info("gateway control connected", gateway=self.base)
                self._started()
                while True:
                    try:
                        pair = decode_pair(await ctrl.receive_message())
                    except RemoteProtocolError as exc:
                        log.warning("gateway sent a malformed control message; ignoring it", reason=exc.reason)
                        continue
                    sessions.start_soon(self._serve_pair, pair.pair_id, pair.remote)
        except* _NETWORK_ERRORS as eg:
            failure = leaf_exception(eg)
            line = refusal_line(self.base, failure)
            if line is not None:
                self.state.to("refused", line)
                raise GatewayRefused(line) from None
            error = describe(failure) + ("" if connected else await tls_hint(self.base, failure))
        return connected, error

    async def _serve_pair(self, pid: str, remote: str) -> None:
        self.state.pairs_live += 1
        self.state.pairs_served += 1
        try:
            async with open_websocket(
                f"{self.base}{HUB_DATA_PREFIX}{pid}", ssl_context=self._ssl, subprotocols=list(TUNNEL_SUBPROTOCOLS),
                extra_headers=self._headers, max_message_bytes=MAX_MESSAGE_BYTES,
                keepalive_s=self._keepalive_s, idle_timeout_s=self._idle_timeout_s,
                connect_timeout=_CONNECT_TIMEOUT_S, disconnect_timeout=5,
            ) as ws:
                await self._serve(ws, f"gateway:{remote}")
        except* _NETWORK_ERRORS as eg:
            log.info("gateway data connection ended", pair=pid, error=repr(leaf_exception(eg))[:200])
        except* Exception:  # one session's failure must never stop the hub
            log.exception("gateway session failed", pair=pid)
        finally:
            self.state.pairs_live -= 1
