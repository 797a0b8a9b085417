"""The HTTP side of a server WebSocket (the gateway, the hub, ``kvasir conformance``'s hub):
h11 reads the request head (so a server can answer /healthz, 401, 404 and 426 itself), and
``accept_websocket`` answers the upgrade with wsproto and hands the stream to the library's
WebSocket (``kvasir_rpc._ws``: the frames, the keepalive and the close handshake, written once
for every Kvasir process; the client's side of the upgrade is ``open_websocket``'s).
"""

from __future__ import annotations

import dataclasses

import h11
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request
from wsproto.utilities import RemoteProtocolError as WsRemoteProtocolError

from kvasir_rpc._ws import SEND_TIMEOUT_S, MessageBudget, WebSocket

__all__ = ["HttpError", "HttpRequest", "MAX_HEADER_BYTES", "accept_websocket", "read_request", "send_response"]

MAX_HEADER_BYTES = 16 << 10


@dataclasses.dataclass
class HttpRequest:
    method: str
    target: str
    headers: list[tuple[bytes, bytes]]
    trailing: bytes
    http_version: str = "1.1"

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        for k, v in self.headers:
            if k.lower() == key:
                return v.decode("latin-1")
        return None

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def is_upgrade(self) -> bool:
        return (self.header("upgrade") or "").lower() == "websocket" and "upgrade" in (
            self.header("connection") or ""
        ).lower()

    @property
    def subprotocols(self) -> list[str]:
        raw = ",".join(v.decode("latin-1") for k, v in self.headers if k.lower() == b"sec-websocket-protocol")
        return [p.strip() for p in raw.split(",") if p.strip()]


class HttpError(Exception):
    """The client's bytes are not an HTTP/1.1 request we can read.

    ``status`` is the answer it deserves (None when nobody is left to read one: the client
    closed before a whole head); ``reason`` is a fixed word for statistics and logs."""

    def __init__(self, message: str, *, status: int | None = 400, reason: str = "bad_request") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


async def read_request(stream: trio.abc.ReceiveStream) -> HttpRequest:
    """Read one HTTP request head. Raises HttpError on garbage (400), a request line over
    MAX_HEADER_BYTES (414), a head over MAX_HEADER_BYTES (431), or EOF before a whole head
    (status None)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
    fed = 0
    start = bytearray()  # the first bytes, enough to tell a long request line (414) from a long head (431)

    def too_big() -> HttpError:
        if b"\n" in start[:MAX_HEADER_BYTES]:
            return HttpError(f"request head larger than {MAX_HEADER_BYTES} bytes", status=431,
                             reason="header_too_big")
        return HttpError(f"request line longer than {MAX_HEADER_BYTES} bytes", status=414,
                         reason="request_line_too_long")

    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            # h11's own bound on an incomplete head (431), or an error in a head over ours
            if exc.error_status_hint == 431 or fed - len(conn.trailing_data[0]) > MAX_HEADER_BYTES:
                raise too_big() from exc
            raise HttpError(str(exc), status=exc.error_status_hint) from exc
        if event is h11.NEED_DATA:
            data = await stream.receive_some(MAX_HEADER_BYTES)
            if not data:
                raise HttpError("connection closed before a complete request", status=None, reason="incomplete")
            fed += len(data)
            if len(start) <= MAX_HEADER_BYTES:
                start += data[:MAX_HEADER_BYTES + 1 - len(start)]
            conn.receive_data(bytes(data))
            continue
        # h11 bounds only what is buffered while a head is incomplete: a head that ends in a
        # later read could be up to twice the bound. Count what it really took.
        if fed - len(conn.trailing_data[0]) > MAX_HEADER_BYTES:
            raise too_big()
        if isinstance(event, h11.Request):
            trailing = b""
            if (event.method == b"GET") and any(k.lower() == b"upgrade" for k, _ in event.headers):
                # h11 pauses after an Upgrade request; what follows belongs to the WebSocket.
                try:
                    conn.next_event()
                except h11.RemoteProtocolError:
                    pass
                trailing = conn.trailing_data[0]
            return HttpRequest(
                method=event.method.decode("ascii", "replace"),
                target=event.target.decode("ascii", "replace"),
                headers=list(event.headers),
                trailing=trailing,
                http_version=event.http_version.decode("ascii", "replace"),
            )
        raise HttpError(f"unexpected {type(event).__name__} before a request")


async def send_response(stream: trio.abc.Stream, status: int, body: str, *, headers: list[tuple[str, str]] = ()) -> None:  # type: ignore[assignment]
    """Answer with a plain-text HTTP/1.1 response and close the connection."""
    payload = body.encode()
    reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
              414: "URI Too Long", 426: "Upgrade Required", 429: "Too Many Requests",
              431: "Request Header Fields Too Large", 503: "Service Unavailable"}.get(status, "")
    head = [f"HTTP/1.1 {status} {reason}", "content-type: text/plain; charset=utf-8",
            f"content-length: {len(payload)}", "connection: close", *(f"{k}: {v}" for k, v in headers)]
    try:
        await stream.send_all(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
    except trio.BrokenResourceError:
        pass  # the client went away: nobody is left to read the answer
    # ClosedResourceError propagates: answering on a stream we closed is our bug.


async def accept_websocket(
    stream: trio.abc.Stream,
    request: HttpRequest,
    *,
    subprotocol: str,
    max_message_bytes: int,
    keepalive_s: float,
    idle_timeout_s: float,
    send_timeout_s: float = SEND_TIMEOUT_S,
    budget: MessageBudget | None = None,
) -> WebSocket:
    """Accept the WebSocket upgrade of ``request`` with ``subprotocol``.

    ``request`` should have passed ``relay._intake.upgrade_refusal``; one that wsproto still
    refuses raises HttpError (400) with wsproto's words, before anything is sent."""
    conn = WSConnection(ConnectionType.SERVER)
    try:
        conn.initiate_upgrade_connection(request.headers, request.target)
    except WsRemoteProtocolError as exc:
        raise HttpError(f"not a valid WebSocket upgrade: {exc}", reason="bad_upgrade") from exc
    for event in conn.events():
        if isinstance(event, Request):
            break
    else:  # pragma: no cover - initiate_upgrade_connection always yields the Request
        raise HttpError("not a WebSocket upgrade")
    # wsproto writes the 101; the frames after it are the library's (kvasir_rpc._ws_frames).
    await stream.send_all(conn.send(AcceptConnection(subprotocol=subprotocol)))
    ws = WebSocket(stream, max_message_bytes=max_message_bytes, keepalive_s=keepalive_s,
                   idle_timeout_s=idle_timeout_s, send_timeout_s=send_timeout_s, budget=budget)
    if request.trailing:
        ws.feed(request.trailing)
    return ws
