"""A WebSocket client driven by hand over any trio stream (usually one end of
``trio.testing.memory_stream_pair``), for fast tests of the relays without sockets.

wsproto does the framing; nothing answers on the test's behalf except pings, so a test sees
every close frame and HTTP refusal exactly as the server sent it.
"""

from __future__ import annotations

import dataclasses

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Message,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)

__all__ = ["MemClient", "open_client"]


@dataclasses.dataclass
class MemClient:
    """The client end after the upgrade: ``status`` is None when accepted, else the HTTP
    refusal with its ``headers`` (names lower-case) and ``body``."""

    stream: trio.abc.Stream
    conn: WSConnection
    status: int | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    body: bytes = b""
    subprotocol: str | None = None
    pings: int = 0

    async def send(self, *events: Event) -> None:
        await self.stream.send_all(b"".join(self.conn.send(e) for e in events))

    async def send_message(self, message: bytes | str) -> None:
        await self.send(TextMessage(message) if isinstance(message, str) else BytesMessage(message))

    async def close(self, code: int = 1000, reason: str = "") -> None:
        await self.send(CloseConnection(code=code, reason=reason))

    async def next_event(self) -> bytes | str | CloseConnection | None:
        """The next whole message, or the server's CloseConnection, or None when the stream
        ended without one. Pings are answered and counted. Bounded by the caller's deadline."""
        parts: list[bytes | str] = []
        while True:
            for event in self.conn.events():
                if isinstance(event, Message):
                    parts.append(event.data)
                    if event.message_finished:
                        return "".join(parts) if isinstance(event, TextMessage) else b"".join(parts)  # type: ignore[arg-type]
                elif isinstance(event, Ping):
                    self.pings += 1
                    await self.send(event.response())
                elif isinstance(event, CloseConnection):
                    return event
            if not await self._feed():
                return None

    async def _feed(self) -> bool:
        try:
            data = await self.stream.receive_some(1 << 20)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if self.conn.state is not ConnectionState.CLOSED:
            self.conn.receive_data(bytes(data) if data else None)
        return bool(data)

    async def aclose(self) -> None:
        await self.stream.aclose()


async def open_client(
    stream: trio.abc.Stream,
    path: str,
    *,
    subprotocols: list[str] | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
    host: str = "gw.example",
) -> MemClient:
    """Send a WebSocket upgrade for ``path`` over ``stream`` and read the answer: an open
    client, or a refusal with its status, headers and whole body (read until the server
    closes). Raises AssertionError if the server closes without any answer."""
    client = MemClient(stream, WSConnection(ConnectionType.CLIENT))
    await stream.send_all(client.conn.send(Request(host=host, target=path, subprotocols=subprotocols or [],
                                                   extra_headers=headers or [])))
    while True:
        for event in client.conn.events():
            if isinstance(event, AcceptConnection):
                client.subprotocol = event.subprotocol
                return client
            if isinstance(event, RejectConnection):
                client.status = event.status_code
                client.headers = {k.decode().lower(): v.decode() for k, v in event.headers}
                if not event.has_body:
                    return client
            elif isinstance(event, RejectData):
                client.body += event.data
                if event.body_finished:
                    return client
        if not await client._feed():
            assert client.status is not None, f"the server closed {path} without an answer"
            return client
