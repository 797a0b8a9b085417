"""What both relays do with a connection's first bytes before any WebSocket exists.

``upgrade_refusal`` checks a parsed request against RFC 6455 4.1/4.2.1 and names the
answer (status, headers, a sentence) for the first thing wrong; the gateway calls it in its
router. ``UpgradeIntake`` is the hub's: it accepts TCP connections, reads each one's request
head with ``kvasir_rpc.read_request`` under a deadline, answers a bad one itself (one refusal
through a ``RefusalLog``, then closes it) and hands each good one, with its parsed request,
to the hub's handler (which answers the upgrade with ``kvasir_rpc.accept_websocket``).
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from kvasir_rpc import HttpError, HttpRequest, read_request, send_response
from relay._refusals import RefusalLog

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


def _remote(stream: trio.abc.Stream) -> str:
    sock = getattr(stream, "socket", None)
    try:
        peer: Any = sock.getpeername() if sock is not None else None
    except OSError:
        peer = None
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "unknown"


# What the intake hands a good upgrade to: the stream (its head read, the bytes after it in
# the request's ``trailing``), the request, and the peer's address; it runs in the
# connection's own task for the connection's life.
Handler = Callable[[trio.abc.Stream, HttpRequest, str], Awaitable[None]]


class UpgradeIntake:
    """Accepts on ``listeners`` and hands ``handle`` only well-formed WebSocket upgrades.

    ``serve`` accepts every connection and screens each in its own task: its request head
    must arrive within ``timeout_s`` and pass ``upgrade_refusal``. A refused connection gets
    its answer and one (rate-limited) line in ``refusals``, and is closed; nothing of it
    reaches ``handle``, which gets the good ones in the same task.

    At most ``max_screening`` connections are screened at once: one more closes the oldest
    (counted as ``crowded_out``), so a flood of silent connections holds a bounded number of
    tasks and descriptors and cannot keep out a client whose head comes in one round trip.
    ``admit`` (the server's own capacity) may refuse a good upgrade (a Refusal, answered
    like the others); ``handle`` starts with no checkpoint after it, so a count checked in
    one and raised in the other is exact."""

    def __init__(self, listeners: list[trio.SocketListener], refusals: RefusalLog, *, timeout_s: float,
                 handle: Handler, max_screening: int = 256,
                 admit: Callable[[HttpRequest, str], Refusal | None] | None = None) -> None:
        if not listeners:
            raise ValueError("an intake needs at least one listener")
        if max_screening < 1:
            raise ValueError("an intake must screen at least one connection at a time")
        self._listeners = listeners
        self._refusals = refusals
        self._timeout = timeout_s
        self._max_screening = max_screening
        self._admit = admit
        self._handle = handle
        # Connections being screened, oldest first (cancelling one's scope closes it).
        self._screening: collections.deque[trio.CancelScope] = collections.deque()

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
        request: HttpRequest | None = None
        try:
            with scope:
                request = await self.screen(stream, remote)
        finally:
            if scope in self._screening:
                self._screening.remove(scope)
        if scope.cancelled_caught:
            self._refusals.refused("crowded_out", remote=remote,
                                   detail=f"closed for a newer connection ({self._max_screening} were sending their heads)")
            with trio.CancelScope(shield=True):
                await stream.aclose()
            return
        if request is not None:
            await self._handle(stream, request, remote)

    async def screen(self, stream: trio.abc.Stream, remote: str) -> HttpRequest | None:
        """Read and check one connection's head: the request to hand on, or None when it was
        answered, logged and closed here."""
        refusal: Refusal | None = None
        try:
            with trio.fail_after(self._timeout):
                try:
                    req = await read_request(stream)
                    refusal = upgrade_refusal(req)
                    if refusal is None and self._admit is not None:
                        refusal = self._admit(req, remote)
                except HttpError as exc:
                    refusal = http_error_refusal(exc)
                    if refusal is None:  # gone before a whole head: no answer to give
                        self._refusals.refused(exc.reason, remote=remote, detail=str(exc))
                        await stream.aclose()
                        return None
                if refusal is not None:
                    await send_response(stream, refusal.status, refusal.message + "\n", headers=list(refusal.headers))
        except trio.TooSlowError:
            self._refusals.refused("handshake_timeout", remote=remote,
                                   detail=f"no whole request head within {self._timeout:g} s")
            await stream.aclose()
            return None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._refusals.refused("broken", remote=remote, detail=f"{type(exc).__name__}: {exc}")
            await stream.aclose()
            return None
        if refusal is not None:
            self._refusals.refused(refusal.reason, remote=remote, status=refusal.status, detail=refusal.message)
            await stream.aclose()
            return None
        return req
