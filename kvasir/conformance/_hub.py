"""The hub's side of a conformance run, the I/O: the ``ws://`` server the worker dials, the
session handshake, the reader of the tunnel, the local gRPC target spliced into it, and the end
of the session as a hub ends it. The steps (``_steps``) drive it and judge what comes.

Every message the worker sends is fed to the hub side of the sans-IO tunnel protocol
(``kvasir_rpc.protocol.HubTunnel``); the first violation fails the running step with the
protocol's reason, ends the session as a hub would, and skips the steps after it. The gRPC
in the tunnel is real: a generated-stub client on a local TCP listener whose bytes are
spliced into the tunnel, as the hub splices the backbone's.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import shlex
import subprocess
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from kvasir.conformance._results import FAIL, PASS, StepResult, _StepFailed

if TYPE_CHECKING:
    import grpc

    from kvasir_rpc import HelloInfo, HttpRequest, SealedHeartbeat, TunnelCipher, WebSocket

_MAX_CHANNEL_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class _Config:
    model: pathlib.Path
    host: str
    port: int
    worker_cmd: str | None
    worker_log: pathlib.Path
    timeout_s: float
    seed: int


class _HubSide:
    """The hub one worker WebSocket dials, for one run. ``fatal`` is set once the session is
    over (the worker broke the protocol, closed, or we closed it); later steps are skipped."""

    def __init__(self, cfg: _Config) -> None:
        from kvasir_rpc import Wallet
        from kvasir_rpc.protocol import HubTunnel

        self.cfg = cfg
        self.hub_key = Wallet.generate()
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.hello: HelloInfo | None = None
        self.ws: WebSocket | None = None
        self.cipher: TunnelCipher | None = None  # the worker's session is sealed end to end
        self.heartbeat: SealedHeartbeat | None = None  # and then its liveness is checked so
        self.tunnel = HubTunnel()
        self.fatal: str | None = None
        self.finishing = False
        self.dialled = trio.Event()
        self.done = trio.Event()
        self.upgrade: StepResult | None = None  # the upgrade step's result, once the worker dialled
        self.scope: trio.CancelScope | None = None  # the running session step's
        self.fatal_reported = False
        self.ended_at: str | None = None  # the step that failed with the session's end
        # The current spliced connection (one at a time, as the hub does).
        self.stream: trio.SocketStream | None = None
        self.target = ""
        self.opens = 0
        self.eofs = 0
        self.discarded = 0
        self.opened = trio.Event()
        self.first_data = trio.Event()
        self.closed = trio.Event()
        self._worker_eof = trio.Event()
        self.close_sent_at = 0.0

    def skipped(self) -> str:
        """The detail of a step not run because the session is over."""
        if self.ended_at is not None:
            return f"not run: the session ended in step {self.ended_at}"
        return f"not run: {self.fatal or 'stopped'}"

    # the WebSocket server, and the worker it serves

    async def serve(self, steps: Callable[[trio.Nursery], Awaitable[None]], say_url: Callable[[str], None]) -> None:
        """Serve the WebSocket, start the worker command if any, and run ``steps``."""
        cfg = self.cfg
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, self.handle, cfg.port, host=cfg.host))
            host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
            self.url = f"ws://{host}:{listeners[0].socket.getsockname()[1]}"
            say_url(self.url)
            if cfg.worker_cmd is not None:
                argv = [a.replace("{url}", self.url) for a in shlex.split(cfg.worker_cmd)]
                with open(cfg.worker_log, "wb") as log:
                    self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            try:
                await steps(nursery)
            finally:
                self.done.set()
                nursery.cancel_scope.cancel()

    async def handle(self, stream: trio.SocketStream) -> None:
        """One TCP connection: the worker's upgrade, answered as a hub would (the library's
        server WebSocket, with the hub's bounds and keepalive)."""
        from kvasir_rpc import HttpError, read_request
        from kvasir_rpc.protocol import HUB_HANDSHAKE_TIMEOUT_S

        async with stream:
            try:
                with trio.fail_after(HUB_HANDSHAKE_TIMEOUT_S):
                    request = await read_request(stream)
            except (HttpError, trio.TooSlowError, trio.BrokenResourceError):
                return  # not an upgrade at all: the upgrade step waits for one
            await self._upgrade(stream, request)

    async def _upgrade(self, stream: trio.SocketStream, request: HttpRequest) -> None:
        from kvasir_rpc import HttpError, accept_websocket, send_response
        from kvasir_rpc.protocol import (
            KEEPALIVE_S,
            KEEPALIVE_TIMEOUT_S,
            MAX_MESSAGE_BYTES,
            TUNNEL_SUBPROTOCOL,
            choose_subprotocol,
        )

        if self.dialled.is_set():
            await send_response(stream, 409, "this conformance check serves one session\n")
            return
        offered = request.subprotocols
        chosen = choose_subprotocol(offered)
        if chosen is None:
            await send_response(stream, 400, f"the tunnel needs the WebSocket subprotocol {TUNNEL_SUBPROTOCOL}\n")
            self.upgrade = StepResult("upgrade", FAIL, (
                f"the worker offered subprotocols {offered or '(none)'}; it must offer {TUNNEL_SUBPROTOCOL} in "
                "Sec-WebSocket-Protocol (a hub refuses the upgrade with HTTP 400)"))
            self.dialled.set()
            return
        try:
            self.ws = await accept_websocket(stream, request, subprotocol=chosen, max_message_bytes=MAX_MESSAGE_BYTES,
                                             keepalive_s=KEEPALIVE_S, idle_timeout_s=KEEPALIVE_S + KEEPALIVE_TIMEOUT_S)
        except HttpError as exc:
            await send_response(stream, 400, f"{exc}\n")
            self.upgrade = StepResult("upgrade", FAIL, f"not a valid WebSocket upgrade: {exc}")
            self.dialled.set()
            return
        self.upgrade = StepResult("upgrade", PASS, f"{request.path!r} upgraded with subprotocol {chosen}; "
                                                   f"offered {offered}")
        self.dialled.set()
        await self.done.wait()

    async def end(self, reason: str, close_code: int | None = None) -> None:
        """The session is over: close as a hub would, stop the running session step (it fails
        with ``reason``; with none running, the next one does) and skip the rest."""
        if self.fatal is None:
            self.fatal = reason
            self.fatal_reported = self.scope is not None
        if close_code is not None and self.ws is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(2):  # the worker may be gone
                await self.ws.close(close_code, reason[:120])
        if self.scope is not None:
            self.scope.cancel()

    # the session

    async def handshake(self) -> HelloInfo:
        """SessionChallenge, SessionHello, SessionAccept, as a hub would for a direct worker
        (--e2e auto): encrypted when the worker requires it. A late or refused hello ends the
        session and fails the step."""
        from kvasir_rpc import HubHandshake, SealedHeartbeat
        from kvasir_rpc.protocol import HUB_HANDSHAKE_TIMEOUT_S, CloseCode, RemoteProtocolError

        assert self.ws is not None
        hs = HubHandshake(self.hub_key)
        try:
            with trio.fail_after(HUB_HANDSHAKE_TIMEOUT_S):
                await self.ws.send_message(hs.challenge())
                data = await self.ws.receive_message()
                if isinstance(data, str):
                    raise RemoteProtocolError(f"the SessionHello must be a binary message, got text {data[:40]!r}")
                info = hs.receive_hello(data)
                await self.ws.send_message(hs.accept("conformance-1"))
                self.cipher = hs.cipher
                self.heartbeat = SealedHeartbeat(self.ws, hs.cipher) if hs.cipher is not None else None
        except trio.TooSlowError:
            await self.end(f"no SessionHello within {HUB_HANDSHAKE_TIMEOUT_S:g} s of the challenge (a hub closes "
                           "4200 'handshake timed out')", CloseCode.HANDSHAKE_TIMEOUT)
            raise _StepFailed(self.fatal) from None
        except RemoteProtocolError as exc:
            await self.end(f"hello refused: {exc.reason} (a hub closes {exc.close_code})", exc.close_code)
            raise _StepFailed(self.fatal) from None
        self.hello = info
        return info

    async def read(self) -> None:
        """Feed every message of the worker to the hub's tunnel state machine."""
        from kvasir_rpc import WsClosed, receive_message
        from kvasir_rpc.protocol import Closed, Data, Discarded, Eof, RemoteProtocolError

        assert self.ws is not None
        while True:
            try:
                msg = await receive_message(self.ws, self.cipher, self.heartbeat)
            except WsClosed as exc:
                if not self.finishing:
                    await self.end(_closed_words(exc))
                return
            except RemoteProtocolError as exc:  # a sealed message that does not open
                await self.end(f"end-to-end channel: {exc.reason}; a hub closes {exc.close_code}", exc.close_code)
                return
            state = self.tunnel.state
            try:
                event = self.tunnel.receive(msg)
            except RemoteProtocolError as exc:
                await self.end(f"protocol error: {exc.reason} ({_HINTS[state.name]}); a hub closes "
                               f"{exc.close_code}", exc.close_code)
                return
            if isinstance(event, Data):
                self.first_data.set()
                stream = self.stream
                if stream is not None:
                    try:
                        await stream.send_all(event.data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass  # the client left; "close" follows
            elif isinstance(event, Eof):
                self.eofs += 1
                self._worker_eof.set()
            elif isinstance(event, Discarded):
                self.discarded += event.nbytes
            elif isinstance(event, Closed):
                self.closed.set()

    # the gRPC target spliced into the tunnel

    def channel(self) -> grpc.Channel:
        """A gRPC client channel to the local target: its own connection, so its own splice."""
        import grpc

        return grpc.insecure_channel(self.target, options=[
            ("grpc.use_local_subchannel_pool", 1),  # its own connection, not one shared in-process
            ("grpc.max_receive_message_length", _MAX_CHANNEL_BYTES),
            ("grpc.max_send_message_length", _MAX_CHANNEL_BYTES),
        ])

    async def serve_target(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """The local gRPC target: each client connection in turn is spliced into the tunnel."""
        from kvasir_rpc import WsClosed
        from kvasir_rpc.protocol import RemoteProtocolError

        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        async with listener:
            task_status.started(listener.socket.getsockname()[1])
            while True:
                stream = await listener.accept()
                if self.fatal is not None:
                    await stream.aclose()
                    continue
                try:
                    await self._splice(stream)
                except WsClosed:
                    pass  # the reader reports it
                except RemoteProtocolError as exc:  # a tunnel message could not be sent in time
                    await self.end(exc.reason, exc.close_code)

    async def _splice(self, stream: trio.SocketStream) -> None:
        from kvasir_rpc import send_whole
        from kvasir_rpc.protocol import CLOSE_TIMEOUT_S, READ_BYTES, CloseCode, TunnelState

        ws = self.ws
        assert ws is not None
        self.opens += 1
        self.first_data, self.closed, self._worker_eof = trio.Event(), trio.Event(), trio.Event()
        self.discarded = 0
        self.stream = stream
        await send_whole(ws, self.tunnel.open(), cipher=self.cipher)
        self.opened.set()
        async with trio.open_nursery() as nursery:

            async def client_to_worker() -> None:
                while True:
                    try:
                        data = await stream.receive_some(READ_BYTES)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        data = b""
                    if not data or self.tunnel.state is not TunnelState.OPEN:
                        break
                    await send_whole(ws, self.tunnel.send_data(bytes(data)), cipher=self.cipher)
                nursery.cancel_scope.cancel()

            nursery.start_soon(client_to_worker)
            await self._worker_eof.wait()
            nursery.cancel_scope.cancel()
        self.stream = None
        await stream.aclose()
        if self.fatal is not None:
            return
        self.close_sent_at = trio.current_time()
        await send_whole(ws, self.tunnel.close(), cipher=self.cipher)
        with trio.move_on_after(CLOSE_TIMEOUT_S):
            await self.closed.wait()
        if not self.closed.is_set():
            await self.end(f"the worker did not answer 'close' with 'closed' within {CLOSE_TIMEOUT_S:g} s (a hub "
                           "closes 1008 'close not acknowledged')", CloseCode.POLICY_VIOLATION)


def _closed_words(exc: BaseException) -> str:
    """How the session's WebSocket ended (``kvasir_rpc.WsClosed``), for a step's detail."""
    code, reason, local = getattr(exc, "code", 1006), getattr(exc, "reason", ""), getattr(exc, "local", False)
    if local:
        return f"this hub closed the WebSocket: {code} {reason}".rstrip()
    return f"the worker closed the WebSocket: {code} {reason}".rstrip()


_HINTS = {
    "IDLE": "a worker sends nothing until the hub says 'open'",
    "OPEN": "while open a worker sends binary HTTP/2 bytes, or 'eof' when its gRPC server ends the connection",
    "EOF": "after 'eof' a worker waits for 'close'",
    "CLOSING": "after 'close' a worker may send late bytes or 'eof', then 'closed'",
}
