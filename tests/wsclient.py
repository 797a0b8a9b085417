"""A deliberately low-level WebSocket client for hostile-traffic tests: trio + wsproto by hand,
so a test can bind a source address, stop half-way, skip pongs or send what it likes."""

from __future__ import annotations

import ssl

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Message,
    Ping,
    RejectConnection,
    RejectData,
    Request,
)


async def open_tcp(port: int, source: str = "127.0.0.1") -> trio.SocketStream:
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    await sock.bind((source, 0))
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


async def open_stream(port: int, ssl_context: ssl.SSLContext | None, source: str = "127.0.0.1") -> trio.abc.Stream:
    tcp = await open_tcp(port, source)
    if ssl_context is None:
        return tcp
    tls = trio.SSLStream(tcp, ssl_context, server_hostname="127.0.0.1")
    await tls.do_handshake()
    return tls


async def read_until_eof(stream: trio.abc.Stream, limit: int = 1 << 16) -> bytes:
    """Everything the server sends until it closes (bounded by the caller's deadline)."""
    out = b""
    while len(out) < limit:
        try:
            data = await stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError):
            break
        if not data:
            break
        out += data
    return out


class RawWebSocket:
    """Result of ``connect``: either ``status`` (HTTP refusal) or an open WebSocket."""

    def __init__(self, stream: trio.abc.Stream, conn: WSConnection, status: int | None) -> None:
        self.stream = stream
        self.conn = conn
        self.status = status
        self.pings = 0

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(self.conn.send(BytesMessage(data=data)))

    async def next_event(self, *, answer_pings: bool = True) -> object:
        """The next message (bytes/str), or a CloseConnection; None if the stream ended."""
        while True:
            for event in self.conn.events():
                if isinstance(event, Message):
                    if event.message_finished:
                        return event.data
                    continue
                if isinstance(event, Ping):
                    self.pings += 1
                    if answer_pings:
                        await self.stream.send_all(self.conn.send(event.response()))
                    continue
                if isinstance(event, CloseConnection):
                    return event
            try:
                data = await self.stream.receive_some(1 << 20)
            except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError):
                return None
            if not data:
                return None
            self.conn.receive_data(data)

    async def aclose(self) -> None:
        await self.stream.aclose()


async def connect(
    port: int,
    path: str,
    *,
    ssl_context: ssl.SSLContext | None,
    source: str = "127.0.0.1",
    headers: list[tuple[bytes, bytes]] | None = None,
    subprotocols: list[str] | None = None,
) -> RawWebSocket:
    stream = await open_stream(port, ssl_context, source)
    conn = WSConnection(ConnectionType.CLIENT)
    await stream.send_all(conn.send(Request(host="127.0.0.1", target=path, subprotocols=subprotocols or [],
                                            extra_headers=headers or [])))
    while True:
        data = await stream.receive_some(65536)
        if not data:
            return RawWebSocket(stream, conn, status=0)
        conn.receive_data(data)
        for event in conn.events():
            if isinstance(event, AcceptConnection):
                return RawWebSocket(stream, conn, status=None)
            if isinstance(event, RejectConnection):
                ws = RawWebSocket(stream, conn, status=event.status_code)
                return ws
            if isinstance(event, RejectData):
                continue
