"""Bulk reads over TLS for the relays.

``trio.SSLStream.receive_some`` returns at most one TLS record (16 KiB), however much
plaintext the bytes it already read off the socket hold: a 1 MiB tunnel message costs 64
trips through trio's retry loop and, above it, 64 feeds of the WebSocket parser. Measured
here (one-way 1 MiB writes, loopback, 2 cores): 236-258 MB/s read through ``SSLStream``,
399-484 MB/s through :class:`BulkTLSStream`, and the gateway relays with two TLS legs.

:class:`BulkTLSStream` wraps an ``SSLStream``: after the wrapped ``receive_some`` returns,
it keeps decrypting records that are already buffered, without another socket read, up to
``max_bytes``. Everything else is delegated. Only the receiving task touches the TLS
object between awaits, as it does inside trio; bytes OpenSSL wants to send in answer to
a record it read (a TLS 1.3 key update) go out with the stream's next send or receive.
"""

from __future__ import annotations

import contextlib
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Sequence

import trio
from trio_websocket import ConnectionTimeout, HandshakeError, WebSocketConnection, wrap_client_stream

__all__ = ["BulkTLSStream", "open_tls_over_tcp", "open_websocket_url"]


class BulkTLSStream(trio.abc.Stream):
    """An ``SSLStream`` whose reads drain every buffered record (see the module doc)."""

    def __init__(self, inner: trio.SSLStream[trio.SocketStream]) -> None:
        self.inner = inner
        # trio keeps the TLS object private; the receive path below only reads from it.
        self._tls: ssl.SSLObject = inner._ssl_object

    @property
    def transport_stream(self) -> trio.SocketStream:
        return self.inner.transport_stream

    async def do_handshake(self) -> None:
        await self.inner.do_handshake()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = bytes(await self.inner.receive_some(max_bytes))
        if not data or max_bytes is None:
            return data
        chunks = [data]
        size = len(data)
        while size < max_bytes:
            try:
                more = self._tls.read(max_bytes - size)
            except ssl.SSLError:
                break  # nothing buffered (SSLWantReadError), or an error the next call reports
            if not more:
                break
            chunks.append(more)
            size += len(more)
        return data if len(chunks) == 1 else b"".join(chunks)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def open_tls_over_tcp(host: str, port: int, ssl_context: ssl.SSLContext) -> BulkTLSStream:
    """Connect and complete the TLS handshake (``https_compatible``, as WebSocket clients do)."""
    tcp = await trio.open_tcp_stream(host, port)
    try:
        stream = BulkTLSStream(trio.SSLStream(tcp, ssl_context, server_hostname=host, https_compatible=True))
        await stream.do_handshake()
    except BaseException:
        await trio.aclose_forcefully(tcp)
        raise
    return stream


@contextlib.asynccontextmanager
async def open_websocket_url(
    url: str,
    ssl_context: ssl.SSLContext | None = None,
    *,
    subprotocols: Sequence[str] = (),
    extra_headers: list[tuple[bytes, bytes]] | None = None,
    max_message_size: int = 1 << 20,
    receive_buffer_size: int | None = None,
    message_queue_size: int = 1,
    connect_timeout: float = 10.0,
    disconnect_timeout: float = 5.0,
) -> AsyncIterator[WebSocketConnection]:
    """trio-websocket's ``open_websocket_url`` with the same errors (ConnectionTimeout,
    HandshakeError, ConnectionRejected), whose ``wss://`` connections read through
    :class:`BulkTLSStream`. The WebSocket itself is trio-websocket's, over its public
    ``wrap_client_stream``."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"not a ws:// or wss:// URL: {url!r}")
    secure = parts.scheme == "wss"
    host = parts.hostname
    port = parts.port or (443 if secure else 80)
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    shown = f"[{host}]" if ":" in host else host
    host_header = shown if port in (80, 443) else f"{shown}:{port}"
    try:
        async with trio.open_nursery() as nursery:
            try:
                with trio.fail_after(connect_timeout):
                    stream: trio.abc.Stream
                    if secure:
                        stream = await open_tls_over_tcp(host, port, ssl_context or ssl.create_default_context())
                    else:
                        stream = await trio.open_tcp_stream(host, port)
                    ws = await wrap_client_stream(
                        nursery, stream, host_header, resource,  # type: ignore[arg-type]  # any trio Stream works
                        subprotocols=list(subprotocols), extra_headers=extra_headers,
                        message_queue_size=message_queue_size, max_message_size=max_message_size,
                        receive_buffer_size=receive_buffer_size)
            except trio.TooSlowError:
                raise ConnectionTimeout from None
            except OSError as exc:
                raise HandshakeError from exc
            try:
                yield ws
            finally:
                with trio.move_on_after(disconnect_timeout):
                    await ws.aclose()
    except BaseExceptionGroup as group:
        # As trio-websocket does: one error (a rejection from the reader task, say) comes
        # out as itself, not wrapped in the nursery's group.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
