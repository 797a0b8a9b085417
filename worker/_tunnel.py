"""The worker's outbound tunnel: dial the hub, prove the wallet, then carry HTTP/2 bytes
between the WebSocket and the local gRPC server's Unix socket. Reconnects with jittered
exponential backoff; opens no listening TCP or UDP socket."""

from __future__ import annotations

import contextlib
import os
import random
import re
import ssl
import time
from collections.abc import Callable

import trio

from kvasir_rpc import (
    CloseCode,
    RemoteProtocolError,
    SealedHeartbeat,
    TunnelCipher,
    WebSocket,
    WorkerHandshake,
    WsClosed,
    WsConnectTimeout,
    WsHandshakeError,
    WsRejected,
    close_class,
    get_logger,
    keepalive,
    leaf_exception,
    open_websocket,
    receive_message,
    send_whole,
    write_parts,
)
from kvasir_rpc.protocol import (
    AEAD_NAMES,
    KEEPALIVE_S,
    KEEPALIVE_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    READ_BYTES,
    TUNNEL_SUBPROTOCOLS,
    WORKER_HANDSHAKE_TIMEOUT_S,
    Close,
    Data,
    Eof,
    Event,
    MuxWorkerTunnel,
    Open,
    WorkerTunnel,
)

__all__ = ["ReplanRequested", "TunnelHolder", "TunnelRefused", "request_plan", "run_tunnel", "serve_session"]

log = get_logger("worker.tunnel")

HANDSHAKE_TIMEOUT_S = WORKER_HANDSHAKE_TIMEOUT_S


def _dial(url: str, ssl_context: ssl.SSLContext | None) -> contextlib.AbstractAsyncContextManager[WebSocket]:
    """The worker's WebSocket to ``url``: the tunnel's subprotocols and largest message, and
    its keepalive on a clear session (a ping once the hub is silent KEEPALIVE_S, 1001 when
    nothing comes KEEPALIVE_TIMEOUT_S later: PROTOCOL.md section 6)."""
    return open_websocket(url, ssl_context=ssl_context, subprotocols=list(TUNNEL_SUBPROTOCOLS),
                          max_message_bytes=MAX_MESSAGE_BYTES, keepalive_s=KEEPALIVE_S,
                          idle_timeout_s=KEEPALIVE_S + KEEPALIVE_TIMEOUT_S, connect_timeout=HANDSHAKE_TIMEOUT_S,
                          disconnect_timeout=5)


async def _read_answer(sock: trio.socket.SocketType, view: memoryview) -> int:
    """Read the local gRPC server's bytes into ``view``: wait for the first, then take
    whatever more the socket holds right now, without waiting, up to ``len(view)``. Returns
    how many; 0 at the end (or when the connection broke: the pump ends it the same way).

    The server's Unix socket sends in pieces of its send buffer (about 208 KiB by default,
    and the server's end is not ours to enlarge), so a long answer arrives in many reads;
    each would be one tunnel message, and every hop (worker, gateway, hub) pays per message.
    Joining what is already here adds no latency: nothing waits for bytes not yet written."""
    try:
        n = await sock.recv_into(view)
    except OSError as exc:
        log.info("local gRPC connection broke", error=repr(exc))
        return 0
    fd = sock.fileno()
    while 0 < n < len(view):
        try:
            more = os.readv(fd, [view[n:]])  # the socket is non-blocking (trio's)
        except OSError:  # BlockingIOError: nothing more now; anything else: the next read says
            break
        if not more:  # the end: the next read finds it again
            break
        n += more
    return n


class _Conn:
    """One HTTP/2 connection to the local gRPC server, pumped into the WebSocket."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.scope = trio.CancelScope()
        self.done = trio.Event()


async def serve_session(ws: WebSocket, uds_path: str, *, keepalive_s: float = KEEPALIVE_S,
                        keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S, cipher: TunnelCipher | None = None,
                        counts: TunnelHolder | None = None, channels: int = 0) -> None:
    """Follow the hub's control messages until the WebSocket closes (WsClosed) or the hub
    breaks the protocol or stops answering (RemoteProtocolError).

    What may be sent when is ``WorkerTunnel``'s; this moves the bytes, sealed and opened
    with ``cipher`` when the session is encrypted end to end. The hub's liveness is checked
    as the hub checks ours: a sealed heartbeat on an encrypted session (its heartbeats are
    answered in ``receive_message``), the WebSocket's own keepalive otherwise (its pings
    after ``KEEPALIVE_S`` of silence, and 1001 after ``KEEPALIVE_TIMEOUT_S`` more: see
    ``run_tunnel``'s ``open_websocket``). ``counts`` (when given)
    adds the HTTP/2 bytes carried each way to its ``bytes_in`` and ``bytes_out``. With
    ``channels`` (the accept's tunnel_channels) the tunnel is multiplexed: each channel the hub
    opens is a fresh connection to the local gRPC server (one per backbone connection: the
    server sees them apart, and ``ExpertServicer`` takes their calls in turn); without, the
    plain tunnel is the same loop on one channel (``_OneChannel``)."""
    tunnel: MuxWorkerTunnel | _OneChannel = (MuxWorkerTunnel(channels) if channels
                                             else _OneChannel())
    conns: dict[int, _Conn] = {}
    heartbeat = SealedHeartbeat(ws, cipher) if cipher is not None else None

    async def pump(channel: int, c: _Conn) -> None:
        """The local gRPC server's bytes into the tunnel, then "eof" when it ends the connection."""
        try:
            # One buffer per connection, read into again only once send_whole has sent what
            # it held (sealed, or masked into the frame: a worker is a WebSocket client).
            view = memoryview(bytearray(READ_BYTES))
            with c.scope:
                while True:
                    n = await _read_answer(c.stream.socket, view)
                    if not n:
                        break
                    if counts is not None:
                        counts.bytes_out += n
                    await send_whole(ws, tunnel.send_parts(channel, view[:n]), cipher=cipher)
                await send_whole(ws, tunnel.eof(channel), cipher=cipher)
        finally:
            c.done.set()

    async with trio.open_nursery() as nursery:
        if heartbeat is not None:
            nursery.start_soon(keepalive, ws, keepalive_s, keepalive_timeout_s, heartbeat)
        try:
            while True:
                channel, event = tunnel.receive(await receive_message(ws, cipher, heartbeat))
                if isinstance(event, Open):
                    conns[channel] = _Conn(await trio.open_unix_socket(uds_path))
                    nursery.start_soon(pump, channel, conns[channel])
                elif isinstance(event, Close):
                    conn = conns.pop(channel)
                    conn.scope.cancel()
                    await conn.done.wait()
                    await conn.stream.aclose()
                    await send_whole(ws, tunnel.closed(channel), cipher=cipher)
                elif isinstance(event, Data):
                    if counts is not None:
                        counts.bytes_in += len(event.data)
                    try:  # before the next receive: event.data is a view of the WebSocket's buffer
                        await write_parts(conns[channel].stream, (event.data,))
                    except trio.BrokenResourceError:
                        pass  # the server ended the connection: the pump sees it too and sends "eof"
                else:  # nothing else reaches a worker
                    assert not isinstance(event, Eof)
        finally:
            nursery.cancel_scope.cancel()
            for conn in conns.values():
                await conn.stream.aclose()


class _OneChannel:
    """The plain tunnel (one connection at a time) as a tunnel of one channel, 0: what the
    multiplexed one's loop needs of it. Data goes out as the view it was read into."""

    def __init__(self) -> None:
        self._tunnel = WorkerTunnel()

    def receive(self, msg: bytes | memoryview | str) -> tuple[int, Event]:
        return 0, self._tunnel.receive(msg)

    def send_parts(self, channel: int, data: memoryview) -> tuple[bytes | memoryview]:
        return (self._tunnel.send_data(data),)  # type: ignore[arg-type]

    def eof(self, channel: int) -> str:
        return self._tunnel.eof()

    def closed(self, channel: int) -> str:
        return self._tunnel.closed()


async def request_plan(url: str, make_handshake: Callable[[], WorkerHandshake], *,
                       ssl_context=None,  # type: ignore[no-untyped-def]
                       attempts: int = 6, min_backoff_s: float = 0.5,
                       gateway: bool = False) -> dict[int, tuple[int, ...]]:
    """Dial the hub once with a planning hello (``make_handshake()`` made with ``expert_capacity``):
    the slice it suggests (``SessionAccept.suggested_slices``), then close. A dial that fails
    and may work later (a close whose code is not permanent, see ``close_class``) is retried
    with backoff, ``attempts`` times in all; TunnelRefused for one that cannot, for the last
    failure, and for a hub that suggests nothing (one too old to plan, which took the hello as
    an ordinary one). ``gateway``: ``url`` is a gateway's (the worker's --gateway), not a hub's."""
    backoff = min_backoff_s
    failure = ""
    where = f"{'the gateway' if gateway else 'the hub'} at {_shown(url, gateway)}"
    for attempt in range(attempts):
        handshake = make_handshake()
        try:
            async with _dial(url, ssl_context) as ws:
                if ws.subprotocol not in TUNNEL_SUBPROTOCOLS:
                    raise TunnelRefused(f"{_shown(url, gateway)} chose subprotocol {ws.subprotocol!r}: "
                                        "not a Kvasir hub")
                await _handshake(ws, handshake)
                if not handshake.suggested:
                    await ws.close(1000, "no slice suggested")
                    raise TunnelRefused(f"the hub at {_shown(url, gateway)} suggested no slice (a hub too old to "
                                        "plan, or one not told the model): give the worker --experts")
                await ws.close(1000, "slice taken")
                return handshake.suggested
        except _HandshakeClosed as closed:
            failure = _refusal(url, closed.reason, closed.code, by_hub=True, gateway=gateway)
        except RemoteProtocolError as exc:
            failure = _refusal(url, exc.reason, exc.close_code, by_hub=False, gateway=gateway)
        except (OSError, WsHandshakeError, trio.TooSlowError, trio.BrokenResourceError) as exc:
            failure, hint = _dial_failure(url, exc, gateway=gateway)
            failure += f" — {hint}" if hint else ""
        log.warning(f"asking for a slice: {failure}; retrying in {backoff:.1f} s", url=_shown(url, gateway),
                    attempt=attempt + 1, attempts=attempts)
        await trio.sleep(backoff)
        backoff = min(backoff * 2, 8.0)
    raise TunnelRefused(f"could not ask {where} for a slice in {attempts} tries: {failure}")


async def _handshake(ws: WebSocket, hs: WorkerHandshake) -> str:
    """Run ``hs`` on ``ws`` within HANDSHAKE_TIMEOUT_S: the session id. A refusal of this side's
    is sent with its code and raised (RemoteProtocolError); so is a timeout (4200,
    trio.TooSlowError); the peer's close raises _HandshakeClosed with its code and reason."""
    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT_S):
            challenge = await ws.receive_message()
            if not isinstance(challenge, bytes):
                raise RemoteProtocolError("challenge must be a binary message")
            await ws.send_message(hs.receive_challenge(challenge))
            accept = await ws.receive_message()
            if not isinstance(accept, bytes):
                raise RemoteProtocolError("accept must be a binary message")
            return hs.receive_accept(accept)
    except RemoteProtocolError as exc:
        with trio.move_on_after(2):  # the peer may be gone: do not wait on it
            await ws.close(exc.close_code, exc.reason[:120])
        raise
    except trio.TooSlowError:
        with trio.move_on_after(2):  # as the hub does: said why, with the code that says "retry"
            await ws.close(CloseCode.HANDSHAKE_TIMEOUT, "handshake timed out")
        raise
    except WsClosed as exc:
        # The peer closed during the handshake: its close code says why.
        raise _HandshakeClosed(exc.code, exc.reason) from None


class ReplanRequested(Exception):
    """The hub ended the session asking this worker (its slice the hub's plan) to plan again."""


class TunnelRefused(Exception):
    """A dial that retrying cannot fix (a certificate not trusted, an HTTP 4xx, a close whose
    code is permanent: a hello the hub refuses for what this worker is, a hub other than the
    pinned one). The message is one line for the person running the worker: what happened,
    where, and the flag to change."""


class TunnelHolder:
    """One ``run_tunnel``'s state, for the console and for shutdown: the live WebSocket (so
    shutdown can close it with 1001), the connection's state, the last failure and the bytes
    carried. Plain attributes, written by the tunnel's task and read by whoever shows them."""

    def __init__(self, url: str = "") -> None:
        self.url = url
        self.ws: WebSocket | None = None
        self.closing = False
        self.state = "connecting"  # connecting | connected | retrying
        self.session_id = ""
        self.encrypted = False
        self.last_error = ""
        self.retry_at = 0.0  # time.monotonic() of the next dial while retrying
        self.sessions = 0  # sessions established so far
        self.bytes_in = 0  # HTTP/2 bytes from the hub (requests)
        self.bytes_out = 0  # HTTP/2 bytes to the hub (answers)

    async def close(self, reason: str = "worker shutting down") -> None:
        """Close with 1001 and stop ``run_tunnel`` from dialling again (it would register
        a new session in the moment before the process exits)."""
        self.closing = True
        if self.ws is not None:
            with trio.move_on_after(2):
                await self.ws.close(CloseCode.GOING_AWAY, reason)


def _peer(gateway: bool) -> tuple[str, str]:
    """(what is dialled, the flag that names it): a gateway (--gateway) or a hub (--hub)."""
    return ("the gateway", "--gateway") if gateway else ("the hub", "--hub")


def _shown(url: str, gateway: bool) -> str:
    """The address as the person gave it: a gateway's without the path the worker adds."""
    return url.removesuffix("/v1/worker") if gateway else url


def _dial_failure(url: str, exc: BaseException, *, gateway: bool) -> tuple[str, str]:
    """What failed, for a dial that may work later, and a question that hints at the cause
    ("" when none); raises TunnelRefused for a dial that cannot work later. ``gateway``: the
    worker dials a gateway (--gateway), else a hub (--hub)."""
    what, flag = _peer(gateway)
    where = f"{what} at {_shown(url, gateway)}"
    if type(exc) is WsHandshakeError and isinstance(exc.__cause__, OSError):
        exc = exc.__cause__  # open_websocket's wrapping of a failed TCP connect
    if isinstance(exc, OSError) and isinstance(leaf_exception(exc.__cause__ or exc), OSError):
        exc = leaf_exception(exc.__cause__ or exc)  # trio's "all attempts to connect failed": the first reason
    # TLSStream reports a failed TLS handshake as BrokenResourceError, the ssl error in its text.
    untrusted = re.search(r"certificate verify failed: ([^(]*)", str(exc))
    if isinstance(exc, ssl.SSLCertVerificationError) or untrusted:
        why = untrusted[1].strip() if untrusted else getattr(exc, "verify_message", "")
        raise TunnelRefused(f"worker: {flag} {_shown(url, gateway)}: the gateway's TLS certificate is not trusted "
                            f"({why}); pass the CA that signed it with --ca-file (`kvasir certs DIR` writes a "
                            "development CA as DIR/ca.pem)")
    if isinstance(exc, WsRejected):
        body = bytes(exc.body or b"").decode(errors="replace").strip().splitlines()
        said = f": {body[0][:200]}" if body else ""
        if 400 <= exc.status_code < 500 and exc.status_code not in (408, 429):
            hint = (" (is it a gateway? then use --gateway wss://HOST:PORT)" if flag == "--hub" and exc.status_code == 404
                    else "")
            raise TunnelRefused(f"worker: {flag} {_shown(url, gateway)}: {what} refused this worker with HTTP "
                                f"{exc.status_code}{said}; check {flag}{hint}")
        return f"{where} answered HTTP {exc.status_code}{said}", ""
    running = f"is {what} running, and is {flag} its --listen address?"
    if isinstance(exc, WsConnectTimeout):
        return f"no answer from {where} within {HANDSHAKE_TIMEOUT_S:g} s", running
    if isinstance(exc, trio.TooSlowError):
        return f"{where} did not finish the session handshake within {HANDSHAKE_TIMEOUT_S:g} s", ""
    if isinstance(exc, ConnectionRefusedError):
        return f"cannot reach {where}: connection refused", running
    if isinstance(exc, trio.BrokenResourceError):
        return f"no TLS session with {where}: {exc}", f"is {flag} a wss:// gateway's address?"
    if isinstance(exc, OSError):
        return f"cannot reach {where}: {exc.strerror or exc}", running
    if isinstance(exc, WsHandshakeError):
        return f"{where} did not complete a WebSocket upgrade ({exc})", \
            f"is {flag} the address of {what}?"
    return f"{where}: {exc}", ""


def _refusal(url: str, reason: str, code: int, *, by_hub: bool, gateway: bool) -> str:
    """The sentence for a handshake refused with ``reason``, or TunnelRefused when the close
    code is permanent (``close_class``: the next dial would get the same answer; the reason
    names the flag to change). Any other code is retried. Decided by the code alone, never by
    the reason, which is for people."""
    what, _flag = _peer(gateway)
    if close_class(code) == "permanent":
        who = "the hub refused this worker" if by_hub else "this worker refused the hub"
        raise TunnelRefused(f"worker: {who} at {_shown(url, gateway)}: {reason}; dialling again unchanged would get "
                            f"the same answer (close code {code})")
    shown = _shown(url, gateway)
    who = f"{what} at {shown} refused the session" if by_hub else f"refused {what} at {shown}"
    return f"{who}: {reason or 'no reason'} (close code {code})"


async def run_tunnel(
    url: str,
    make_handshake: Callable[[], WorkerHandshake],
    uds_path: str,
    *,
    ssl_context=None,  # type: ignore[no-untyped-def]
    min_backoff_s: float = 0.25,
    max_backoff_s: float = 30.0,
    holder: TunnelHolder | None = None,
    replan: bool = False,
    gateway: bool = False,
) -> None:
    """Keep one session with the hub up until cancelled. ``gateway``: ``url`` is a gateway's
    (the worker's --gateway), not a hub's (--hub); it names what failed, and the flag.

    What a close does is its code's class (``close_class``), never its reason's text. With
    ``replan`` (a worker whose slice the hub planned), a session the hub ends asking it to plan
    again (close 4010, "replan") raises ``ReplanRequested`` instead of dialling again.

    A dial that fails and may work later (nothing listening yet, a timeout, an HTTP 5xx or
    429, a close whose code says "retry") is retried with jittered exponential backoff, each
    failure logged once at WARNING with what failed, where and the next try; a session that
    was established and ends with nothing refused ("closed", or "replan" unasked) is dialled
    again at once. One that cannot work later (see ``TunnelRefused``: a permanent close code,
    during the handshake or after it) raises TunnelRefused."""
    holder = holder if holder is not None else TunnelHolder(url)
    backoff = min_backoff_s
    what, _flag = _peer(gateway)
    shown = _shown(url, gateway)
    while True:
        established = False
        retry_later = False  # an established session ended by a close that says "retry"
        failure, hint = "", ""
        holder.state = "connecting"
        try:
            async with _dial(url, ssl_context) as ws:
                if ws.subprotocol not in TUNNEL_SUBPROTOCOLS:
                    raise RemoteProtocolError(f"hub chose subprotocol {ws.subprotocol!r}, "
                                              f"need one of {', '.join(TUNNEL_SUBPROTOCOLS)}")
                hs = make_handshake()
                session_id = await _handshake(ws, hs)
                established = True
                backoff = min_backoff_s
                holder.ws = ws
                holder.state, holder.session_id, holder.encrypted = "connected", session_id, hs.encrypted
                holder.last_error = ""
                holder.sessions += 1
                log.info("session established", session_id=session_id, hub_key=hs.hub_key, url=url,
                         encrypted=hs.encrypted, aead=AEAD_NAMES[hs.aead] if hs.encrypted else None,
                         backbone_connections=hs.channels or 1)
                try:
                    await serve_session(ws, uds_path, cipher=hs.cipher, counts=holder, channels=hs.channels)
                except* WsClosed as eg:
                    if not holder.closing:
                        raise
                    # TunnelHolder.close closed this WebSocket (1001): the worker is stopping.
                    closed = leaf_exception(eg)
                    assert isinstance(closed, WsClosed)
                    log.info("tunnel closed", code=closed.code, reason=closed.reason)
                except* RemoteProtocolError as eg:
                    perr = leaf_exception(eg)
                    assert isinstance(perr, RemoteProtocolError)
                    with trio.move_on_after(2):  # the hub may be gone: do not wait on it
                        await ws.close(perr.close_code, perr.reason[:120])
                    raise
        except* _HandshakeClosed as eg:
            closed = leaf_exception(eg)
            assert isinstance(closed, _HandshakeClosed)
            failure = _refusal(url, closed.reason, closed.code, by_hub=True, gateway=gateway)
        except* WsClosed as eg:
            reason = leaf_exception(eg)
            assert isinstance(reason, WsClosed)
            kind = close_class(reason.code)
            if kind == "replan" and replan:
                raise ReplanRequested(reason.reason or "the hub asks for a new plan") from None
            if kind == "permanent":  # raises TunnelRefused
                _refusal(url, reason.reason or "", reason.code, by_hub=True, gateway=gateway)
            retry_later = kind == "retry"
            side = " on this side" if reason.local else ""  # our keepalive found the hub silent, say
            failure = f"the session with {what} at {shown} ended{side}: {reason.reason or 'no reason'} " \
                      f"(close code {reason.code})"
        except* RemoteProtocolError as eg:
            perr = leaf_exception(eg)
            assert isinstance(perr, RemoteProtocolError)
            failure = (f"the session with {what} at {shown} ended: {perr.reason} (close code {perr.close_code})"
                       if established else _refusal(url, perr.reason, perr.close_code, by_hub=False, gateway=gateway))
        except* (OSError, WsHandshakeError, trio.TooSlowError, trio.BrokenResourceError) as eg:
            failure, hint = _dial_failure(url, leaf_exception(eg), gateway=gateway)
        holder.ws = None
        if holder.closing:
            return
        at_once = established and not retry_later
        delay = 0.05 if at_once else backoff * random.uniform(0.5, 1.5)
        if not at_once:
            backoff = min(backoff * 2, max_backoff_s)
        if failure:
            holder.last_error = failure
        holder.state = "retrying"
        holder.retry_at = time.monotonic() + delay
        if at_once:
            log.warning(f"{failure or 'the session ended'}; dialling again", url=shown)
        else:
            log.warning(f"{failure}; retrying in {delay:.1f} s" + (f" — {hint}" if hint else ""),
                        url=shown, retry_in_s=round(delay, 2))
        await trio.sleep(delay)


class _HandshakeClosed(Exception):
    """The peer closed the WebSocket during the session handshake (its code and reason)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
