"""The public gateway: both ends dial out and meet here.

Workers connect to ``/v1/worker``; a hub keeps a control WebSocket on ``/v1/hub/control``
(bearer token). When a worker arrives the gateway announces it to the hub (``encode_pair``
in ``kvasir_rpc.protocol``, where every path and subprotocol is defined); the hub dials
``/v1/hub/data/ID`` and the gateway splices the two WebSockets, relaying their messages
both ways without looking inside them. Everything the public can send is bounded:
handshake time, header and message sizes, unpaired workers, live sessions (in all and per
source address), bytes of unfinished messages (in all) and how long one may stay unfinished,
idle time, and new connections per source address per second. A source address is an IPv4
address or an IPv6 /64 (an IPv4-mapped IPv6 address counts as its IPv4 address): one host
usually holds a whole /64.

Once spliced, the two WebSockets' pings and pongs are relayed too, not answered here: the
hub's keepalive then tests the worker itself, end to end.

This module imports no protobuf or gRPC module.
"""

from __future__ import annotations

import dataclasses
import hmac
import ssl

import trio

from kvasir_rpc import (
    CloseCode,
    Held,
    HttpError,
    HttpRequest,
    MessageBudget,
    RemoteProtocolError,
    TLSStream,
    WebSocket,
    WsClosed,
    accept_websocket,
    address_key,
    get_logger,
    read_request,
    remote_host,
    send_response,
)
from kvasir_rpc.protocol import (
    GATEWAY_SUBPROTOCOL,
    HEALTH_PATH,
    HUB_CONTROL_PATH,
    HUB_DATA_PREFIX,
    MAX_MESSAGE_BYTES,
    PING,
    TUNNEL_SUBPROTOCOLS,
    WORKER_PATH,
    PairRequest,
    choose_subprotocol,
    encode_pair,
)
from relay._buckets import TokenBuckets
from relay._heap_trim import Trimmer
from relay._intake import Refusal, http_error_refusal, upgrade_refusal
from relay._refusals import RefusalLog
from relay.gateway._pairing import Pairing, Pairings

__all__ = ["GatewayConfig", "GatewayStats", "serve_gateway"]

log = get_logger("relay.gateway")

# Index 0: the worker's messages, to the hub; 1: the hub's, to the worker.
_DIRECTIONS = ("to_hub", "to_worker")
_SIDES = ("worker", "hub")  # who sent what the pump of that index reads


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 443
    hub_token: str = ""
    ssl_context: ssl.SSLContext | None = None
    handshake_timeout_s: float = 10.0
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_unpaired: int = 64
    max_sessions: int = 1024
    max_sessions_per_address: int = 32
    max_buffered_bytes: int = 256 << 20
    message_deadline_s: float = 30.0
    keepalive_s: float = 20.0
    idle_timeout_s: float = 120.0
    pairing_timeout_s: float = 10.0
    new_connections_per_ip_per_s: float = 50.0
    max_connections: int = 4096
    rate_table_size: int = 65536
    # One process of several (``--processes``): the public port is shared with the others
    # (SO_REUSEPORT, the kernel spreads connections), so a hub's connection to it could land
    # on any of them and its data connection on another than its pairing's. Hubs then
    # connect to this process's own hub-facing port and the public port refuses hub paths (421).
    shared_port: bool = False
    hub_host: str | None = None  # listen for hubs here too (port 0: any free port)
    hub_port: int | None = None
    # Listening sockets handed down by the parent (``--processes``), instead of binding
    # ``port`` and ``hub_port``: they outlive a child, so a restarted one serves the same ports.
    listen_fd: int | None = None
    hub_fd: int | None = None


@dataclasses.dataclass(frozen=True)
class GatewayStats:
    connections: int
    hub_connected: bool
    unpaired: int
    sessions: int
    refused: dict[str, int]
    relayed_bytes: int
    buffered_bytes: int
    sessions_by_address: dict[str, int]
    sessions_spliced: int = 0  # since start
    # Since start, by direction ("to_hub": the worker's messages, "to_worker": the hub's).
    relayed_bytes_by_direction: dict[str, int] = dataclasses.field(default_factory=dict)
    relayed_messages_by_direction: dict[str, int] = dataclasses.field(default_factory=dict)
    # Spliced sessions ended, by (the side that closed first, its close code).
    sessions_closed: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Link:
    """What the I/O code keeps with a pairing (the state is the ``Pairings``')."""

    worker: WebSocket
    hub_ws: WebSocket | None = None
    paired: trio.Event = dataclasses.field(default_factory=trio.Event)
    done: trio.Event = dataclasses.field(default_factory=trio.Event)


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        # New connections per source address: a burst of the rate, refilled at the rate.
        self._limiter = TokenBuckets(config.new_connections_per_ip_per_s, max_entries=config.rate_table_size)
        # Unfinished messages are dropped all the time; the heap pages they churned go back
        # to the system soon after (see relay._heap_trim).
        self.trimmer = Trimmer()
        self._budget = MessageBudget(config.max_buffered_bytes, config.message_deadline_s,
                                     on_release=self.trimmer.dropped, holder="the gateway")
        # Workers per source address (address_key), upgrading, waiting or spliced: an entry
        # lives while its count is above zero, so the table is bounded by the sessions.
        self._by_address: dict[str, int] = {}
        self._control: WebSocket | None = None
        # Every worker held, from the capacity check on, by pairing id (sans I/O: _pairing).
        self._pairings: Pairings[_Link] = Pairings(config.max_unpaired, config.max_sessions,
                                                   config.pairing_timeout_s)
        self._sessions = 0
        self._spliced = 0
        self._connections = 0
        # Plain ints on the relay path, read at scrape time: [to_hub, to_worker].
        self._relayed_bytes = [0, 0]
        self._relayed_messages = [0, 0]
        self._closed: dict[tuple[str, int], int] = {}
        self.hub_port: int | None = None  # the hub-facing port, once listening (config.hub_port)
        # Every refusal is counted here and logged one line each, rate-limited per reason.
        self.refusals = RefusalLog(log)

    @property
    def _admitting(self) -> int:
        """Workers between the capacity check and their upgrade's end."""
        return self._pairings.admitting

    @property
    def _pending(self) -> dict[str, Pairing[_Link]]:
        """The upgraded workers' pairings (waiting, spliced or being refused)."""
        return self._pairings.live()

    def statistics(self) -> GatewayStats:
        return GatewayStats(
            connections=self._connections,
            hub_connected=self._control is not None,
            unpaired=self._pairings.unpaired,
            sessions=self._sessions,
            refused=self._refusals(),
            relayed_bytes=sum(self._relayed_bytes),
            buffered_bytes=self._budget.statistics().buffered,
            sessions_by_address=dict(self._by_address),
            sessions_spliced=self._spliced,
            relayed_bytes_by_direction=dict(zip(_DIRECTIONS, self._relayed_bytes)),
            relayed_messages_by_direction=dict(zip(_DIRECTIONS, self._relayed_messages)),
            sessions_closed=dict(self._closed),
        )

    def _refusals(self) -> dict[str, int]:
        """Refusals by reason, with the connections the message budget closed."""
        out = self.refusals.counts()
        budget = self._budget.statistics()
        for why, n in (("buffer_full", budget.refused_buffer), ("message_deadline", budget.refused_deadline)):
            if n:
                out[why] = n
        return out

    def _refuse(self, why: str, *, warn: bool = False, **fields: object) -> None:
        """Count a refused connection under ``why`` and log it (rate-limited; at warning
        level with ``warn``)."""
        self.refusals.refused(why, warn=warn, **fields)

    def _release_address(self, key: str) -> None:
        left = self._by_address[key] - 1
        if left:
            self._by_address[key] = left
        else:
            del self._by_address[key]

    def _authorized(self, req: HttpRequest) -> bool:
        got = (req.header("authorization") or "").encode()
        want = f"Bearer {self.config.hub_token}".encode()
        return bool(self.config.hub_token) and hmac.compare_digest(got, want)

    async def handle_hub_side(self, stream: trio.SocketStream) -> None:
        """A connection to this process's own hub-facing port: hub paths always allowed."""
        await self.handle(stream, hub_paths=True)

    async def handle(self, stream: trio.SocketStream, *, hub_paths: bool | None = None) -> None:
        """Serve one connection; ``hub_paths`` (default: unless the public port is shared)
        whether hub paths are served on it."""
        if hub_paths is None:
            hub_paths = not self.config.shared_port
        try:
            peer = stream.socket.getpeername()
            remote = f"{peer[0]}:{peer[1]}"
            ip = peer[0]
        except OSError:
            return
        if not self._limiter.allow(address_key(ip)):
            self._refuse("rate", remote=remote)
            await stream.aclose()
            return
        if self._connections >= self.config.max_connections:
            self._refuse("connections", remote=remote)
            await stream.aclose()
            return
        self._connections += 1
        try:
            await self._handle(stream, remote, hub_paths=hub_paths)
        except Exception:  # one connection's failure must never stop the gateway
            self._refuse("internal_error", remote=remote)
            log.exception("connection handler failed", remote=remote)
        finally:
            self._connections -= 1
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _handle(self, raw: trio.SocketStream, remote: str, *, hub_paths: bool = True) -> None:
        cfg = self.config
        stream: trio.abc.Stream = raw
        try:
            with trio.fail_after(cfg.handshake_timeout_s):
                if cfg.ssl_context is not None:
                    tls = TLSStream(raw, cfg.ssl_context, server_side=True)
                    await tls.do_handshake()
                    stream = tls
                try:
                    req = await read_request(stream)
                    ws = await self._route(stream, req, remote, hub_paths=hub_paths)
                except HttpError as exc:  # nothing was sent yet: answer it if anyone listens
                    refusal = http_error_refusal(exc)
                    if refusal is not None:
                        await send_response(stream, refusal.status, refusal.message + "\n",
                                            headers=list(refusal.headers))
                    self._refuse(exc.reason, remote=remote, status=exc.status, detail=str(exc))
                    return
        except trio.TooSlowError:
            self._refuse("handshake_timeout", remote=remote,
                         detail=f"no request within {cfg.handshake_timeout_s:g} s")
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError) as exc:
            self._refuse("bad_handshake", remote=remote, detail=f"{type(exc).__name__}: {exc}")
            return
        if ws is None:
            return
        kind, sock, extra = ws
        try:
            if kind == "worker":
                await self._serve_worker(sock, remote, extra[1])
            elif kind == "control":
                await self._serve_control(sock)
            else:
                await self._serve_data(sock, extra)
        except WsClosed:
            pass
        finally:
            sock.forget_partial()  # its bytes go back to the budget however it ended
            if kind == "worker":
                self._pairings.leave(extra[1])  # already left, unless _serve_worker never ran
                self._release_address(extra[0])

    async def _route(self, stream: trio.abc.Stream, req: HttpRequest, remote: str,  # type: ignore[no-untyped-def]
                     *, hub_paths: bool = True):
        cfg = self.config

        async def refuse(why: str, status: int, body: str, *, headers: tuple[tuple[str, str], ...] = (),
                         hint: str | None = None) -> None:
            """Count the refusal under ``why``, log it and answer with a plain HTTP response.
            With ``hint`` (what the operator should check) the log line is a warning."""
            extra = {"hint": hint} if hint else {}
            self._refuse(why, warn=hint is not None, remote=remote, status=status, path=req.path[:200],
                         detail=body.strip(), **extra)
            await send_response(stream, status, body, headers=list(headers))

        async def refuse_as(refusal: Refusal) -> None:
            await refuse(refusal.reason, refusal.status, refusal.message + "\n", headers=refusal.headers)

        async def ws(sub: str) -> WebSocket:
            return await accept_websocket(stream, req, subprotocol=sub, max_message_bytes=cfg.max_message_bytes,
                                          keepalive_s=cfg.keepalive_s, idle_timeout_s=cfg.idle_timeout_s,
                                          budget=self._budget)

        path = req.path
        if path == HEALTH_PATH:
            if req.method not in ("GET", "HEAD"):
                await send_response(stream, 405, "use GET\n")
                return None
            await send_response(stream, 200, "ok\n" if self._control is not None else "ok (no hub connected)\n")
            return None
        if path == WORKER_PATH:
            if (bad := upgrade_refusal(req)) is not None:
                return await refuse_as(bad)
            subprotocol = choose_subprotocol(req.subprotocols)
            if subprotocol is None:
                return await refuse("subprotocol", 400, "the tunnel needs the WebSocket subprotocol "
                                    f"{' or '.join(TUNNEL_SUBPROTOCOLS)}\n")
            if self._control is None:
                return await refuse("no_hub", 503, "no hub is connected to this gateway; retry later\n",
                                    headers=(("retry-after", "5"),))
            if not self._pairings.has_room():
                return await refuse("capacity", 503, "gateway at capacity; retry later\n", headers=(("retry-after", "5"),))
            source = address_key(remote_host(remote))
            if self._by_address.get(source, 0) >= cfg.max_sessions_per_address:
                return await refuse("address_sessions", 429, f"this address ({source}) already holds "
                                    f"{cfg.max_sessions_per_address} sessions, the most one address may; "
                                    "retry when one ends\n", headers=(("retry-after", "5"),))
            self._by_address[source] = self._by_address.get(source, 0) + 1
            pid = self._pairings.admit()  # its place, held (ADMITTING) while it upgrades
            try:
                sock = await ws(subprotocol)
            except BaseException:
                self._release_address(source)
                self._pairings.upgrade_failed(pid)
                raise
            return "worker", sock, (source, pid)
        if path == HUB_CONTROL_PATH or path.startswith(HUB_DATA_PREFIX):
            if not hub_paths:
                # Another process of this gateway may hold the pairing: a hub must reach each
                # process at its own address, or its data connections would miss their worker.
                return await refuse("hub_port", 421, "this gateway runs several processes sharing this port: "
                                    "hubs connect to each process's own --hub-listen address (one --gateway "
                                    "each)\n", hint="a hub dialled the shared public port of a gateway run with "
                                    "--processes: give the hub one --gateway per process, at the --hub-listen ports")
            if not self._authorized(req):
                # A hub with the wrong token retries nothing (it stops), but its operator may not
                # see why: say it here too, where the gateway's operator looks.
                return await refuse("hub_token", 401, "hub paths need the hub token (Authorization: Bearer ...)\n",
                                    headers=(("www-authenticate", "Bearer"),),
                                    hint="a hub presented no token or the wrong one: its --gateway-token-file "
                                         "must hold the token in this gateway's --hub-token-file")
            if (bad := upgrade_refusal(req)) is not None:
                return await refuse_as(bad)
            if path == HUB_CONTROL_PATH:
                return "control", await ws(GATEWAY_SUBPROTOCOL), None
            pid = path[len(HUB_DATA_PREFIX):]
            if not self._pairings.can_take(pid):
                return await refuse("unknown_pairing", 404, "no worker waits under this pairing id\n")
            data_sub = choose_subprotocol(req.subprotocols)
            if data_sub is None:
                return await refuse("subprotocol", 400, "the data path needs the WebSocket subprotocol "
                                    f"{' or '.join(TUNNEL_SUBPROTOCOLS)}\n")
            return "data", await ws(data_sub), pid
        return await refuse("not_found", 404, "not found\n")

    async def _serve_control(self, ws: WebSocket) -> None:
        old, self._control = self._control, ws
        if old is not None:
            await old.close(CloseCode.GOING_AWAY, "replaced by a newer hub connection")
        log.info("hub connected")
        try:
            while True:
                msg = await ws.receive_message()
                if msg != PING:
                    await ws.close(CloseCode.PROTOCOL_ERROR, "the control channel takes no messages from the hub")
                    return
        finally:
            if self._control is ws:
                self._control = None
                log.info("hub disconnected")

    async def _serve_worker(self, worker: WebSocket, remote: str, pid: str | None = None) -> None:
        """Announce the upgraded ``worker`` (admitted under ``pid``; None: admit it now) to
        the hub, wait for a hub data connection to take it, and splice the two."""
        pairings = self._pairings
        if pid is None:
            pid = pairings.admit()
        link = _Link(worker)
        deadline = pairings.upgraded(pid, remote, link, now=trio.current_time())
        try:
            control = self._control
            if control is None:
                verdict = pairings.refuse(pid, "no hub")
                await worker.close(verdict.close_code, verdict.reason)
                return
            try:
                await control.send_message(encode_pair(PairRequest(pid, remote)))
            except WsClosed:
                verdict = pairings.refuse(pid, "hub gone")
                await worker.close(verdict.close_code, verdict.reason)
                return
            with trio.move_on_at(deadline):
                await link.paired.wait()
            late = pairings.settle(pid, now=trio.current_time())
            if late is not None:
                if late.refusal:
                    self._refuse(late.refusal, remote=remote)
                await worker.close(late.close_code, late.reason)
                return
            assert link.hub_ws is not None
            self._sessions += 1
            self._spliced += 1
            try:
                await self._splice(worker, link.hub_ws)
            finally:
                self._sessions -= 1
        finally:
            pairings.leave(pid)
            link.done.set()

    async def _serve_data(self, hub_ws: WebSocket, pid: str) -> None:
        try:
            link = self._pairings.take(pid)
        except RemoteProtocolError as exc:  # unknown, or taken or refused since the route's check
            await hub_ws.close(exc.close_code, exc.reason)
            return
        link.hub_ws = hub_ws
        link.paired.set()
        await link.done.wait()

    async def _splice(self, a: WebSocket, b: WebSocket) -> None:
        """Relay messages, pings and pongs both ways (``a`` the worker, ``b`` the hub); when
        one side closes, close the other with its code."""
        relayed_bytes, relayed_messages = self._relayed_bytes, self._relayed_messages
        ended: list[tuple[str, int]] = []  # (who closed first, the code it closed with)

        async def pump(src: WebSocket, dst: WebSocket, cancel: trio.CancelScope, way: int) -> None:
            try:
                while True:
                    msg = await src.receive_held()
                    if isinstance(msg, Held):  # binary, sent on from where it was received
                        await dst.send_held(msg)
                        relayed_bytes[way] += len(msg)
                    elif isinstance(msg, str):
                        await dst.send_message(msg)
                        # bytes, as the name says: a text message's length is in characters
                        relayed_bytes[way] += len(msg.encode())
                    else:
                        await dst.send_control(msg)  # a ping or pong: the ends test each other
                        continue
                    relayed_messages[way] += 1
            except WsClosed as closed:
                if not ended:
                    ended.append((_SIDES[way], closed.code))
                code = closed.code if closed.code not in (1005, 1006, 1015) else CloseCode.GOING_AWAY
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await dst.close(code, closed.reason or "peer went away")
                    await src.close(code, closed.reason)
            cancel.cancel()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, a, b, nursery.cancel_scope, 0)
                nursery.start_soon(pump, b, a, nursery.cancel_scope, 1)
        finally:
            key = ended[0] if ended else ("gateway", int(CloseCode.GOING_AWAY))
            self._closed[key] = self._closed.get(key, 0) + 1


def _inherited_listener(fd: int) -> trio.SocketListener:
    """A listener on a listening socket handed down by the parent process (``--processes``)."""
    import socket as _socket

    return trio.SocketListener(trio.socket.from_stdlib_socket(_socket.socket(fileno=fd)))


async def serve_gateway(config: GatewayConfig, *, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
    """Listen on ``config.host:port`` (or the inherited ``listen_fd``) and, with ``hub_port``
    (or ``hub_fd``), on ``hub_host:hub_port`` for hubs, until cancelled;
    ``task_status.started((port, gateway))``, the hub-facing port in ``gateway.hub_port``."""
    gateway = Gateway(config)
    if config.listen_fd is not None:
        listeners = [_inherited_listener(config.listen_fd)]
    else:
        listeners = await trio.open_tcp_listeners(config.port, host=config.host)
    port = listeners[0].socket.getsockname()[1]
    hub_listeners = []
    if config.hub_fd is not None:
        hub_listeners = [_inherited_listener(config.hub_fd)]
    elif config.hub_port is not None:
        hub_listeners = await trio.open_tcp_listeners(config.hub_port, host=config.hub_host or config.host)
    if hub_listeners:
        gateway.hub_port = hub_listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gateway.refusals.run)
        nursery.start_soon(gateway.trimmer.run)
        await nursery.start(trio.serve_listeners, gateway.handle, listeners)
        if hub_listeners:
            await nursery.start(trio.serve_listeners, gateway.handle_hub_side, hub_listeners)
        task_status.started((port, gateway))
