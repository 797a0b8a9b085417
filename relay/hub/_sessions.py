"""The LAN hub: accepts worker WebSockets, runs the session handshake, and makes each live
session reachable by the backbone as a gRPC target (a per-session TCP listener on the hub's
gRPC host) whose bytes it splices into that worker's tunnel. Serves SessionService.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import secrets
import ssl
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import trio

from kvasir_rpc import (
    MIN_TOKEN_CHARS,
    CloseCode,
    HelloInfo,
    HttpError,
    HttpRequest,
    HubHandshake,
    MessageBudget,
    ModelShape,
    ReadBuffer,
    RemoteProtocolError,
    SealedHeartbeat,
    TokenError,
    TunnelCipher,
    Wallet,
    WebSocket,
    WsClosed,
    accept_websocket,
    address_key,
    check_bearer,
    get_logger,
    keepalive,
    leaf_exception,
    receive_message,
    remote_host,
    send_response,
    send_whole,
    session_pb2,
    session_pb2_grpc,
    write_parts,
)
from kvasir_rpc.protocol import (
    AEAD_NAMES,
    CLOSE_TIMEOUT_S,
    HUB_HANDSHAKE_TIMEOUT_S,
    KEEPALIVE_S,
    KEEPALIVE_TIMEOUT_S,
    MAX_HELLO_BYTES,
    MAX_MESSAGE_BYTES,
    READ_BYTES,
    TUNNEL_SUBPROTOCOLS,
    choose_subprotocol,
)
from relay._heap_trim import Trimmer
from relay._intake import Refusal, UpgradeIntake
from relay._refusals import RefusalLog
from relay.hub._admission import SessionRate, Standing, WalletHistory, standing_of
from relay.hub._plan import pick_mover, plan_slice
from relay.hub._registry import SessionRegistry
from relay.hub._splice import Ended, Forward, Released, Splices
from relay.hub._stream_limits import StreamLimits, StreamLimitsInterceptor
from relay.hub._target_gate import Admitted, Refused, TargetGate, Verdict
from relay.hub._work_desk import DeskError, WorkDesk

__all__ = ["HubConfig", "SessionServicer", "StreamLimits", "create_session_server", "serve_hub"]

log = get_logger("relay.hub")

# How long a refused target connection may stay open for its caller to read the answer.
REFUSED_LINGER_S = 5.0
# The permanent refusals a worker of the first close codes knew as 4008 (it retries any code
# but 4008): sent as 4008 to a wallet refused so again within FIRST_TABLE_MEMORY_S (such a
# worker redials within its backoff, at most 45 s), remembered for this many wallets at most.
FIRST_TABLE_REFUSED = frozenset((CloseCode.QUARANTINED, CloseCode.OUTSIDE_MODEL, CloseCode.E2E_MISMATCH))
FIRST_TABLE_MEMORY_S = 120.0
FIRST_TABLE_WALLETS = 4096


@dataclasses.dataclass(frozen=True)
class HubConfig:
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    grpc_host: str = "127.0.0.1"
    handshake_timeout_s: float = HUB_HANDSHAKE_TIMEOUT_S
    # How long a worker may take to acknowledge "close" before the session is dropped.
    close_timeout_s: float = CLOSE_TIMEOUT_S
    # Check each worker this often; a worker that does not answer within the timeout is gone
    # (frozen, or its network path silently broke) and its session is dropped (1001). On an
    # encrypted session the check is a sealed heartbeat, which no relay can answer for it;
    # otherwise the WebSocket's own keepalive (a ping once the worker is silent this long,
    # 1001 when nothing comes within the timeout after).
    keepalive_s: float = KEEPALIVE_S
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S
    # Public gateways to keep a control connection to (wss://HOST:PORT; several hosts, or each
    # process of a gateway run with --processes): one each, each with its own backoff; the
    # same hub token and TLS context for all.
    gateway_urls: tuple[str, ...] = ()
    gateway_token: str = ""
    gateway_ssl: ssl.SSLContext | None = None
    # The secret shared with the backbone (kvasir_rpc._access): a session's target is spliced
    # only for a connection whose first request carries target_key(token, session id).
    backbone_token: str = ""
    # A connection to a session's target has this long to present its key; at most this many
    # may be presenting at once per session (more are closed at once). Neither reaches the worker.
    target_auth_timeout_s: float = 10.0
    max_unauthenticated_targets: int = 8
    # The most backbone connections one worker's tunnel carries at once (a multiplexed tunnel,
    # for workers that offer one: docs/PROTOCOL.md "Multiplexed tunnel"); below 2, one at a
    # time for every worker. A connection past them is answered RESOURCE_EXHAUSTED, saying so.
    tunnel_channels: int = 8
    # How often the hub looks for a planned worker (--experts auto) to move to experts no one
    # holds (0: never), and how long a session is left where it is first.
    move_check_s: float = 30.0
    move_min_age_s: float = 60.0
    # The model served: a hello announcing a layer or expert outside it is refused (4102).
    # None: only the protocol's bounds apply (MAX_LAYERS x MAX_EXPERTS_PER_LAYER).
    model_shape: ModelShape | None = None
    # Live sessions one wallet, and one source address (IPv4 address, IPv6 /64; through a
    # gateway the worker's address it announces), may hold; more are refused (4202, 4203).
    max_sessions_per_wallet: int = 4
    max_sessions_per_address: int = 32
    # End-to-end encryption of hub <-> worker tunnels (kvasir_rpc.protocol.E2E_HUB_MODES):
    # "auto" seals every session that comes through a gateway and a direct one whose worker
    # requires it; "on" every session; "off" none (a worker that requires it is refused, 4103).
    e2e: str = "auto"
    # Live sessions in all (direct and through a gateway): more are refused, with HTTP 503
    # at the intake when it is already full, else 4204 after the hello.
    max_sessions: int = 1024
    # Direct connections upgraded (or being upgraded) whose hello is not verified yet; each
    # may hold up to MAX_HELLO_BYTES. More get HTTP 503 at the intake.
    max_pending: int = 64
    # Connections whose HTTP request head is being read; one more closes the oldest.
    max_screening: int = 256
    # Bytes of unfinished messages on direct connections, in all (close 4208), and how long
    # one may stay unfinished (close 4209), as at the gateway.
    max_buffered_bytes: int = 256 << 20
    message_deadline_s: float = 30.0


class SessionServicer(session_pb2_grpc.SessionServiceServicer):
    """SessionService. ReportWork and Quarantine are the backbone's: they need its token
    (``authorization: Bearer``) and go to the ``WorkDesk``; without a desk they answer
    UNIMPLEMENTED."""

    def __init__(self, registry: SessionRegistry, *, token: str = "", desk: WorkDesk | None = None) -> None:
        self._registry = registry
        self._token = token
        self._desk = desk

    def _backbone_only(self, context: grpc.ServicerContext, what: str) -> WorkDesk:
        if self._desk is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, f"this hub keeps no work records; {what} is off")
        if not self._token or not check_bearer(context.invocation_metadata(), self._token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"{what} is the backbone's: send 'authorization: Bearer <token>' with the token in the "
                          "hub's --backbone-token-file")
        assert self._desk is not None
        return self._desk

    def _at_desk(self, context: grpc.ServicerContext, what: str, call):  # type: ignore[no-untyped-def]
        desk = self._backbone_only(context, what)
        try:
            return call(desk)
        except DeskError as exc:
            context.abort(exc.code, exc.message)

    def ReportWork(self, request, context):  # type: ignore[no-untyped-def]
        return self._at_desk(context, "ReportWork", lambda desk: desk.report(request))

    def Quarantine(self, request, context):  # type: ignore[no-untyped-def]
        return self._at_desk(context, "Quarantine", lambda desk: desk.quarantine(request))

    def ListSessions(self, request, context):  # type: ignore[no-untyped-def]
        return session_pb2.ListSessionsResponse(sessions=[s.to_proto() for s in self._registry.statistics()])

    def WatchSessions(self, request, context):  # type: ignore[no-untyped-def]
        q = self._registry.watch()
        try:
            while context.is_active():
                try:
                    event = q.get(timeout=0.5)
                except Exception:  # queue.Empty: look at is_active() again
                    continue
                if event is None:
                    return
                yield session_pb2.WatchSessionsResponse(event=event.to_proto())
        finally:
            self._registry.unwatch(q)


def create_session_server(registry: SessionRegistry, address: str, *, backbone_token: str,
                          limits: StreamLimits = StreamLimits(), desk: WorkDesk | None = None) -> tuple[grpc.Server, int]:
    """A gRPC server with SessionService, reflection and health, bound to ``address``.

    Long-lived streams are admitted within ``limits`` (WatchSessions presenting
    ``backbone_token`` in its own allowance), so ListSessions always finds a thread.
    ReportWork and Quarantine go to ``desk`` for callers presenting the token. What a
    handler lets out is answered by NeverUnknown, first, so it also sees the limits' own."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from kvasir_rpc import NO_PORT_SHARING, NeverUnknown, enable_reflection

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=limits.threads, thread_name_prefix="session-svc"),
                         interceptors=[NeverUnknown(), StreamLimitsInterceptor(limits, backbone_token)],
                         options=[NO_PORT_SHARING])
    session_pb2_grpc.add_SessionServiceServicer_to_server(
        SessionServicer(registry, token=backbone_token, desk=desk), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("kvasir.v1.SessionService", health_pb2.HealthCheckResponse.SERVING)
    enable_reflection(server, [session_pb2.DESCRIPTOR.services_by_name["SessionService"].full_name,
                               health.SERVICE_NAME])
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind the hub's gRPC address {address}")
    server.start()
    return server, port


@dataclasses.dataclass(eq=False)
class _Link:
    """What the session keeps with a channel a backbone connection claimed."""

    stream: trio.abc.Stream
    scope: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)  # cancelled: the splice ends
    released: trio.Event = dataclasses.field(default_factory=trio.Event)  # set on the worker's "closed"


class _Session:
    """One verified worker: its tunnel, its backbone-facing listener, its splices.

    Which backbone connection rides which channel, and what each message from the worker asks
    for, is ``Splices``' (relay/hub/_splice.py, no I/O); this class moves the bytes. One task
    reads the WebSocket for the session's life (``_read``: a worker that leaves while no
    backbone is connected is noticed at once, sealed heartbeats are answered): it writes each
    message's data to its backbone connection before reading the next (a slow backbone slows
    the reader, and so the worker, with no task switch per message), ends a splice on the
    worker's "eof" and lets it go on its "closed". A plain tunnel is a tunnel of one channel.
    """

    def __init__(self, hub: _Hub, ws: WebSocket, session_id: str,
                 cipher: TunnelCipher | None = None, channels: int = 0) -> None:
        self.hub = hub
        self.ws = ws
        # Seals and opens every tunnel message of an encrypted session (None: in clear).
        self.cipher = cipher
        # The encrypted session's liveness check (None: the WebSocket's own keepalive).
        self.heartbeat = SealedHeartbeat(ws, cipher) if cipher is not None else None
        self.session_id = session_id
        self.log = log.bind(session_id=session_id)
        # Below 2 channels, the plain tunnel: one backbone connection at a time.
        self.splices: Splices[_Link] = Splices(channels, hub.config.close_timeout_s)
        # Connections still presenting their key, oldest first (the scope ends the gate).
        self._unauthenticated: collections.deque[trio.CancelScope] = collections.deque()

    @property
    def channels(self) -> int:
        """Backbone connections the tunnel carries at once."""
        return len(self.splices)

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
        listeners = await trio.open_tcp_listeners(0, host=self.hub.config.grpc_host)
        listener = listeners[0]
        port = listener.socket.getsockname()[1]
        async with listener, trio.open_nursery() as nursery:
            nursery.start_soon(self._read)
            # Each round trip goes to the registry: the status page and metrics show it.
            on_rtt = functools.partial(self.hub.registry.set_rtt, self.session_id)
            if self.heartbeat is not None:
                nursery.start_soon(functools.partial(
                    keepalive, self.ws, self.hub.config.keepalive_s, self.hub.config.keepalive_timeout_s,
                    self.heartbeat, on_rtt=on_rtt))
            else:
                self.ws.on_rtt = on_rtt
            task_status.started(f"{self.hub.config.grpc_host}:{port}")
            while True:
                stream = await listener.accept()
                if len(self._unauthenticated) >= self.hub.config.max_unauthenticated_targets:
                    # Drop the oldest, not the newcomer: strangers holding every slot would
                    # otherwise keep out the backbone, whose key takes one round trip to read.
                    self._unauthenticated.popleft().cancel()
                scope = trio.CancelScope(deadline=trio.current_time() + self.hub.config.target_auth_timeout_s)
                self._unauthenticated.append(scope)
                nursery.start_soon(self._admit, stream, scope)

    async def _admit(self, stream: trio.SocketStream, scope: trio.CancelScope) -> None:
        """Gate one connection to the target; splice it only if its first request has the key.

        ``scope`` bounds the gate (its deadline; run() cancels it to make room). A refused,
        malformed, silent or evicted connection is closed here: the worker never hears of it
        ("open" is sent only for an admitted one) and nothing is counted."""
        config = self.hub.config
        gate = TargetGate(config.backbone_token, self.session_id)
        verdict: Verdict | None = None
        why = ""
        try:
            with scope:
                await stream.send_all(gate.server_preface())
                while verdict is None:
                    data = await stream.receive_some(gate.max_bytes)
                    if not data:
                        why = "closed before its first request"
                        break
                    verdict = gate.receive_data(data)
                if isinstance(verdict, Refused):
                    why = verdict.reason
                    await self._answer(stream, verdict.reply, gate.max_bytes)
        except RemoteProtocolError as exc:
            verdict, why = None, exc.reason
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            verdict, why = None, "the connection broke before its first request"
        finally:
            if scope in self._unauthenticated:
                self._unauthenticated.remove(scope)
        if scope.cancelled_caught and not why:
            why = (f"no first request within {config.target_auth_timeout_s:g} s"
                   if trio.current_time() >= scope.deadline else
                   f"dropped for a newer connection ({config.max_unauthenticated_targets} were presenting a key)")
        if not isinstance(verdict, Admitted):
            self.log.info("target connection refused", reason=why, state=gate.state)
            await stream.aclose()
            return
        link = _Link(stream)
        claimed = self.splices.claim(link)
        if claimed is None:
            # Said to the caller, not only closed: its log and metrics name why it got no time.
            why = (f"worker session {self.session_id} carries {self.channels} backbone connection"
                   f"{'s' if self.channels > 1 else ''} already (all its tunnel's channels); retry later")
            self.log.info("target connection refused: every channel in use", channels=self.channels)
            self.hub.registry.note_connection(self.session_id, refused_busy=1)
            with trio.move_on_after(REFUSED_LINGER_S):  # its answer's send too is bounded here
                try:
                    await self._answer(stream, gate.busy(why), gate.max_bytes)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            await stream.aclose()
            return
        channel, opening = claimed
        self.hub.registry.note_connection(self.session_id, opened=1)
        try:
            await self._splice(channel, link, opening, verdict.forward)
        finally:
            self.hub.registry.note_connection(self.session_id, opened=-1)

    @staticmethod
    async def _answer(stream: trio.SocketStream, reply: bytes, max_bytes: int) -> None:
        """Send a connection the hub turns away its answer, then let the caller read it and hang
        up (closing at once can reset the connection before it does); one that stays is cut off
        after REFUSED_LINGER_S."""
        await stream.send_all(reply)
        with trio.move_on_after(REFUSED_LINGER_S):
            while await stream.receive_some(max_bytes):
                pass

    async def _read(self) -> None:
        """Read the tunnel for the session's life and do what each message asks (``Splices``):
        anything out of turn raises RemoteProtocolError (the session ends: 1002)."""
        splices = self.splices
        reg = self.hub.registry
        sid = self.session_id
        while True:
            action = splices.from_worker(await receive_message(self.ws, self.cipher, self.heartbeat))
            if isinstance(action, Forward):
                reg.count_bytes(sid, from_worker=len(action.data))
                try:
                    # At once, while the view of the WebSocket's buffer is valid (no task
                    # switch unless the backbone's socket is full).
                    await write_parts(action.link.stream, (action.data,))
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    # The backbone's side broke (or its splice closed it meanwhile): the splice ends.
                    splices.broke(action.channel, f"backbone connection broke ({exc!r})")
                    action.link.scope.cancel()
            elif isinstance(action, Ended):
                action.link.scope.cancel()
            elif isinstance(action, Released):
                action.link.released.set()

    async def _splice(self, channel: int, link: _Link, opening: str, first: bytes) -> None:
        """Bridge one backbone connection on ``channel`` (claimed, ``opening`` not yet sent) until
        either side ends; ``first``: the bytes the gate read from the backbone, sent before any
        others. Then close the channel and wait for the worker's "closed" (by the deadline
        ``Splices`` sets; past it the session ends)."""
        splices = self.splices
        reg = self.hub.registry
        sid = self.session_id
        cipher = self.cipher
        stream = link.stream
        ended_by = "backbone"
        try:
            async with stream:
                with link.scope:
                    await send_whole(self.ws, opening, cipher=cipher)
                    await send_whole(self.ws, splices.to_worker(channel, first), cipher=cipher)
                    reg.count_bytes(sid, to_worker=len(first))
                    # Each read is sent on before the next (send_whole returns once it is out).
                    reads = ReadBuffer(max_bytes=READ_BYTES)
                    while True:
                        try:
                            data = await reads.receive(stream)
                        except trio.BrokenResourceError as exc:
                            ended_by, data = f"backbone connection broke ({exc!r})", memoryview(b"")
                        if not data:
                            break
                        await send_whole(self.ws, splices.to_worker(channel, data), cipher=cipher)
                        reg.count_bytes(sid, to_worker=len(data))
        finally:
            closing = splices.close(channel, now=trio.current_time(), ended_by=ended_by)
        await send_whole(self.ws, closing.message, cipher=cipher)
        with trio.fail_at(closing.deadline):
            await link.released.wait()
        self.log.debug("backbone connection ended", ended_by=closing.ended_by, channel=channel)


# What the hub knows of a wallet's past (ContributionStore.wallet_history): called in a thread,
# since the store may be busy writing; it must not raise.
WalletLookup = Callable[[str], WalletHistory]


class _Hub:
    def __init__(self, config: HubConfig, key: Wallet, registry: SessionRegistry, *,
                 rate: SessionRate | None = None, history: WalletLookup | None = None) -> None:
        self.config = config
        self.key = key
        self.registry = registry
        # New sessions per address and in all (relay.hub._admission), priced by the wallet's
        # history; without one every wallet is new.
        self.rate = rate if rate is not None else SessionRate()
        self._history = history
        self._ids = itertools.count(1)
        # Sessions held per wallet and per address key, from the verified hello to the end
        # (counted on the trio thread only, so a check and its increment cannot interleave).
        self._per_wallet: collections.Counter[str] = collections.Counter()
        self._per_address: collections.Counter[str] = collections.Counter()
        self._sessions = 0
        # Direct connections handed on by the intake whose hello is not verified yet, by
        # remote (ip:port, unique among live connections), until verified or closed.
        self._pending: set[str] = set()
        self.trimmer = Trimmer()
        self.budget = MessageBudget(config.max_buffered_bytes, config.message_deadline_s,
                                    on_release=self.trimmer.dropped, holder="the hub")
        # Refused worker connections (malformed upgrades, wrong subprotocol): counted and
        # logged one line each, rate-limited per reason.
        self.refusals = RefusalLog(log)
        # Sessions that joined with the hub's plan (--experts auto): the ones it may ask to move.
        self.planned: set[str] = set()
        # (wallet, code) of the permanent refusals a worker of the first close codes knew as
        # 4008, by when they were last sent (see _first_table_code).
        self._permanent_sent: collections.OrderedDict[tuple[str, int], float] = collections.OrderedDict()

    def _hold(self, wallet: str, address: str) -> None:
        """Count one more session for ``wallet`` and ``address``, or raise RemoteProtocolError
        (4204, 4202 or 4203: the cap's name and value in the reason) when one is at its cap."""
        cfg = self.config
        if self._sessions >= cfg.max_sessions:
            raise RemoteProtocolError(f"the hub holds its most sessions ({cfg.max_sessions}); try again later",
                                      close_code=CloseCode.HUB_FULL)
        if self._per_wallet[wallet] >= cfg.max_sessions_per_wallet:
            raise RemoteProtocolError(f"too many sessions for this wallet (at most {cfg.max_sessions_per_wallet} "
                                      "per wallet on this hub)", close_code=CloseCode.WALLET_CAP)
        if self._per_address[address] >= cfg.max_sessions_per_address:
            raise RemoteProtocolError(f"too many sessions from this address (at most "
                                      f"{cfg.max_sessions_per_address} per address on this hub)",
                                      close_code=CloseCode.ADDRESS_CAP)
        self._per_wallet[wallet] += 1
        self._per_address[address] += 1
        self._sessions += 1

    def _release(self, wallet: str, address: str) -> None:
        self._sessions -= 1
        for counter, key in ((self._per_wallet, wallet), (self._per_address, address)):
            counter[key] -= 1
            if counter[key] <= 0:
                del counter[key]  # the tables hold only live keys

    def admit(self, request: HttpRequest, remote: str) -> Refusal | None:
        """The intake's capacity check for a well-formed upgrade (HTTP 503 when full)."""
        cfg = self.config
        if len(self._pending) >= cfg.max_pending:
            return Refusal("pending_full", 503, f"{cfg.max_pending} connections are already waiting for their "
                           "session on this hub; retry later", (("retry-after", "5"),))
        if self._sessions >= cfg.max_sessions:
            return Refusal("capacity", 503, f"the hub holds its most sessions ({cfg.max_sessions}); retry later",
                           (("retry-after", "5"),))
        return None

    def new_session_id(self) -> str:
        return f"s{next(self._ids)}-{secrets.token_hex(6)}"

    async def handle(self, stream: trio.abc.Stream, request: HttpRequest, remote: str) -> None:
        """A direct worker connection the intake admitted (``admit``, with no checkpoint since):
        answer its upgrade and serve it, counted as pending until its hello is verified. Before
        that it may send one message of at most MAX_HELLO_BYTES (more: close 1009); unfinished
        messages count in the hub's budget (4208) and have the message deadline (4209)."""
        self._pending.add(remote)
        try:
            async with stream:
                subprotocol = choose_subprotocol(request.subprotocols)
                if subprotocol is None:
                    message = f"the tunnel needs the WebSocket subprotocol {' or '.join(TUNNEL_SUBPROTOCOLS)}"
                    self.refusals.refused("subprotocol", remote=remote, status=400, detail=message)
                    await send_response(stream, 400, message + "\n")
                    return
                cfg = self.config
                try:
                    ws = await accept_websocket(stream, request, subprotocol=subprotocol,
                                                max_message_bytes=MAX_HELLO_BYTES, keepalive_s=cfg.keepalive_s,
                                                idle_timeout_s=cfg.keepalive_s + cfg.keepalive_timeout_s,
                                                budget=self.budget)
                except HttpError as exc:
                    self.refusals.refused(exc.reason, remote=remote, status=400, detail=str(exc))
                    await send_response(stream, 400, f"{exc}\n")
                    return
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # gone before our 101: nothing to answer

                def verified() -> None:
                    self._pending.discard(remote)
                    ws.max_message_bytes = MAX_MESSAGE_BYTES

                try:
                    await self.serve_connection(ws, remote, on_verified=verified)
                except Exception:  # one session's failure must never stop the hub
                    log.exception("session handler failed", remote=remote)
                    with trio.move_on_after(2):
                        await ws.close(CloseCode.INTERNAL_ERROR, "hub error")
        finally:
            self._pending.discard(remote)

    async def serve_connection(self, ws: WebSocket, remote: str, *, via_gateway: bool = False,
                               on_verified: Callable[[], None] | None = None) -> None:
        """Run the handshake and then the session on one worker WebSocket, direct or (with
        ``via_gateway``, which decides the end-to-end encryption under --e2e auto) through a
        gateway; ``on_verified`` is called once the hello is verified and counted, before the
        worker hears so."""
        held: list[tuple[str, str]] = []  # what _hold counted for this connection, released at its end
        try:
            await self._serve_connection(ws, remote, held, via_gateway, on_verified)
        finally:
            for wallet, address in held:
                self._release(wallet, address)
                if self.registry.banned_until(wallet) is not None:
                    # Quarantined while this session lived (a ban never precedes a session:
                    # a banned wallet is refused): its address pays for the liar too.
                    self.rate.penalize(address)

    async def _handshake(self, ws: WebSocket, remote: str, held: list[tuple[str, str]],
                         via_gateway: bool, on_verified: Callable[[], None] | None = None,
                         ) -> tuple[HelloInfo, str, TunnelCipher | None] | None:
        """The verified hello, the new session id and the session's cipher (None in clear), or
        None when the handshake was refused (the WebSocket is then closed with the refusal's
        code). A function of its own so that the hello's bytes (up to MAX_HELLO_BYTES) die
        with it, not live as long as the session."""
        hs = HubHandshake(self.key, shape=self.config.model_shape, e2e=self.config.e2e, via_gateway=via_gateway,
                          tunnel_channels=self.config.tunnel_channels)
        try:
            with trio.fail_after(self.config.handshake_timeout_s):
                await ws.send_message(hs.challenge())
                data = await ws.receive_message()
                if isinstance(data, str):
                    raise RemoteProtocolError("handshake messages are binary", close_code=CloseCode.PROTOCOL_ERROR)
                info = hs.receive_hello(data)
                until = self.registry.banned_until(info.wallet)
                if until is not None:
                    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(until / 1000))
                    raise RemoteProtocolError(f"wallet quarantined by this hub until {when}",
                                              close_code=CloseCode.QUARANTINED)
                standing = await self._standing(info.wallet)
                # Through a gateway, the worker's address the gateway reports (never the
                # gateway's own): the caps and the rate count one host's sessions together.
                address = address_key(remote_host(remote))
                holds_session = self._per_wallet[info.wallet] > 0
                self._hold(info.wallet, address)  # caps first: a session over one takes no tokens
                throttled = self.rate.admit(address, standing, holds_session=holds_session)
                if throttled is not None:
                    self._release(info.wallet, address)
                    # Counted and logged under a budget of lines: a churning attacker is refused
                    # many times a second.
                    self.refusals.refused(f"session_rate_{throttled.limit}", remote=remote, wallet=info.wallet,
                                          standing=standing.value, retry_in_s=round(throttled.wait_s, 1))
                    await ws.close(CloseCode.RATE_LIMITED, throttled.reason[:120])
                    return None
                held.append((info.wallet, address))
                if on_verified is not None:
                    on_verified()
                session_id = self.new_session_id()
                if info.expert_capacity:
                    await self._plan(ws, hs, info, session_id, remote)
                    return None
                await ws.send_message(hs.accept(session_id))
                return info, session_id, hs.cipher
        except trio.TooSlowError:
            log.info("handshake timed out", remote=remote)
            await ws.close(CloseCode.HANDSHAKE_TIMEOUT, "handshake timed out")
        except RemoteProtocolError as exc:
            code = self._first_table_code(hs.wallet, exc.close_code)
            log.info("handshake refused", remote=remote, reason=exc.reason, code=code)
            await ws.close(code, exc.reason[:120])
        except WsClosed as exc:
            self._refused_by_websocket(exc, remote, "hello_too_big" if exc.code == CloseCode.MESSAGE_TOO_BIG else None)
        return None

    def _refused_by_websocket(self, exc: WsClosed, remote: str, why: str | None = None) -> None:
        """Count and log (rate-limited) a connection this side's WebSocket ended for breaking
        a bound: a message over its size (1009; ``why``: the hello's), unfinished messages
        past the budget (4208) or past their deadline (4209). Nothing for any other end."""
        if not exc.local:
            return
        why = why or {CloseCode.MESSAGE_TOO_BIG: "message_too_big", CloseCode.BUFFERS_FULL: "buffer_full",
                      CloseCode.MESSAGE_TIMEOUT: "message_deadline"}.get(exc.code)
        if why is not None:
            self.refusals.refused(why, remote=remote, code=exc.code, detail=exc.reason)

    def _first_table_code(self, wallet: str | None, code: int) -> int:
        """The code to refuse ``wallet``'s hello with, for ``code``. A worker that knows only
        the first close codes stops on 4008 alone and retries any other: the refusals it knew
        as 4008 (quarantined, outside the model, encryption policies) go out with their own
        code the first time, and as 4008 when the same wallet is refused so again within
        FIRST_TABLE_MEMORY_S. A worker that knows the code never dials again unchanged, so
        only such a worker (or one that ignores the code) hears 4008; it stops one dial later."""
        if wallet is None or code not in FIRST_TABLE_REFUSED:
            return code
        now = time.monotonic()
        sent = self._permanent_sent.pop((wallet, code), None)
        self._permanent_sent[(wallet, code)] = now
        while len(self._permanent_sent) > FIRST_TABLE_WALLETS:
            self._permanent_sent.popitem(last=False)
        return CloseCode.REFUSED if sent is not None and now - sent < FIRST_TABLE_MEMORY_S else code

    async def move_workers(self) -> None:
        """Every ``config.move_check_s``: when the backbones route rows to experts no session
        holds, ask one planned worker whose every expert is held elsewhere too (and that has
        been up ``move_min_age_s``) to plan again (close 4010): it asks for a slice, gets the
        uncovered experts, and joins with them (``relay.hub._plan.pick_mover``)."""
        while True:
            await trio.sleep(self.config.move_check_s)
            now_ms = time.time_ns() // 1_000_000
            sessions = self.registry.statistics()
            movable = {s.session_id for s in sessions if s.session_id in self.planned
                       and now_ms - s.connected_since_unix_ms >= self.config.move_min_age_s * 1000}
            sid = pick_mover({s.session_id: dict(s.slices) for s in sessions}, movable,
                             self.registry.demand.snapshot())
            if sid is not None:
                log.info("asking a worker to move: the experts it holds are held elsewhere, others are needed",
                         session_id=sid)
                self.registry.kick(sid, "plan again: the swarm needs other experts", CloseCode.REPLAN)

    async def _plan(self, ws: WebSocket, hs: HubHandshake, info: HelloInfo, session_id: str,
                    remote: str) -> None:
        """Answer a planning hello (``--experts auto``): the slice this worker should hold, out of
        the experts its checkpoint has, given what the live sessions and the plans handed out
        recently hold and what the backbones route to (``relay.hub._plan``); then close (1000). The
        plan counts as held until the worker joins with it or the reservation's ttl passes."""
        held = [dict(s.slices) for s in self.registry.statistics()]
        suggested = plan_slice(info.slices, info.expert_capacity, held=held, demand=self.registry.demand.snapshot(),
                               salt=info.wallet, reserved=self.registry.reservations.live())
        self.registry.reservations.add(info.wallet, suggested)
        await ws.send_message(hs.accept(session_id, suggested))
        log.info("slice suggested", remote=remote, wallet=info.wallet, capacity=info.expert_capacity,
                 experts=sum(len(v) for v in suggested.values()), layers=len(suggested))
        with trio.move_on_after(2):
            await ws.close(1000, "slice suggested: load it and dial again")

    async def _standing(self, wallet: str) -> Standing:
        """What ``wallet`` costs to admit, from what this hub remembers of it."""
        if self._history is None:
            return Standing.NEW
        history = await trio.to_thread.run_sync(self._history, wallet)
        return standing_of(history, time.time_ns() // 1_000_000)

    async def _serve_connection(self, ws: WebSocket, remote: str, held: list[tuple[str, str]],
                                via_gateway: bool, on_verified: Callable[[], None] | None = None) -> None:
        verified = await self._handshake(ws, remote, held, via_gateway, on_verified)
        if verified is None:
            return
        info, session_id, cipher = verified
        session = _Session(self, ws, session_id, cipher, channels=info.tunnel_channels)
        slog = log.bind(session_id=session_id, wallet=info.wallet)
        kicked: list[tuple[str, int]] = []
        trio_token = trio.lowlevel.current_trio_token()
        ended = "error"  # what metrics count the end under (see the handlers and the finally)
        try:
            async with trio.open_nursery() as nursery:

                def kick(reason: str, code: int = CloseCode.POLICY_VIOLATION) -> None:
                    # Any thread: end the session, telling the worker why.
                    def on_loop() -> None:
                        kicked.append((reason, code))
                        nursery.cancel_scope.cancel()

                    trio_token.run_sync_soon(on_loop)

                target = await nursery.start(session.run)
                # Its plan, if it had one, turns from a reservation into a held slice in this one
                # step: a worker planned meanwhile counts it either way (never neither).
                if self.registry.add(session_id, info, target=target, remote=remote, kick=kick,
                                     encrypted=cipher is not None, via_gateway=via_gateway,
                                     aead=cipher.aead if cipher is not None else 0):
                    self.planned.add(session_id)
                slog.info("session open", target=target, device=info.device, layers=len(info.slices),
                          encrypted=cipher is not None, aead=AEAD_NAMES[cipher.aead] if cipher is not None else None)
        except* WsClosed as eg:
            closed = leaf_exception(eg)
            assert isinstance(closed, WsClosed)
            if not closed.local:
                ended = "worker_closed"
                slog.info("session closed by worker", code=closed.code, reason=closed.reason)
            elif closed.code == CloseCode.GOING_AWAY:  # the keepalive: nothing came for too long
                ended = "keepalive"
                slog.warning("session ended", reason=closed.reason)
            else:  # a bound of the WebSocket's (a message too big, unfinished too long)
                ended = "protocol_error"
                self._refused_by_websocket(closed, remote)
                slog.warning("session ended", reason=closed.reason, code=closed.code)
        except* RemoteProtocolError as eg:
            perr = leaf_exception(eg)
            assert isinstance(perr, RemoteProtocolError)
            ended = "keepalive" if perr.close_code == CloseCode.GOING_AWAY else "protocol_error"
            slog.warning("session ended", reason=perr.reason)
            with trio.move_on_after(2):  # the peer may be gone: do not wait on it
                await ws.close(perr.close_code, perr.reason[:120])
        except* trio.TooSlowError:
            ended = "close_timeout"
            slog.warning("worker did not acknowledge close in time")
            with trio.move_on_after(2):
                await ws.close(CloseCode.POLICY_VIOLATION, "close not acknowledged")
        finally:
            if kicked:
                ended = "kicked"
            elif ended == "error" and trio.current_effective_deadline() == float("-inf"):
                ended = "hub_stopped"  # cancelled from outside: the hub is stopping
            self.registry.remove(session_id, ended)
            self.planned.discard(session_id)
            slog.info("session removed")
        if kicked:
            slog.warning("session ended by the hub", reason=kicked[0][0], code=kicked[0][1])
            with trio.move_on_after(2):
                await ws.close(kicked[0][1], kicked[0][0][:120])


async def serve_hub(
    config: HubConfig,
    key: Wallet,
    registry: SessionRegistry,
    *,
    rate: SessionRate | None = None,
    history: WalletLookup | None = None,
    task_status=trio.TASK_STATUS_IGNORED,  # type: ignore[no-untyped-def]
) -> None:
    """Serve worker WebSockets until cancelled; ``task_status.started(port)``.

    New sessions are admitted within ``rate`` (default: ``SessionRate()``, its default
    limits), each priced by its wallet's ``history`` (called in a thread; default: every
    wallet is new). Raises TokenError when ``config.backbone_token`` is unusable (targets
    would admit anyone)."""
    if len(config.backbone_token) < MIN_TOKEN_CHARS:
        raise TokenError(f"the hub needs a backbone token of at least {MIN_TOKEN_CHARS} characters")
    hub = _Hub(config, key, registry, rate=rate, history=history)
    # The intake answers malformed upgrades itself and hands the rest to hub.handle.
    intake = UpgradeIntake(await trio.open_tcp_listeners(config.listen_port, host=config.listen_host),
                           hub.refusals, timeout_s=config.handshake_timeout_s, max_screening=config.max_screening,
                           admit=hub.admit, handle=hub.handle)
    async with trio.open_nursery() as nursery:
        await nursery.start(intake.serve)
        nursery.start_soon(hub.refusals.run)
        nursery.start_soon(hub.trimmer.run)
        if config.move_check_s > 0:
            nursery.start_soon(hub.move_workers)
        if config.gateway_urls:
            from relay.hub._gateway_link import GatewayLink

            for url in dict.fromkeys(config.gateway_urls):  # a URL given twice: one link
                link = GatewayLink(functools.partial(hub.serve_connection, via_gateway=True), url,
                                   config.gateway_token, ssl_context=config.gateway_ssl,
                                   keepalive_s=config.keepalive_s, keepalive_timeout_s=config.keepalive_timeout_s)
                hub.registry.gateway_links.append(link.state)
                await nursery.start(link.run)  # a refused token or certificate stops the hub here
        task_status.started(intake.port)
