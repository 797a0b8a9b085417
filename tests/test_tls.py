"""The relays' TLS stream (kvasir_rpc._tls) and the library's WebSocket opener over it
(``kvasir_rpc.open_websocket``, whose wss:// runs over TLSStream), over real TLS on 127.0.0.1
with trustme certificates; and torch's thread setting carried into the threads that compute."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import ssl
import threading

import pytest
import trio
import trustme

from kvasir_rpc import (
    WsClosed,
    WsConnectTimeout,
    WsHandshakeError,
    WsRejected,
    accept_websocket,
    open_websocket,
    read_request,
    send_response,
)
from kvasir_rpc._tls import TLSStream, open_tls_over_tcp

# Integration: real TLS servers on 127.0.0.1.
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    leaf.configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return server, client


async def _listen(nursery: trio.Nursery, handler) -> int:  # type: ignore[no-untyped-def]
    """Serve ``handler`` on a fresh 127.0.0.1 port; the port."""
    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


def _tls_handler(server_ctx: ssl.SSLContext, body):  # type: ignore[no-untyped-def]
    """A serve_tcp handler: the server side of the TLS handshake, then ``body(stream, tcp)``."""
    async def handler(tcp: trio.SocketStream) -> None:
        stream = TLSStream(tcp, server_ctx, server_side=True)
        await stream.do_handshake()
        await body(stream, tcp)

    return handler


def _ws_server(server_ctx: ssl.SSLContext | None, body, max_message_bytes: int):  # type: ignore[no-untyped-def]
    """A serve_tcp handler: a WebSocket server (over TLSStream with ``server_ctx``, else plain
    TCP) that answers ``/no`` with 401 and any other upgrade with subprotocol t.v1 and
    ``body(ws)``, then closes the WebSocket (1000)."""
    async def handler(tcp: trio.SocketStream) -> None:
        stream: trio.abc.Stream = tcp if server_ctx is None else TLSStream(tcp, server_ctx, server_side=True)
        async with stream:
            request = await read_request(stream)
            if request.path == "/no":
                await send_response(stream, 401, "go away")
                return
            ws = await accept_websocket(stream, request, subprotocol="t.v1", max_message_bytes=max_message_bytes,
                                        keepalive_s=10.0, idle_timeout_s=30.0)
            try:
                await body(ws)
            except WsClosed:
                pass
            finally:
                await ws.close()

    return handler


def _echo_server(server_ctx: ssl.SSLContext, sizes: list[int]):  # type: ignore[no-untyped-def]
    async def handler(tcp: trio.SocketStream) -> None:
        stream = TLSStream(tcp, server_ctx, server_side=True)
        try:
            await stream.do_handshake()
            while data := await stream.receive_some(1 << 20):
                sizes.append(len(data))
                await stream.send_all(data)
        except trio.BrokenResourceError:
            pass
        finally:
            await trio.aclose_forcefully(stream)

    return handler


def test_bulk_reads_return_more_than_one_record_and_every_byte(contexts) -> None:  # type: ignore[no-untyped-def]
    server_ctx, client_ctx = contexts
    payload = os.urandom(6 << 20) + b"end"
    sizes: list[int] = []
    got = bytearray()

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                port = await _listen(nursery, _echo_server(server_ctx, sizes))
                client = await open_tls_over_tcp("127.0.0.1", port, client_ctx)

                async def reader() -> None:
                    while len(got) < len(payload):
                        got.extend(await client.receive_some(1 << 20))

                async with trio.open_nursery() as inner:
                    inner.start_soon(reader)
                    for i in range(0, len(payload), 1 << 20):
                        await client.send_all(payload[i:i + (1 << 20)])
                await client.aclose()
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
    assert sum(sizes) == len(payload)
    # trio's SSLStream alone never returns more than one 16 KiB record per read.
    assert max(sizes) > 16384


def test_bulk_read_never_exceeds_max_bytes(contexts) -> None:  # type: ignore[no-untyped-def]
    server_ctx, client_ctx = contexts
    reads: list[int] = []

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                async def body(stream: TLSStream, tcp: trio.SocketStream) -> None:
                    await stream.send_all(b"x" * (1 << 20))
                    await trio.sleep(5)

                port = await _listen(nursery, _tls_handler(server_ctx, body))
                client = await open_tls_over_tcp("127.0.0.1", port, client_ctx)
                total = 0
                while total < 1 << 20:
                    data = await client.receive_some(50_000)
                    reads.append(len(data))
                    total += len(data)
                await client.aclose()
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert sum(reads) == 1 << 20 and max(reads) <= 50_000


def test_close_notify_and_ragged_eof_both_read_as_eof(contexts) -> None:  # type: ignore[no-untyped-def]
    server_ctx, client_ctx = contexts
    got: dict[str, object] = {}

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                async def body(stream: TLSStream, tcp: trio.SocketStream) -> None:
                    mode = await stream.receive_some(100)
                    await stream.send_all(b"bye")
                    if mode == b"clean":
                        await stream.aclose()  # close_notify, then FIN
                    else:
                        await tcp.aclose()  # FIN without close_notify

                port = await _listen(nursery, _tls_handler(server_ctx, body))
                for mode in (b"clean", b"ragged"):
                    client = await open_tls_over_tcp("127.0.0.1", port, client_ctx)
                    await client.send_all(mode)
                    data = b""
                    while chunk := await client.receive_some(1 << 20):
                        data += chunk
                    got[mode.decode()] = data
                    assert await client.receive_some(10) == b""  # EOF stays EOF
                    await client.aclose()
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert got == {"clean": b"bye", "ragged": b"bye"}


def test_failed_handshakes_raise_broken_resource_on_both_sides(contexts) -> None:  # type: ignore[no-untyped-def]
    server_ctx, _ = contexts
    untrusting = ssl.create_default_context()  # does not trust the test CA
    server_errors: list[BaseException] = []

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                async def handler(tcp: trio.SocketStream) -> None:
                    try:
                        await TLSStream(tcp, server_ctx, server_side=True).do_handshake()
                    except trio.BrokenResourceError as exc:
                        server_errors.append(exc)

                port = await _listen(nursery, handler)
                with pytest.raises(trio.BrokenResourceError, match="TLS handshake failed"):
                    await open_tls_over_tcp("127.0.0.1", port, untrusting)
                # Not TLS at all: the server's handshake fails, the server stays up.
                raw = await trio.open_tcp_stream("127.0.0.1", port)
                await raw.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                with contextlib.suppress(trio.BrokenResourceError):
                    await raw.receive_some(100)  # an alert or nothing, then the close
                await raw.aclose()
                while len(server_errors) < 2:
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert len(server_errors) == 2


def test_open_websocket_over_wss_echoes_and_reports_refusals(contexts) -> None:  # type: ignore[no-untyped-def]
    server_ctx, client_ctx = contexts
    echoed: list[bytes | str] = []

    async def echo(ws) -> None:  # type: ignore[no-untyped-def]
        await ws.send_message(await ws.receive_message())

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                port = await _listen(nursery, _ws_server(server_ctx, echo, 8 << 20))
                base = f"wss://127.0.0.1:{port}"
                big = os.urandom(3 << 20)
                async with open_websocket(f"{base}/yes", client_ctx, subprotocols=["t.v1"],
                                          max_message_bytes=8 << 20) as ws:
                    assert ws.subprotocol == "t.v1"
                    await ws.send_message(big)
                    echoed.append(await ws.receive_message())
                assert echoed == [big]
                with pytest.raises(WsRejected) as rejected:
                    async with open_websocket(f"{base}/no", client_ctx):
                        pass
                assert rejected.value.status_code == 401
                # Nothing listening: a WsHandshakeError naming the OS error, not a bare OSError.
                with pytest.raises(WsHandshakeError) as failed:
                    async with open_websocket("wss://127.0.0.1:1/x", client_ctx, connect_timeout=5):
                        pass
                assert isinstance(failed.value.__cause__, OSError)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_open_websocket_times_out_on_a_silent_server(contexts) -> None:  # type: ignore[no-untyped-def]
    _, client_ctx = contexts

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                async def silent(stream: trio.SocketStream) -> None:
                    await trio.sleep(60)

                port = await _listen(nursery, silent)
                with pytest.raises(WsConnectTimeout):
                    async with open_websocket(f"wss://127.0.0.1:{port}/x", client_ctx, connect_timeout=0.5):
                        pass
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_open_websocket_rejects_other_schemes() -> None:
    async def main() -> None:
        async with open_websocket("https://127.0.0.1/x"):
            pass

    with pytest.raises(ValueError, match="ws:// or wss://"):
        trio.run(main)


def _omp_max_threads():  # type: ignore[no-untyped-def]
    """libgomp's own ``omp_get_max_threads`` for the calling thread (torch.__config__ would
    set the thread's count before reporting it)."""
    import ctypes

    import torch  # loads the libgomp torch uses

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libgomp" in line and line.split()[-1].startswith("/")}
    if not paths or "OpenMP" not in torch.__config__.parallel_info():
        return None
    return ctypes.CDLL(sorted(paths)[0]).omp_get_max_threads


def _threads_in_new_thread(probe, initializer) -> int:  # type: ignore[no-untyped-def]
    seen: list[int] = []

    def run() -> None:
        if initializer is not None:
            initializer()
        seen.append(int(probe()))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return seen[0]


def test_threads_initializer_carries_the_thread_count_into_new_threads() -> None:
    """Under OpenMP a thread made later gets every core whatever the main thread set;
    the worker's pool and the backbone's group threads run threads_initializer first."""
    import torch

    from kvasir_rpc._kernel import threads_initializer

    probe = _omp_max_threads()
    if probe is None or (os.cpu_count() or 1) < 2 or os.environ.get("OMP_NUM_THREADS"):
        pytest.skip("needs torch's OpenMP build, 2 cores and no OMP_NUM_THREADS")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert probe() == 1
        assert _threads_in_new_thread(probe, None) > 1  # the trap
        assert _threads_in_new_thread(probe, threads_initializer()) == 1
    finally:
        torch.set_num_threads(before)


def test_a_send_cut_short_breaks_the_stream_instead_of_corrupting_it(contexts) -> None:  # type: ignore[no-untyped-def]
    """Encrypted records that never reach the socket leave a gap the peer cannot decrypt
    past: after a cancelled send, sending again raises instead of writing garbage."""
    server_ctx, client_ctx = contexts

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                async def body(stream: TLSStream, tcp: trio.SocketStream) -> None:
                    await trio.sleep(30)  # reads nothing: the client's socket fills

                port = await _listen(nursery, _tls_handler(server_ctx, body))
                client = await open_tls_over_tcp("127.0.0.1", port, client_ctx)
                with trio.move_on_after(0.5) as scope:
                    while True:
                        await client.send_all(b"x" * (1 << 20))
                assert scope.cancelled_caught
                with pytest.raises(trio.BrokenResourceError, match="cut short"):
                    await client.send_all(b"more")
                await trio.aclose_forcefully(client)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_send_whole_survives_cancellation_mid_message() -> None:
    """A pump cancelled while it sends must not cut the frame: the peer gets the whole
    message and the tunnel carries the next one."""
    from kvasir_rpc._tunnel import send_whole

    big = os.urandom(24 << 20)  # more than loopback socket buffers hold
    got: list[bytes | str] = []

    async def receive_two(ws) -> None:  # type: ignore[no-untyped-def]
        for _ in range(2):
            got.append(await ws.receive_message())

    async def main() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                port = await _listen(nursery, _ws_server(None, receive_two, 32 << 20))
                async with open_websocket(f"ws://127.0.0.1:{port}/t", subprotocols=["t.v1"]) as ws:
                    with trio.CancelScope() as scope:
                        # Cancelled throughout: the send blocks on full socket buffers many
                        # times, and each of those checkpoints would end a plain send.
                        scope.cancel()
                        await send_whole(ws, big)
                    assert scope.cancelled_caught  # the cancellation arrived, after the message left
                    await ws.send_message(b"after")
                    while len(got) < 2:
                        await trio.sleep(0.01)
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert got[0] == big and got[1] == b"after"
