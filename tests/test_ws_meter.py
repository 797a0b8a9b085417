"""What a worker can make the hub's WebSocket library hold, in memory and on a fake clock:
``FrameMeter`` follows client frames fed in any pieces, ``MeteredStream`` enforces the
shared budget (4208), the message deadline (4209) and the hello's allowance (1009) with its
own close frame, and ``UpgradeIntake`` bounds the connections it screens and asks the
server's ``admit`` before handing one on. tests/test_hub_limits.py does the same to a real hub.
"""

from __future__ import annotations

import os
import struct

import pytest
import structlog
import trio
import trio.testing
from probes import GOOD
from structlog.testing import capture_logs

from relay._intake import Refusal, UpgradeIntake
from relay._refusals import RefusalLog
from kvasir_rpc import MessageBudget
from relay.hub._ws_meter import FrameMeter, MeteredStream

BUDGET_S = 60.0


def frame(opcode: int, payload: bytes, *, fin: bool = True) -> bytes:
    """One masked client frame (RFC 6455 5.2)."""
    n = len(payload)
    head = bytes([(0x80 if fin else 0) | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 1 << 16:
        head += bytes([0x80 | 126]) + struct.pack("!H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", n)
    mask = os.urandom(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def feed_in(meter: FrameMeter, data: bytes, piece: int) -> None:
    for i in range(0, len(data), piece):
        meter.feed(data[i:i + piece])


@pytest.mark.parametrize("piece", [1, 7, 1 << 20])
def test_the_meter_follows_fragments_control_frames_and_every_length_form(piece: int) -> None:
    meter = FrameMeter()
    big = bytes(70_000)  # a 64-bit length
    feed_in(meter, frame(0x2, b"a" * 300, fin=False), piece)  # a 16-bit length
    assert meter.in_message and meter.message_bytes == 300 and meter.messages == 1
    feed_in(meter, frame(0x9, b"ping"), piece)  # a ping inside the message counts for nothing
    feed_in(meter, frame(0x0, big, fin=False), piece)
    assert meter.in_message and meter.message_bytes == 300 + len(big)
    feed_in(meter, frame(0x0, b"end"), piece)
    assert not meter.in_message and meter.message_bytes == 0
    feed_in(meter, frame(0x1, b"text") + frame(0x2, b"half", fin=False), piece)
    assert meter.in_message and meter.message_bytes == 4 and meter.messages == 3
    assert meter.data_bytes == 300 + len(big) + 3 + 4 + 4 and not meter.lost


def test_the_meter_stops_counting_at_a_continuation_out_of_place() -> None:
    meter = FrameMeter()
    meter.feed(frame(0x0, b"orphan") + frame(0x2, b"x" * 10))
    assert meter.lost and meter.data_bytes == 0


async def _read_close(client: trio.abc.Stream, head: bytes = b"") -> tuple[int, str]:
    """The server's close frame (unmasked, as MeteredStream writes it; ``head``: its first
    bytes if already read), then EOF."""
    data = head
    while chunk := await client.receive_some(1 << 16):
        data += chunk
    if not head:
        assert data[0] == 0x88, data[:20]
        code = struct.unpack("!H", data[2:4])[0]
        return code, data[4:2 + data[1]].decode()
    code = struct.unpack("!H", data[2:4])[0]
    return code, data[4:].decode()


def _metered(budget: MessageBudget, **kw):  # type: ignore[no-untyped-def]
    client, server = trio.testing.memory_stream_pair()
    refusals = RefusalLog(structlog.get_logger("test"))
    return client, MeteredStream(server, "203.0.113.7:1", budget, refusals, **kw), refusals


async def _drain(stream: MeteredStream) -> None:
    while await stream.receive_some(1 << 16):
        pass


def test_the_budget_is_shared_and_a_message_past_it_is_closed_4208() -> None:
    async def main() -> None:
        budget = MessageBudget(100_000, 30.0)
        c1, s1, _ = _metered(budget, hello_limit=1 << 30)
        c2, s2, r2 = _metered(budget, hello_limit=1 << 30)
        with trio.fail_after(BUDGET_S):
            await c1.send_all(frame(0x2, bytes(60_000), fin=False))
            assert len(await s1.receive_some(1 << 20)) > 0
            assert budget.statistics().buffered == 60_000
            await c2.send_all(frame(0x2, bytes(60_000), fin=False))
            with pytest.raises(trio.BrokenResourceError, match="4208"):
                await s2.receive_some(1 << 20)
            assert await _read_close(c2) == (4208, "the hub holds too many unfinished messages; try again later")
            assert r2.counts() == {"buffer_full": 1} and budget.statistics().refused_buffer == 1
            await c1.send_all(frame(0x0, b"done"))  # finished: whole, it leaves the budget
            await s1.receive_some(1 << 20)
            assert budget.statistics().buffered == 0
            await c1.send_all(frame(0x2, bytes(90_000), fin=False))  # room again
            while budget.statistics().buffered < 90_000:
                await s1.receive_some(1 << 20)
            await s1.aclose()
            assert budget.statistics().buffered == 0  # given back when the stream ends

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_message_left_unfinished_is_closed_4209_at_its_deadline() -> None:
    async def main() -> None:
        budget = MessageBudget(1 << 20, 5.0)
        client, stream, refusals = _metered(budget, hello_limit=1 << 30)
        with trio.fail_after(BUDGET_S):
            await client.send_all(frame(0x2, b"complete") + frame(0x2, b"started", fin=False))
            t0 = trio.current_time()
            await stream.receive_some(1 << 20)

            async def hub_side() -> None:
                with pytest.raises(trio.BrokenResourceError, match="4209"):
                    await _drain(stream)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(hub_side)
                first = await client.receive_some(2)  # the close frame goes out at the deadline
                assert trio.current_time() - t0 == pytest.approx(5.0)
                got = await _read_close(client, first)  # the hub waits CLOSE_WRITE_S for us to hang up
            assert first[0] == 0x88 and got == (4209, "message not finished within 5 s")
        assert refusals.counts() == {"message_deadline": 1} and budget.statistics().buffered == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_before_its_session_is_accepted_a_connection_sends_one_hello_s_worth() -> None:
    async def main() -> None:
        ended: list[str] = []
        with trio.fail_after(BUDGET_S):
            client, stream, refusals = _metered(MessageBudget(1 << 30, 30.0), hello_limit=1000,
                                                on_end=lambda: ended.append("end"))
            await client.send_all(frame(0x2, bytes(600)) + frame(0x2, bytes(600)))
            with capture_logs() as logs, pytest.raises(trio.BrokenResourceError, match="1009"):
                await _drain(stream)
            assert await _read_close(client) == (1009, "at most 1000 bytes may come before the session is accepted")
            assert refusals.counts() == {"hello_too_big": 1} and ended == ["end"]
            assert [e["reason"] for e in logs] == ["hello_too_big"]
            # Once accepted, only the budget and the deadline apply; on_end is called once.
            client, stream, _ = _metered(MessageBudget(1 << 30, 30.0), hello_limit=1000,
                                         on_end=lambda: ended.append("end"))
            await client.send_all(frame(0x2, bytes(600)))
            await stream.receive_some(1 << 20)
            stream.verified()
            await client.send_all(frame(0x2, bytes(5000)))
            got = 0
            while got < 5000:
                got += len(await stream.receive_some(1 << 20))
            await stream.aclose()
            assert ended == ["end", "end"]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_intake_screens_a_bounded_number_and_a_flood_of_silent_connections_keeps_nobody_out() -> None:
    """20 silent connections against max_screening=4: 16 are crowded out (counted, one line
    each within the log's allowance), and a good upgrade behind them is handed on at once."""

    async def main() -> None:
        refusals = RefusalLog(structlog.get_logger("test"))
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        intake = UpgradeIntake(listeners, refusals, timeout_s=30.0, max_screening=4)
        port = intake.port
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                await nursery.start(intake.serve)
                silent = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(20)]
                closed = 0
                for s in silent[:16]:  # the oldest are closed to make room
                    closed += await s.receive_some(10) == b""
                assert closed == 16 and intake.screening <= 4
                good = await trio.open_tcp_stream("127.0.0.1", port)
                await good.send_all(GOOD)
                handed = await intake.accept()
                assert (await handed.receive_some(1 << 16)).startswith(b"GET /v1/worker")
                assert refusals.counts()["crowded_out"] >= 16
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_intake_answers_503_when_the_server_says_it_is_full() -> None:
    async def main() -> None:
        refusals = RefusalLog(structlog.get_logger("test"))
        full = Refusal("capacity", 503, "the hub holds its most sessions (2); retry later", (("retry-after", "5"),))
        intake = UpgradeIntake([object()], refusals, timeout_s=5.0,  # type: ignore[list-item]
                               admit=lambda req, remote: full)
        client, server = trio.testing.memory_stream_pair()
        with trio.fail_after(BUDGET_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(intake.screen, server, "203.0.113.7:1")
                await client.send_all(GOOD)
                answer = b""
                while chunk := await client.receive_some(1 << 16):
                    answer += chunk
        assert answer.startswith(b"HTTP/1.1 503 ") and b"retry-after: 5" in answer
        assert answer.endswith(b"the hub holds its most sessions (2); retry later\n")
        assert refusals.counts() == {"capacity": 1}

    trio.run(main)


def test_the_intake_tells_the_wrapper_where_the_frames_begin() -> None:
    async def main() -> None:
        refusals = RefusalLog(structlog.get_logger("test"))
        heads: list[int] = []

        def wrap(stream: trio.abc.Stream, remote: str, head_bytes: int) -> trio.abc.Stream:
            heads.append(head_bytes)
            return stream

        intake = UpgradeIntake([object()], refusals, timeout_s=5.0, wrap=wrap)  # type: ignore[list-item]
        client, server = trio.testing.memory_stream_pair()
        with trio.fail_after(BUDGET_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(intake.screen, server, "203.0.113.7:1")
                await client.send_all(GOOD + frame(0x2, b"hello"))  # the first frame with the head
                handed = await intake.accept()
                meter, got = FrameMeter(), b""
                while len(got) < len(GOOD) + 11:
                    got += await handed.receive_some(1 << 16)
                meter.feed(got[heads[0]:])
        assert heads == [len(GOOD)] and meter.data_bytes == 5 and not meter.in_message

    trio.run(main)


def test_the_hub_admits_within_its_caps_and_refuses_a_hello_past_max_sessions_4204() -> None:
    from kvasir_rpc import RemoteProtocolError, Wallet
    from relay.hub._registry import SessionRegistry
    from relay.hub._sessions import HubConfig, _Hub

    async def main() -> None:
        hub = _Hub(HubConfig(max_sessions=2, max_pending=1), Wallet.generate(), SessionRegistry())
        client, server = trio.testing.memory_stream_pair()
        assert hub.admit(None, "10.0.0.1:1") is None  # type: ignore[arg-type]
        pending = hub.wrap(server, "10.0.0.1:1", 0)
        full = hub.admit(None, "10.0.0.2:1")  # type: ignore[arg-type]
        assert full is not None and (full.reason, full.status) == ("pending_full", 503)
        pending.verified()  # its hello is verified: the place is free again
        assert hub.admit(None, "10.0.0.2:1") is None  # type: ignore[arg-type]
        hub._hold("wallet-a", "10.0.0.1")
        hub._hold("wallet-b", "10.0.0.2")
        full = hub.admit(None, "10.0.0.3:1")  # type: ignore[arg-type]
        assert full is not None and (full.reason, full.status) == ("capacity", 503)
        with pytest.raises(RemoteProtocolError) as exc:
            hub._hold("wallet-c", "10.0.0.3")  # a hello verified after the intake let it in
        assert exc.value.close_code == 4204  # CloseCode.HUB_FULL: retry later
        assert exc.value.reason == "the hub holds its most sessions (2); try again later"
        hub._release("wallet-a", "10.0.0.1")
        hub._hold("wallet-c", "10.0.0.3")
        await pending.aclose()

    trio.run(main)
