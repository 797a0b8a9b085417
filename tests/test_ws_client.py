"""The library WebSocket's client end (kvasir_rpc._ws, kvasir_rpc._ws_frames): server frames
from wsproto's own server parsed whole, byte by byte and in pieces; what the client sends
masked with a fresh key and read back by wsproto's server; the keepalive's round trip on a
fake clock; and ``open_websocket`` over real TCP on 127.0.0.1 against the relays' own
upgrade (``kvasir_rpc.accept_websocket``): messages both ways, the subprotocol, and each way a dial
fails (refused, an HTTP refusal with its body, a wrong accept key, a server that says nothing)."""

from __future__ import annotations

import base64
import hashlib

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto import ConnectionType, WSConnection
from wsproto.events import BytesMessage, CloseConnection, Ping, Pong, TextMessage
from wsproto.frame_protocol import FrameProtocol

from kvasir_rpc import (
    OWN_PING,
    WebSocket,
    WsClosed,
    WsConnectTimeout,
    WsHandshakeError,
    WsRejected,
    accept_websocket,
    open_websocket,
    read_request,
    send_response,
)
from kvasir_rpc._ws import _masked_frame
from kvasir_rpc._ws_frames import BINARY, TEXT, Data, FrameError, FrameReader, frame_header

SUB = "kvasir.tunnel.v1"


def _fake_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def server_frames(*messages: tuple[bytes | str, bool]) -> bytes:
    """wsproto's unmasked server frames for (payload, message_finished) pairs."""
    proto = FrameProtocol(client=False, extensions=[])
    return b"".join(bytes(proto.send_data(data, fin)) for data, fin in messages)


def client_parse(wire: bytes, step: int | None) -> list[tuple[bytes, bool]]:
    """The messages a client reader gets from ``wire`` fed in pieces of ``step`` bytes."""
    reader = FrameReader(client=True)
    msgs: list[tuple[bytes, bool]] = []
    part = b""
    step = step or len(wire) or 1
    for i in range(0, len(wire), step):
        reader.feed(wire[i:i + step])
        while (event := reader.next_event()) is not None:
            if isinstance(event, Data):
                part += bytes(event.payload)
                if event.finished:
                    msgs.append((part, event.text))
                    part = b""
    return msgs


@pytest.mark.parametrize("step", [None, 1, 7, 4096])
def test_a_client_reads_a_servers_unmasked_frames_whole_byte_by_byte_and_in_pieces(step: int | None) -> None:
    big = bytes(range(256)) * 400
    wire = server_frames((b"hello", True), ("héllo", True), (b"ab", False), (b"cd", True), (big, True), (b"", True))
    assert client_parse(wire, step) == [(b"hello", False), ("héllo".encode(), True), (b"abcd", False),
                                        (big, False), (b"", False)]


def test_a_client_refuses_a_masked_frame_and_a_server_an_unmasked_one() -> None:
    masked = bytes(FrameProtocol(client=True, extensions=[]).send_data(b"x", True))
    reader = FrameReader(client=True)
    reader.feed(masked)
    with pytest.raises(FrameError, match="client received unexpected masked frame") as err:
        reader.next_event()
    assert err.value.code == 1002
    server = FrameReader()
    server.feed(server_frames((b"x", True)))
    with pytest.raises(FrameError, match="unmasked"):
        server.next_event()


def _pieces(data: bytes, cuts: list[int]) -> tuple[bytes, ...]:
    """``data`` cut at ``cuts`` (any offsets; the mask must run on across the pieces)."""
    at = sorted({min(c, len(data)) for c in cuts})
    return tuple(data[a:b] for a, b in zip([0, *at], [*at, len(data)], strict=True))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.binary(max_size=70000), st.text(max_size=300)),
                          st.lists(st.integers(0, 70000), max_size=4)), min_size=1, max_size=6))
def test_what_a_client_sends_is_masked_afresh_and_wsproto_reads_it_back(
        sent: list[tuple[bytes | str, list[int]]]) -> None:
    messages = [m for m, _ in sent]
    server = FrameProtocol(client=False, extensions=[])
    # A binary message may go as pieces (a tunnel channel's prefix, then its data): one frame.
    wire = b"".join(bytes(_masked_frame(TEXT if isinstance(m, str) else BINARY,
                                        (m.encode(),) if isinstance(m, str) else _pieces(m, cuts)))
                    for m, cuts in sent)
    server.receive_bytes(wire)
    got: list[bytes | str] = []
    part: bytes | str | None = None
    for frame in server.received_frames():
        part = frame.payload if part is None else part + frame.payload  # type: ignore[operator]
        if frame.message_finished:
            got.append(part)
            part = None
    assert got == messages


def test_each_client_frame_has_its_own_mask_key() -> None:
    keys = {bytes(_masked_frame(BINARY, (b"same payload",)))[2:6] for _ in range(50)}
    assert len(keys) > 45  # os.urandom: a repeat among 50 is a 1-in-15-million event
    assert frame_header(BINARY, 300, b"abcd") == bytes((0x82, 0x80 | 126, 1, 44)) + b"abcd"


async def _wsproto_server(stream: trio.abc.Stream, conn: WSConnection) -> list[object]:
    """Read ``stream`` as wsproto's server until the client's close; answer pings, and hand
    back every event."""
    events: list[object] = []
    while True:
        data = await stream.receive_some(65536)
        conn.receive_data(bytes(data) if data else None)
        for event in conn.events():
            events.append(event)
            if isinstance(event, Ping):
                await stream.send_all(conn.send(event.response()))
            if isinstance(event, CloseConnection):
                return events  # the client closes its stream after its close frame: no answer is read
        if not data:
            return events


def test_a_client_websocket_talks_to_wsprotos_server_and_measures_its_keepalive_round_trip() -> None:
    trio.run(_test_a_client_websocket_talks_to_wsprotos_server_and_measures_its_keepalive_round_trip,
             clock=_fake_clock())


async def _test_a_client_websocket_talks_to_wsprotos_server_and_measures_its_keepalive_round_trip() -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    rtts: list[float] = []
    ws = WebSocket(client_stream, max_message_bytes=1 << 20, keepalive_s=5.0, idle_timeout_s=30.0, client=True,
                   on_rtt=rtts.append)
    conn = WSConnection(ConnectionType.SERVER)
    conn.initiate_upgrade_connection([(b"host", b"h"), (b"upgrade", b"websocket"), (b"connection", b"Upgrade"),
                                      (b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ=="),
                                      (b"sec-websocket-version", b"13")], "/")
    for _ in conn.events():
        pass
    from wsproto.events import AcceptConnection
    conn.send(AcceptConnection())  # the handshake is done (its bytes are not needed here)
    events: list[object] = []
    async with trio.open_nursery() as nursery:
        async def serve() -> None:
            events.extend(await _wsproto_server(server_stream, conn))

        nursery.start_soon(serve)
        await ws.send_message(b"\x00binary" * 1000)
        await ws.send_message("text é")
        # The server says something: the client reads it unmasked.
        await server_stream.send_all(conn.send(BytesMessage(data=b"from the server")))
        assert await ws.receive_message() == b"from the server"
        # Silent for the keepalive: the client pings, wsproto's pong comes back, the round trip is told.
        await server_stream.send_all(conn.send(TextMessage(data="later")))
        assert await ws.receive_message() == "later"
        with trio.move_on_after(7):
            await ws.receive_message()
        assert ws.statistics().pings_sent == 1 and ws.statistics().pongs_received == 1
        assert len(rtts) == 1 and rtts[0] >= 0 and ws.last_rtt_s == rtts[0]
        await ws.close(4010, "plan again")
    msgs = [e for e in events if isinstance(e, (BytesMessage, TextMessage))]
    assert [m.data for m in msgs] == [b"\x00binary" * 1000, "text é"]
    assert any(isinstance(e, Ping) and e.payload == ws.own_ping for e in events) and ws.own_ping.startswith(OWN_PING)
    closes = [e for e in events if isinstance(e, CloseConnection)]
    assert closes and (closes[0].code, closes[0].reason) == (4010, "plan again")


def test_a_client_sees_the_servers_close_code_and_the_server_a_held_message_masked() -> None:
    trio.run(_test_a_client_sees_the_servers_close_code_and_the_server_a_held_message_masked, clock=_fake_clock())


async def _test_a_client_sees_the_servers_close_code_and_the_server_a_held_message_masked() -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    ws = WebSocket(client_stream, max_message_bytes=1 << 20, keepalive_s=5.0, idle_timeout_s=30.0, client=True)
    server = WebSocket(server_stream, max_message_bytes=1 << 20, keepalive_s=5.0, idle_timeout_s=30.0)
    await server.send_message(b"y" * 5000)
    held = await ws.receive_held()
    assert not isinstance(held, (str, Ping, Pong)) and bytes(held) == b"y" * 5000
    await ws.send_held(held)  # a client relays what it got, masked in place
    assert await server.receive_message() == b"y" * 5000
    await server.close(4008, "refused")
    with pytest.raises(WsClosed) as closed:
        await ws.receive_message()
    assert (closed.value.code, closed.value.reason, closed.value.local) == (4008, "refused", False)


async def _serve(listeners: list[trio.SocketListener], answer) -> None:  # type: ignore[no-untyped-def]
    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            await answer(stream)

    await trio.serve_listeners(handle, listeners)


async def _echo(stream: trio.SocketStream) -> None:
    request = await read_request(stream)
    ws = await accept_websocket(stream, request, subprotocol=SUB, max_message_bytes=1 << 20, keepalive_s=10.0,
                       idle_timeout_s=30.0)
    try:
        while True:
            msg = await ws.receive_message()
            if msg == "close":
                await ws.close(4003, "asked to")
                return
            await ws.send_message(msg)
    except WsClosed:
        pass


async def _listen(nursery: trio.Nursery, answer) -> int:  # type: ignore[no-untyped-def]
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(_serve, listeners, answer)
    return int(listeners[0].socket.getsockname()[1])


def test_open_websocket_dials_the_relays_upgrade_over_tcp_and_talks_both_ways() -> None:
    trio.run(_test_open_websocket_dials_the_relays_upgrade_over_tcp_and_talks_both_ways)


async def _test_open_websocket_dials_the_relays_upgrade_over_tcp_and_talks_both_ways() -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _listen(nursery, _echo)
            async with open_websocket(f"ws://127.0.0.1:{port}/v1/worker?x=1", subprotocols=["other", SUB],
                                      keepalive_s=10.0, idle_timeout_s=30.0) as ws:
                assert ws.client and ws.subprotocol == SUB
                big = bytes(range(256)) * 4096  # 1 MiB: the largest message
                for msg in (b"small", big, "text"):
                    await ws.send_message(msg)
                    assert await ws.receive_message() == msg
                await ws.send_message("close")
                with pytest.raises(WsClosed) as closed:
                    await ws.receive_message()
                assert closed.value.code == 4003
            nursery.cancel_scope.cancel()


def test_open_websocket_says_how_a_dial_failed() -> None:
    trio.run(_test_open_websocket_says_how_a_dial_failed)


async def _test_open_websocket_says_how_a_dial_failed() -> None:
    async def refuse(stream: trio.SocketStream) -> None:
        await read_request(stream)
        await send_response(stream, 404, "no such path: /v1/nope\nsecond line")

    async def wrong_key(stream: trio.SocketStream) -> None:
        await read_request(stream)
        accept = base64.b64encode(hashlib.sha1(b"another key").digest()).decode()
        await stream.send_all(f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                              f"Sec-WebSocket-Accept: {accept}\r\n\r\n".encode())

    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async def garbage(stream: trio.SocketStream) -> None:
        await read_request(stream)
        await stream.send_all(b"SSH-2.0-OpenSSH_9.6\r\n")

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            refused = await _listen(nursery, refuse)
            with pytest.raises(WsRejected) as rejected:
                async with open_websocket(f"ws://127.0.0.1:{refused}/v1/nope"):
                    pass
            assert rejected.value.status_code == 404
            assert rejected.value.body.startswith(b"no such path: /v1/nope")
            assert str(rejected.value) == "HTTP 404: no such path: /v1/nope"
            bad = await _listen(nursery, wrong_key)
            with pytest.raises(WsHandshakeError, match="Sec-WebSocket-Accept"):
                async with open_websocket(f"ws://127.0.0.1:{bad}/"):
                    pass
            quiet = await _listen(nursery, silent)
            with pytest.raises(WsConnectTimeout):
                async with open_websocket(f"ws://127.0.0.1:{quiet}/", connect_timeout=0.5):
                    pass
            junk = await _listen(nursery, garbage)
            with pytest.raises(WsHandshakeError, match="something other than HTTP/1.1"):
                async with open_websocket(f"ws://127.0.0.1:{junk}/"):
                    pass
            nursery.cancel_scope.cancel()
    # Nothing listening: the OSError is the cause, for a message that says so.
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(WsHandshakeError) as failed:
        async with open_websocket(f"ws://127.0.0.1:{port}/"):
            pass
    assert isinstance(failed.value.__cause__, OSError)
    with pytest.raises(ValueError, match="not a ws"):
        async with open_websocket("http://127.0.0.1/"):
            pass


def test_a_workers_keepalive_passes_through_a_relay_that_pings_alike() -> None:
    async def main() -> None:
        # worker (client) <-> gateway (server, relaying): the gateway pings too, with its own
        # payload; the worker's ping and the pong answering it are relayed, not taken as the
        # gateway's own.
        worker_stream, gateway_stream = trio.testing.memory_stream_pair()
        worker = WebSocket(worker_stream, max_message_bytes=1 << 20, keepalive_s=5.0, idle_timeout_s=30.0,
                           client=True)
        gateway = WebSocket(gateway_stream, max_message_bytes=1 << 20, keepalive_s=5.0, idle_timeout_s=30.0)
        assert worker.own_ping != gateway.own_ping
        await worker.ping()
        relayed = await gateway.receive_relayed()
        assert isinstance(relayed, Ping) and relayed.payload == worker.own_ping
        await gateway.send_control(Pong(relayed.payload))  # the hub's answer, sent on by the gateway
        with trio.move_on_after(1):
            await worker.receive_message()
        assert worker.last_rtt_s is not None and worker.statistics().pongs_received == 1
        # Any pong that does not carry the gateway's own payload is someone else's: relayed.
        await worker.send_control(Pong(worker.own_ping))
        got = await gateway.receive_relayed()
        assert isinstance(got, Pong) and got.payload == worker.own_ping

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_ping_and_wait_gives_the_round_trip_the_receiving_task_reads() -> None:
    async def main() -> None:
        a_stream, b_stream = trio.testing.memory_stream_pair()
        a = WebSocket(a_stream, max_message_bytes=1 << 20, keepalive_s=100.0, idle_timeout_s=300.0, client=True)
        b = WebSocket(b_stream, max_message_bytes=1 << 20, keepalive_s=100.0, idle_timeout_s=300.0)
        async with trio.open_nursery() as nursery:
            async def receive(ws: WebSocket) -> None:
                with pytest.raises(WsClosed):
                    while True:
                        await ws.receive_message()

            nursery.start_soon(receive, a)
            nursery.start_soon(receive, b)
            with trio.fail_after(5):
                rtt = await a.ping_and_wait()
            assert rtt == a.last_rtt_s and rtt >= 0 and a.statistics().pongs_received == 1
            await a.close()

    trio.run(main, clock=_fake_clock())
