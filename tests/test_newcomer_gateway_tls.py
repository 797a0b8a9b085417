"""A hub given ``ws://`` for a gateway that speaks TLS: each failed dial's warning ends with
``— the gateway may speak TLS: use wss://HOST:PORT`` instead of leaving the operator to guess,
and a port that answers with bytes that are not HTTP (a TLS alert) is retried like any other
failure, not a crash of the hub. In process: tiny trio servers on 127.0.0.1:0."""

from __future__ import annotations

import functools
import ssl
from collections.abc import Awaitable, Callable

import pytest
import trio
import trustme

import relay.hub._gateway_link as hub_gateway
from kvasir_rpc import TLSStream, leaf_exception, open_websocket
from relay.hub._gateway_link import GatewayLink, describe, tls_hint

Handler = Callable[[trio.SocketStream], Awaitable[None]]
HINT = "— the gateway may speak TLS: use wss://127.0.0.1:"


def _server_context() -> ssl.SSLContext:
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    return context


async def _tls_gateway(stream: trio.SocketStream) -> None:
    """What a TLS gateway does with a plain WebSocket request: a failed handshake, then close."""
    try:
        await TLSStream(stream, _server_context(), server_side=True).do_handshake()
    except trio.BrokenResourceError:
        pass
    await stream.aclose()


async def _alert(stream: trio.SocketStream) -> None:
    """A TLS endpoint that answers anything with a fatal alert (internal_error)."""
    await stream.receive_some(4096)
    await stream.send_all(b"\x15\x03\x01\x00\x02\x02\x50")
    await stream.aclose()


async def _http_404(stream: trio.SocketStream) -> None:
    await stream.receive_some(4096)
    await stream.send_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
    await stream.aclose()


def _dial(handler: Handler, scheme: str = "ws") -> str:
    """Dial ``handler``'s port at ``scheme``://; what the hub logs for the failure."""

    async def run() -> str:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            url = f"{scheme}://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
            line = ""
            try:
                async with open_websocket(f"{url}/v1/hub", connect_timeout=1, disconnect_timeout=1):
                    pass
            except* hub_gateway._NETWORK_ERRORS as group:
                failure = leaf_exception(group)
                line = describe(failure) + await tls_hint(url, failure, timeout_s=2)
            nursery.cancel_scope.cancel()
            return line

    return trio.run(run)


def test_a_tls_gateway_dialled_at_ws_is_named_with_its_wss_url() -> None:
    line = _dial(_tls_gateway)
    assert line.startswith("closed the connection without answering the upgrade") and HINT in line


def test_a_tls_alert_is_not_http_and_is_named_too() -> None:
    line = _dial(_alert)
    assert line.startswith("answered in something other than HTTP/1.1") and HINT in line


def test_no_hint_for_an_http_answer_a_refused_port_or_wss() -> None:
    assert _dial(_http_404) == "HTTP 404"
    assert HINT not in _dial(_tls_gateway, scheme="wss")  # wss:// already (its certificate is the issue)

    async def refused() -> str:
        with trio.socket.socket() as sock:  # a port nobody listens on
            await sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return await tls_hint(f"ws://127.0.0.1:{port}", ConnectionRefusedError(111, "Connection refused"))

    assert trio.run(refused) == ""


def test_the_hubs_gateway_link_logs_the_hint_and_keeps_retrying(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control connection's failure, as GatewayLink.run logs it: retried, never raised."""
    monkeypatch.setattr(hub_gateway, "_CONNECT_TIMEOUT_S", 1.0)

    async def serve(ws, remote):  # type: ignore[no-untyped-def]
        raise AssertionError("no session comes through a failed gateway")

    async def run(handler: Handler) -> tuple[bool, str]:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            link = GatewayLink(serve, f"ws://127.0.0.1:{listeners[0].socket.getsockname()[1]}", "token")
            result = await link._control_once(nursery)
            nursery.cancel_scope.cancel()
            return result

    for handler in (_alert, _tls_gateway):
        connected, error = trio.run(run, handler)
        assert not connected and HINT in error, error
