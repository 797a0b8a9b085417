"""What both relays do with a connection's first bytes before any WebSocket exists.

``upgrade_refusal`` checks a parsed request against RFC 6455 4.1/4.2.1 and names the
answer (status, headers, a sentence) for the first thing wrong; the gateway calls it in its
router. ``UpgradeIntake`` is a listener for trio-websocket's ``WebSocketServer`` (the hub):
it reads each connection's request head with ``relay._ws.read_request`` under a deadline,
answers a bad one itself (one refusal through a ``RefusalLog``, then closes it) and hands on
only good ones, their bytes replayed, so trio-websocket never sees a malformed upgrade (it
would answer a bare 400, log nothing, and hold the connection's task until its connect
timeout).
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import trio

from relay._refusals import RefusalLog
from relay._ws import HttpError, HttpRequest, read_request, send_response

__all__ = ["Refusal", "UpgradeIntake", "upgrade_refusal"]

WEBSOCKET_VERSION = "13"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """The answer to a request we refuse: ``reason`` is a fixed word for counters and logs,
    ``status`` and ``headers`` the HTTP answer, ``message`` its body (one sentence)."""

    reason: str
    status: int
    message: str
    headers: tuple[tuple[str, str], ...] = ()


def _valid_key(key: str | None) -> bool:
    if key is None:
        return False
    try:
        return len(base64.b64decode(key.strip(), validate=True)) == 16
    except (binascii.Error, ValueError):
        return False


def upgrade_refusal(req: HttpRequest) -> Refusal | None:
    """None if ``req`` is a well-formed WebSocket opening handshake, else the Refusal for the
    first thing wrong: a method but GET (405), HTTP before 1.1 or no Host (400), no
    ``Upgrade: websocket`` / ``Connection: Upgrade`` (426), a ``Sec-WebSocket-Version``
    other than 13 (426, naming 13 as RFC 6455 4.4 asks), a ``Sec-WebSocket-Key`` that is not
    16 bytes in base64 (400). Subprotocols and paths are the caller's to check."""
    if req.method != "GET":
        return Refusal("bad_method", 405, f"{req.path} takes GET with a WebSocket upgrade, not {req.method}",
                       (("allow", "GET"),))
    major, _, minor = req.http_version.partition(".")
    if not (major.isdigit() and minor.isdigit()) or (int(major), int(minor)) < (1, 1):
        return Refusal("http_version", 400,
                       f"a WebSocket upgrade needs HTTP/1.1 or later, not HTTP/{req.http_version[:8]} (RFC 6455 4.1)")
    if not (req.header("host") or "").strip():
        return Refusal("no_host", 400, "a WebSocket upgrade needs a Host header (RFC 6455 4.1)")
    if not req.is_upgrade:
        return Refusal("not_websocket", 426, f"{req.path} takes a WebSocket upgrade "
                       "(Upgrade: websocket, Connection: Upgrade)", (("upgrade", "websocket"),))
    version = req.header("sec-websocket-version")
    if version is None or version.strip() != WEBSOCKET_VERSION:
        got = "none" if version is None else repr(version.strip()[:16])
        return Refusal("ws_version", 426, f"this server speaks WebSocket version {WEBSOCKET_VERSION} "
                       f"(Sec-WebSocket-Version), not {got}", (("sec-websocket-version", WEBSOCKET_VERSION),))
    if not _valid_key(req.header("sec-websocket-key")):
        return Refusal("ws_key", 400, "Sec-WebSocket-Key must be 16 random bytes in base64 (RFC 6455 4.1)")
    return None


def http_error_refusal(exc: HttpError) -> Refusal | None:
    """The Refusal for a head that did not parse, or None when nobody is left to answer."""
    if exc.status is None:
        return None
    return Refusal(exc.reason, exc.status, str(exc))


class _Replayed(trio.abc.Stream):
    """A stream that gives back ``prefix`` (the bytes the intake read) before reading on."""

    def __init__(self, inner: trio.abc.Stream, prefix: bytes, remote: str) -> None:
        self._inner = inner
        self._prefix = prefix
        self._remote = remote

    def __repr__(self) -> str:
        # trio-websocket shows a stream it cannot place by its repr (WebSocketConnection.remote).
        return self._remote

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._prefix:
            n = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:n], self._prefix[n:]
            return data
        return bytes(await self._inner.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Recording(trio.abc.ReceiveStream):
    """Reads from ``inner`` and keeps a copy (at most a head's worth: read_request bounds it)."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.seen = bytearray()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = bytes(await self.inner.receive_some(max_bytes))
        self.seen += data
        return data

    async def aclose(self) -> None:
        await self.inner.aclose()


def _remote(stream: trio.abc.Stream) -> str:
    sock = getattr(stream, "socket", None)
    try:
        peer: Any = sock.getpeername() if sock is not None else None
    except OSError:
        peer = None
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "unknown"


class UpgradeIntake(trio.abc.Listener[trio.abc.Stream]):
    """A listener over ``listeners`` that hands on only well-formed WebSocket upgrades.

    ``serve`` (start it in a nursery before whoever calls ``accept``) accepts every
    connection and screens each in its own task: its request head must arrive within
    ``timeout_s`` and pass ``upgrade_refusal``. A refused connection gets its answer and
    one (rate-limited) line in ``refusals``, and is closed; nothing of it reaches
    ``accept``. ``accept`` returns the good ones with their bytes replayed from the start.

    At most ``max_screening`` connections are screened at once: one more closes the oldest
    (counted as ``crowded_out``), so a flood of silent connections holds a bounded number of
    tasks and descriptors and cannot keep out a client whose head comes in one round trip.
    ``admit`` (the server's own capacity) may refuse a good upgrade (a Refusal, answered
    like the others); ``wrap(stream, remote, head_bytes)`` makes the stream handed on, whose
    first ``head_bytes`` are the request head (both are called together, with
    no checkpoint between, so a count checked in one and raised in the other is exact)."""

    def __init__(self, listeners: list[trio.SocketListener], refusals: RefusalLog, *, timeout_s: float,
                 max_screening: int = 256, admit: Callable[[HttpRequest, str], Refusal | None] | None = None,
                 wrap: Callable[[trio.abc.Stream, str, int], trio.abc.Stream] | None = None) -> None:
        if not listeners:
            raise ValueError("an intake needs at least one listener")
        if max_screening < 1:
            raise ValueError("an intake must screen at least one connection at a time")
        self._listeners = listeners
        self._refusals = refusals
        self._timeout = timeout_s
        self._max_screening = max_screening
        self._admit = admit
        self._wrap = wrap
        # Connections being screened, oldest first (cancelling one's scope closes it).
        self._screening: collections.deque[trio.CancelScope] = collections.deque()
        self._ready_send, self._ready = trio.open_memory_channel[trio.abc.Stream](0)

    @property
    def screening(self) -> int:
        """Connections whose request head is being read now."""
        return len(self._screening)

    @property
    def port(self) -> int:
        """The port of the first listener."""
        return int(self._listeners[0].socket.getsockname()[1])

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for listener in self._listeners:
                nursery.start_soon(self._accept_loop, listener, nursery)
            task_status.started()

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    # Out of descriptors or memory: say so (rate-limited) and let it pass.
                    self._refusals.refused("accept_failed", detail=str(exc))
                    await trio.sleep(0.1)
                    continue
                if len(self._screening) >= self._max_screening:
                    self._screening.popleft().cancel()
                scope = trio.CancelScope()
                self._screening.append(scope)
                nursery.start_soon(self._screen_within, stream, _remote(stream), scope)

    async def _screen_within(self, stream: trio.abc.Stream, remote: str, scope: trio.CancelScope) -> None:
        try:
            with scope:
                await self.screen(stream, remote)
        finally:
            if scope in self._screening:
                self._screening.remove(scope)
        if scope.cancelled_caught:
            self._refusals.refused("crowded_out", remote=remote,
                                   detail=f"closed for a newer connection ({self._max_screening} were sending their heads)")
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def screen(self, stream: trio.abc.Stream, remote: str) -> None:
        """Read and check one connection's head; hand it on, or answer, log and close it."""
        recording = _Recording(stream)
        refusal: Refusal | None = None
        try:
            with trio.fail_after(self._timeout):
                try:
                    req = await read_request(recording)
                    refusal = upgrade_refusal(req)
                    if refusal is None and self._admit is not None:
                        refusal = self._admit(req, remote)
                except HttpError as exc:
                    refusal = http_error_refusal(exc)
                    if refusal is None:  # gone before a whole head: no answer to give
                        self._refusals.refused(exc.reason, remote=remote, detail=str(exc))
                        await stream.aclose()
                        return
                if refusal is not None:
                    await send_response(stream, refusal.status, refusal.message + "\n", headers=list(refusal.headers))
        except trio.TooSlowError:
            self._refusals.refused("handshake_timeout", remote=remote,
                                   detail=f"no whole request head within {self._timeout:g} s")
            await stream.aclose()
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._refusals.refused("broken", remote=remote, detail=f"{type(exc).__name__}: {exc}")
            await stream.aclose()
            return
        if refusal is not None:
            self._refusals.refused(refusal.reason, remote=remote, status=refusal.status, detail=refusal.message)
            await stream.aclose()
            return
        handed: trio.abc.Stream = _Replayed(stream, bytes(recording.seen), remote)
        if self._wrap is not None:
            handed = self._wrap(handed, remote, len(recording.seen) - len(req.trailing))
        try:
            await self._ready_send.send(handed)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            await handed.aclose()  # the intake is closing
        except BaseException:  # crowded out (cancelled) before trio-websocket took it
            with trio.CancelScope(shield=True):
                await handed.aclose()  # a wrapper's count ends with it
            raise

    async def accept(self) -> trio.abc.Stream:
        return await self._ready.receive()

    async def aclose(self) -> None:
        await self._ready_send.aclose()
        await self._ready.aclose()
        for listener in self._listeners:
            await listener.aclose()
        await trio.lowlevel.checkpoint()
