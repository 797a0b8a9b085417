"""kvasir_rpc/_ws.py and _ws_http.py over in-memory streams and a fake clock: the HTTP head,
the upgrade, frames, masking, fragmentation, ping/pong, close codes, the message size limit and idle time, the
budget of unfinished messages (bytes over all connections, and a deadline) and relay mode.

The client side is wsproto driven by hand, so a test can send exactly the frames it wants.
"""

from __future__ import annotations

import dataclasses

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    Request,
    TextMessage,
)

from kvasir_rpc import (
    MAX_HEADER_BYTES,
    OWN_PING,
    CloseCode,
    HttpError,
    HttpRequest,
    MessageBudget,
    WebSocket,
    WsClosed,
    accept_websocket,
    read_request,
    send_response,
)
from kvasir_rpc._ws import _LINGER_S

SUB = "kvasir.tunnel.v1"
UPGRADE = (b"GET /v1/worker?x=1 HTTP/1.1\r\nHost: gw\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
           b"Sec-WebSocket-Protocol: other, kvasir.tunnel.v1\r\n\r\n")
PLAIN = b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n"


def run(fn, *args, clock: trio.testing.MockClock | None = None):  # type: ignore[no-untyped-def]
    """Run ``fn`` under trio, on a fake clock that jumps whenever every task waits."""
    return trio.run(fn, *args, clock=clock or trio.testing.MockClock(autojump_threshold=0))


async def feed(data: bytes, chunk: int | None) -> HttpRequest:
    """``read_request`` over a lockstep stream fed ``data`` whole (``chunk`` None) or in
    pieces of ``chunk`` bytes, each its own ``send_all`` (so each its own read)."""
    client, server = trio.testing.lockstep_stream_pair()

    async def send() -> None:
        step = chunk or len(data) or 1
        for i in range(0, len(data), step):
            await client.send_all(data[i:i + step])
        await client.send_eof()

    error: HttpError | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        try:
            req = await read_request(server)
        except HttpError as exc:  # raised out here, not inside the nursery's exception group
            error = exc
        nursery.cancel_scope.cancel()
    if error is not None:
        raise error
    return req


# -- the HTTP head ------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_request_head_parses_whole_byte_by_byte_and_in_pieces(chunk: int | None) -> None:
    req = run(feed, UPGRADE, chunk)
    assert (req.method, req.target, req.path) == ("GET", "/v1/worker?x=1", "/v1/worker")
    assert req.is_upgrade and req.subprotocols == ["other", SUB] and req.trailing == b""
    assert req.header("HOST") == "gw" and req.header("missing") is None
    plain = run(feed, PLAIN, chunk)
    assert plain.path == "/healthz" and not plain.is_upgrade and plain.subprotocols == []


@pytest.mark.parametrize("chunk", [None, 1])
def test_bytes_after_an_upgrade_request_belong_to_the_websocket(chunk: int | None) -> None:
    frame = b"\x82\x82abcd" + bytes(x ^ y for x, y in zip(b"hi", b"abcd"))
    # Fed whole, the frame arrives with the head; fed by the byte, the head ends first and
    # the frame stays in the stream for the WebSocket to read.
    req = run(feed, UPGRADE + frame, chunk)
    assert req.trailing == (frame if chunk is None else b"")


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "closed before a complete request"),
        (b"GET / HTTP/1.1\r\nHost: gw\r\n", "closed before a complete request"),
        (b"\x16\x03\x01\x02\x00garbage\r\n\r\n", "illegal request line"),
        (b"GET / HTTP/1.1\r\nHost: gw\r\nX: " + b"a" * MAX_HEADER_BYTES + b"\r\n\r\n", "larger than|too long"),
        (b"GET / HTTP/1.1\r\nHost: gw\r\n" + b"X: y\r\n" * (MAX_HEADER_BYTES // 6 + 1) + b"\r\n", "larger than|too long"),
        (b"HTTP/1.1 200 OK\r\n\r\n", "illegal request line"),
    ],
    ids=["empty", "truncated", "tls-to-plain-port", "huge-header", "many-headers", "a-response"],
)
@pytest.mark.parametrize("chunk", [None, 1000])
def test_bad_heads_raise_http_error(data: bytes, words: str, chunk: int | None) -> None:
    with pytest.raises(HttpError, match=words):
        run(feed, data, chunk)


def test_a_head_of_exactly_the_bound_is_read() -> None:
    base = b"GET / HTTP/1.1\r\nHost: gw\r\nX: \r\n\r\n"
    head = base.replace(b"X: ", b"X: " + b"a" * (MAX_HEADER_BYTES - len(base)))
    assert len(head) == MAX_HEADER_BYTES
    assert run(feed, head + b"extra", 1000).header("x") == "a" * (MAX_HEADER_BYTES - len(base))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=300), st.builds(lambda a, b: a[:b], st.just(UPGRADE + b"xyz"),
                                                    st.integers(0, len(UPGRADE) + 3))),
       st.sampled_from([None, 1, 5]))
def test_any_bytes_give_a_request_or_http_error(data: bytes, chunk: int | None) -> None:
    try:
        req = run(feed, data, chunk)
    except HttpError:
        return
    assert isinstance(req, HttpRequest) and req.method


def test_send_response_writes_one_plain_answer_and_ignores_a_vanished_client() -> None:
    async def main() -> None:
        client, server = trio.testing.memory_stream_pair()
        await send_response(server, 503, "busy\n", headers=[("retry-after", "5")])
        head, body = (await client.receive_some()).split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        assert lines[0] == "HTTP/1.1 503 Service Unavailable" and body == b"busy\n"
        assert {"content-length: 5", "connection: close", "retry-after: 5"} <= set(lines)
        await client.aclose()  # the client is gone: nothing to answer, no error
        await send_response(server, 404, "not found\n")
        await server.aclose()  # but answering on a stream we closed ourselves is a bug
        with pytest.raises(trio.ClosedResourceError):
            await send_response(server, 404, "not found\n")

    run(main)


# -- a WebSocket between a hand-driven client and relay's server ------------------------------


@dataclasses.dataclass
class Client:
    stream: trio.abc.Stream
    conn: WSConnection

    async def send(self, *events: Event) -> None:
        await self.stream.send_all(b"".join(self.conn.send(e) for e in events))

    async def events(self) -> list[Event]:
        """What the server sent so far (waits for at least one read)."""
        data = await self.stream.receive_some()
        self.conn.receive_data(data or None)
        return list(self.conn.events())


async def connect(*, max_message_bytes: int = 1000, keepalive_s: float = 5.0, idle_timeout_s: float = 20.0,
                  first: list[Event] | None = None,
                  budget: MessageBudget | None = None) -> tuple[Client, WebSocket, trio.abc.Stream]:
    """An accepted WebSocket: (client, server WebSocket, the server's raw stream). ``first``:
    frames the client sends in the same write as its upgrade request."""
    client_stream, server_stream = trio.testing.memory_stream_pair()
    client = Client(client_stream, WSConnection(ConnectionType.CLIENT))
    head = client.conn.send(Request(host="gw", target="/v1/worker", subprotocols=[SUB]))
    # A client may send frames before it reads the 101 (a pipelined first message): they
    # are framed as an open connection would frame them.
    early = b"".join(_open_client_frames(first or []))
    await client_stream.send_all(head + early)
    req = await read_request(server_stream)
    ws = await accept_websocket(server_stream, req, subprotocol=SUB, max_message_bytes=max_message_bytes,
                                keepalive_s=keepalive_s, idle_timeout_s=idle_timeout_s, budget=budget)
    accepted = await client.events()
    assert isinstance(accepted[0], AcceptConnection) and accepted[0].subprotocol == SUB
    return client, ws, server_stream


def _open_client_frames(events: list[Event]) -> list[bytes]:
    """The masked frames of ``events`` from a client (wsproto's frame layer, past a handshake)."""
    from wsproto.frame_protocol import FrameProtocol

    proto = FrameProtocol(client=True, extensions=[])
    return [proto.send_data(e.data, e.message_finished) for e in events]  # type: ignore[attr-defined]


def test_messages_both_ways_masked_from_the_client_and_counted() -> None:
    async def main() -> None:
        client, ws, _ = await connect(first=[BytesMessage(b"early")])
        assert await ws.receive_message() == b"early"  # sent with the upgrade request
        await client.send(TextMessage("héllo"), BytesMessage(b"\x00" * 300))
        assert await ws.receive_message() == "héllo"
        assert await ws.receive_message() == b"\x00" * 300
        await ws.send_message(b"back")
        await ws.send_message("text")
        got = await client.events()
        assert [(type(e), e.data) for e in got] == [(BytesMessage, b"back"), (TextMessage, "text")]  # type: ignore[attr-defined]
        stats = ws.statistics()
        assert (stats.messages_in, stats.messages_out, stats.payload_bytes_out) == (3, 2, 8)
        assert stats.payload_bytes_in == len(b"early") + len("héllo".encode()) + 300  # bytes, not characters
        assert stats.wire_bytes_in > stats.payload_bytes_in and stats.wire_bytes_out > 8
        assert (stats.broken, stats.closed_locally) == (0, 0)
        with pytest.raises(dataclasses.FrozenInstanceError):
            stats.messages_in = 0  # type: ignore[misc]

    run(main)


def test_an_unmasked_client_frame_is_a_protocol_error_1002() -> None:
    async def main() -> None:
        client, ws, _ = await connect()
        await client.stream.send_all(b"\x82\x02hi")  # no mask bit: a client must mask
        with pytest.raises(WsClosed) as info:
            await ws.receive_message()
        assert info.value.code == 1002 and "unmasked" in info.value.reason
        closes = [e for e in await client.events() if isinstance(e, CloseConnection)]
        assert closes and closes[0].code == 1002

    run(main)


def test_fragments_are_joined_and_control_frames_may_interleave() -> None:
    async def main() -> None:
        client, ws, _ = await connect()
        await client.send(BytesMessage(b"ab", message_finished=False), Ping(b"p1"),
                          BytesMessage(b"cd", message_finished=False), BytesMessage(b"ef"))
        assert await ws.receive_message() == b"abcdef"
        got = await client.events()
        assert [(type(e), e.payload) for e in got] == [(Pong, b"p1")]  # type: ignore[attr-defined]
        assert ws.statistics().pings_answered == 1 and ws.statistics().messages_in == 1

    run(main)


@pytest.mark.parametrize("pieces", [[1001], [600, 401], [1000, 1]], ids=["whole", "fragments", "one-over"])
def test_a_message_over_the_limit_closes_1009(pieces: list[int]) -> None:
    async def main() -> None:
        client, ws, stream = await connect(max_message_bytes=1000)
        *head, last = pieces
        await client.send(*(BytesMessage(b"x" * n, message_finished=False) for n in head), BytesMessage(b"x" * last))
        with pytest.raises(WsClosed) as info:
            await ws.receive_message()
        assert (info.value.code, info.value.local) == (1009, True)
        closes = [e for e in await client.events() if isinstance(e, CloseConnection)]
        assert closes[0].code == 1009 and "larger than 1000 bytes" in closes[0].reason
        with pytest.raises(WsClosed):  # closed for good
            await ws.send_message(b"late")

    run(main)


def test_exactly_the_limit_is_accepted() -> None:
    async def main() -> None:
        client, ws, _ = await connect(max_message_bytes=1000)
        await client.send(BytesMessage(b"x" * 500, message_finished=False), BytesMessage(b"x" * 500))
        assert await ws.receive_message() == b"x" * 1000

    run(main)


@pytest.mark.parametrize("code", [1000, 1001, 4000])
def test_the_peers_close_code_is_answered_and_reported(code: int) -> None:
    async def main() -> None:
        client, ws, _ = await connect()
        await client.send(CloseConnection(code=code, reason="bye"))
        with pytest.raises(WsClosed) as info:
            await ws.receive_message()
        assert (info.value.code, info.value.reason, info.value.local) == (code, "bye", False)
        closes = [e for e in await client.events() if isinstance(e, CloseConnection)]
        assert closes[0].code == code  # the close handshake is answered

    run(main)


def test_our_close_sends_the_code_once_and_is_idempotent() -> None:
    async def main() -> None:
        client, ws, _ = await connect()
        await ws.close(4001, "r" * 200)
        await ws.close(1000)
        closes = [e for e in await client.events() if isinstance(e, CloseConnection)]
        assert len(closes) == 1 and closes[0].code == 4001 and len(closes[0].reason) == 120
        with pytest.raises(WsClosed) as info:
            await ws.receive_message()
        assert (info.value.code, info.value.local) == (4001, True)

    run(main)


def test_a_silent_peer_is_pinged_then_closed_1001_on_the_fake_clock() -> None:
    async def main() -> None:
        client, ws, _ = await connect(keepalive_s=5, idle_timeout_s=20)
        start = trio.current_time()
        with pytest.raises(WsClosed) as info:
            await ws.receive_message()
        assert (info.value.code, info.value.local) == (1001, True)
        assert trio.current_time() - start == pytest.approx(20)
        got = await client.events()
        assert [type(e) for e in got] == [Ping, Ping, Ping, CloseConnection]
        assert got[-1].code == 1001 and ws.statistics().pings_sent == 3  # type: ignore[attr-defined]

    run(main)


def test_a_peer_that_answers_pings_is_never_idle() -> None:
    async def main() -> None:
        client, ws, _ = await connect(keepalive_s=5, idle_timeout_s=12)

        async def answer() -> None:
            while True:
                for event in await client.events():
                    if isinstance(event, Ping):
                        await client.send(event.response())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            with trio.move_on_after(301):  # fake seconds: 25 idle timeouts' worth, off the ping beat
                await ws.receive_message()
            nursery.cancel_scope.cancel()
        stats = ws.statistics()
        assert stats.pongs_received == stats.pings_sent >= 50

    run(main)


# -- broken (the peer) versus closed (us) -------------------------------------------------


def test_a_peer_that_vanishes_without_a_close_frame_is_broken_1006() -> None:
    async def main() -> None:
        client, ws, _ = await connect()
        await client.stream.aclose()
        with pytest.raises(WsClosed) as info:
            await ws.receive_message()
        assert (info.value.code, info.value.local) == (1006, False)
        assert (ws.statistics().broken, ws.statistics().closed_locally) == (1, 0)

    run(main)


def test_a_write_to_a_broken_connection_is_1006_from_the_peer() -> None:
    async def main() -> None:
        client, ws, _ = await connect()
        await client.stream.aclose()
        with pytest.raises(WsClosed) as info:
            await ws.send_message(b"anyone?")
        assert (info.value.code, info.value.local) == (1006, False)
        assert isinstance(info.value.__cause__, trio.BrokenResourceError)
        assert (ws.statistics().broken, ws.statistics().closed_locally) == (1, 0)

    run(main)


def test_a_stream_closed_on_our_side_is_local_not_broken() -> None:
    async def main() -> None:
        _client, ws, stream = await connect()
        await stream.aclose()  # someone on this side closed the stream under the WebSocket
        with pytest.raises(WsClosed) as info:
            await ws.send_message(b"x")
        assert (info.value.code, info.value.local) == (1006, True)
        assert isinstance(info.value.__cause__, trio.ClosedResourceError)
        assert (ws.statistics().broken, ws.statistics().closed_locally) == (0, 1)

    run(main)


def test_close_from_another_task_ends_a_pending_receive_with_our_code() -> None:
    async def main() -> None:
        client, ws, _ = await connect()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws.close, 4002, "shutting down")
            with pytest.raises(WsClosed) as info:
                await ws.receive_message()
        assert (info.value.code, info.value.local) == (4002, True)
        assert ws.statistics().broken == 0
        closes = [e for e in await client.events() if isinstance(e, CloseConnection)]
        assert closes[0].code == 4002

    run(main)


def test_a_peer_that_reads_nothing_ends_the_websocket_after_the_send_timeout() -> None:
    """A lockstep stream blocks a send until the peer reads: a peer that stops reading costs
    the sender ``send_timeout_s``, then the WebSocket is gone (1001) and stays gone."""

    async def main() -> None:
        client_stream, server_stream = trio.testing.lockstep_stream_pair()
        conn = WSConnection(ConnectionType.CLIENT)
        head = conn.send(Request(host="gw", target="/v1/worker", subprotocols=[SUB]))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client_stream.send_all, head)
            req = await read_request(server_stream)

        async def read_accept() -> None:
            conn.receive_data(await client_stream.receive_some())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_accept)
            ws = await accept_websocket(server_stream, req, subprotocol=SUB, max_message_bytes=1000,
                                        keepalive_s=5.0, idle_timeout_s=20.0, send_timeout_s=30.0)
        assert isinstance(next(conn.events()), AcceptConnection)
        start = trio.current_time()
        with pytest.raises(WsClosed) as info:
            await ws.send_message(b"x" * 10)  # the client reads nothing from here on
        assert (info.value.code, info.value.local) == (1001, True)
        assert trio.current_time() - start == pytest.approx(30.0)
        with pytest.raises(WsClosed) as again:
            await ws.send_message(b"y")
        assert again.value.code == 1001

    run(main)


def test_text_is_bounded_and_counted_in_utf8_bytes() -> None:
    async def main() -> None:
        client, ws, _ = await connect(max_message_bytes=1000)
        await client.send(TextMessage(data="é" * 400))  # 400 characters, 800 bytes: fits
        assert await ws.receive_message() == "é" * 400
        await ws.send_message("é" * 10)
        stats = ws.statistics()
        assert (stats.payload_bytes_in, stats.payload_bytes_out) == (800, 20)
        await client.send(TextMessage(data="é" * 501))  # 501 characters, 1002 bytes: too big
        with pytest.raises(WsClosed) as info:
            await ws.receive_message()
        assert info.value.code == 1009

    run(main)


# -- unfinished messages: a deadline, and a budget of bytes shared by every connection ------------


def test_a_trickled_message_is_closed_4209_at_the_deadline_and_its_bytes_freed() -> None:
    async def main() -> None:
        budget = MessageBudget(1 << 20, deadline_s=10.0)
        # Keepalive and idle time far away: only the deadline can end this.
        client, ws, _ = await connect(max_message_bytes=1 << 20, keepalive_s=1000, idle_timeout_s=5000, budget=budget)
        start = trio.current_time()

        async def trickle() -> None:
            for _ in range(100):  # a fragment a second: never idle, never finished
                try:
                    await client.send(BytesMessage(b"t" * 1000, message_finished=False))
                except trio.BrokenResourceError:
                    return  # the WebSocket closed after its linger (at 12 s, when this sends too)
                await trio.sleep(1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            with pytest.raises(WsClosed) as info:
                await ws.receive_message()
            nursery.cancel_scope.cancel()
        assert (info.value.code, info.value.local) == (CloseCode.MESSAGE_TIMEOUT, True)
        # The deadline, then the linger: a peer that goes on sending without answering our
        # close is read (and dropped) for _LINGER_S before the connection closes.
        assert trio.current_time() - start == pytest.approx(10.0 + _LINGER_S)
        closes = [e for e in await client.events() if isinstance(e, CloseConnection)]
        assert closes[0].code == CloseCode.MESSAGE_TIMEOUT and "not finished within 10 s" in closes[0].reason
        stats = budget.statistics()
        assert (stats.buffered, stats.peak, stats.refused_deadline) == (0, 10_000, 1)
        assert ws.statistics().buffered == 0

    run(main)


def test_the_deadline_runs_per_message_and_a_finished_one_releases_it() -> None:
    async def main() -> None:
        budget = MessageBudget(1 << 20, deadline_s=10.0)
        client, ws, _ = await connect(keepalive_s=1000, idle_timeout_s=5000, budget=budget)
        for i in range(5):  # five messages of 9 s each: 45 s in all, each within its deadline
            await client.send(BytesMessage(b"a", message_finished=False))
            await trio.sleep(9)
            await client.send(BytesMessage(b"b"))
            assert await ws.receive_message() == b"ab"
            assert budget.statistics().buffered == 0
        assert budget.statistics().refused_deadline == 0

    run(main)


def test_unfinished_messages_share_one_budget_the_one_that_would_pass_it_is_closed_4208() -> None:
    async def main() -> None:
        budget = MessageBudget(1000, deadline_s=30.0)
        a, ws_a, _ = await connect(max_message_bytes=5000, keepalive_s=1000, idle_timeout_s=5000, budget=budget)
        b, ws_b, _ = await connect(max_message_bytes=5000, keepalive_s=1000, idle_timeout_s=5000, budget=budget)
        # A whole message is not held (it leaves at once): it may be larger than the budget.
        await a.send(BytesMessage(b"w" * 3000))
        assert await ws_a.receive_message() == b"w" * 3000
        assert budget.statistics().buffered == 0
        await a.send(BytesMessage(b"x" * 600, message_finished=False))
        with trio.move_on_after(1):
            await ws_a.receive_message()
        assert budget.statistics().buffered == 600
        await b.send(BytesMessage(b"y" * 300, message_finished=False), BytesMessage(b"y" * 200, message_finished=False))
        with pytest.raises(WsClosed) as info:
            await ws_b.receive_message()
        assert (info.value.code, info.value.local) == (CloseCode.BUFFERS_FULL, True)
        closes = [e for e in await b.events() if isinstance(e, CloseConnection)]
        assert closes[0].code == CloseCode.BUFFERS_FULL and "try again later" in closes[0].reason
        assert budget.statistics().buffered == 600  # b's 300 went back with it
        await a.send(BytesMessage(b"x" * 400))  # a finishes: 1000 bytes, more than was left
        assert await ws_a.receive_message() == b"x" * 1000
        stats = budget.statistics()
        assert (stats.buffered, stats.peak, stats.refused_buffer) == (0, 900, 1)

    run(main)


@pytest.mark.parametrize("ending", ["our_close", "peer_close", "vanished", "too_big"])
def test_every_ending_gives_the_unfinished_bytes_back(ending: str) -> None:
    async def main() -> None:
        budget = MessageBudget(10_000, deadline_s=30.0)
        client, ws, _ = await connect(max_message_bytes=1000, keepalive_s=1000, idle_timeout_s=5000, budget=budget)
        await client.send(BytesMessage(b"x" * 700, message_finished=False))
        with trio.move_on_after(1):
            await ws.receive_message()
        assert budget.statistics().buffered == 700
        if ending == "our_close":
            await ws.close(1000)
        else:
            if ending == "peer_close":
                await client.send(CloseConnection(code=1000))
            elif ending == "vanished":
                await client.stream.aclose()
            else:
                await client.send(BytesMessage(b"x" * 301, message_finished=False))
            with pytest.raises(WsClosed):
                await ws.receive_message()
        assert budget.statistics().buffered == 0

    run(main)


# -- relay mode: pings and pongs go to the other side of a splice ----------------------------------


def test_relay_mode_hands_out_pings_and_foreign_pongs_unanswered() -> None:
    async def main() -> None:
        client, ws, _ = await connect(keepalive_s=1000, idle_timeout_s=5000)
        await client.send(Ping(b"e2e-1"), Pong(b"e2e-2"), BytesMessage(b"m"))
        got = [await ws.receive_relayed() for _ in range(3)]
        assert isinstance(got[0], Ping) and got[0].payload == b"e2e-1"
        assert isinstance(got[1], Pong) and got[1].payload == b"e2e-2"
        assert got[2] == b"m"
        await ws.send_control(Ping(b"from-the-other-side"))
        await ws.send_control(Pong(b"answer"))
        sent = await client.events()
        # The client's ping was not answered here: only what the other side sent arrives.
        assert [(type(e), e.payload) for e in sent] == [(Ping, b"from-the-other-side"), (Pong, b"answer")]  # type: ignore[attr-defined]
        stats = ws.statistics()
        assert (stats.pings_answered, stats.control_relayed) == (0, 2)

    run(main)


def test_in_relay_mode_answers_to_our_own_pings_do_not_keep_a_peer_alive() -> None:
    async def main() -> None:
        client, ws, _ = await connect(keepalive_s=5, idle_timeout_s=12)

        async def answer() -> None:
            while True:
                for event in await client.events():
                    if isinstance(event, Ping):
                        assert event.payload == ws.own_ping and ws.own_ping.startswith(OWN_PING)
                        await client.send(event.response())

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            with pytest.raises(WsClosed) as info:
                await ws.receive_relayed()  # our pongs are not handed out either
            nursery.cancel_scope.cancel()
        assert (info.value.code, info.value.local) == (1001, True)
        assert trio.current_time() - start == pytest.approx(12)
        stats = ws.statistics()
        assert stats.pongs_received == stats.pings_sent == 2 and stats.control_relayed == 0

    run(main)


def test_in_relay_mode_relayed_pings_keep_a_peer_alive() -> None:
    async def main() -> None:
        client, ws, _ = await connect(keepalive_s=5, idle_timeout_s=12)
        start = trio.current_time()
        for _ in range(10):  # the other end's keepalive, every 10 s, for 100 s
            await trio.sleep(10)
            await client.send(Ping(b"hub"))
            got = await ws.receive_relayed()
            assert isinstance(got, Ping) and got.payload == b"hub"
        assert trio.current_time() - start == pytest.approx(100)

    run(main)
