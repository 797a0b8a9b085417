"""``kvasir_rpc._sockio``: pieces written as one with ``writev`` straight to a trio socket (the
socket full, a peer gone, a socket closed here), receives into the caller's buffer, and a
WebSocket's message sent as pieces read back whole by wsproto. Real sockets, bounded waits."""

from __future__ import annotations

import os
import socket

import pytest
import trio
import trio.testing
from wsproto.frame_protocol import FrameProtocol

from kvasir_rpc import WebSocket, read_into, write_parts

BUDGET_S = 20


def trio_test(fn):  # type: ignore[no-untyped-def]
    """Run the async test under trio (the project runs its async tests so, no plugin)."""
    def run() -> None:
        trio.run(fn)

    run.__name__ = fn.__name__
    return run


def _pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = socket.socketpair()
    return trio.SocketStream(trio.socket.from_stdlib_socket(a)), trio.SocketStream(trio.socket.from_stdlib_socket(b))


async def _read_all(stream: trio.SocketStream, n: int) -> bytes:
    got = bytearray()
    buf = memoryview(bytearray(100_000))
    while len(got) < n:
        k = await read_into(stream, buf)
        if not k:
            break
        got += buf[:k]
    return bytes(got)


@trio_test
async def test_pieces_larger_than_the_socket_arrive_whole_and_in_order() -> None:
    # Several MiB against a socket buffer of a few hundred KiB: partial writes and waits.
    pieces = (b"\x00\x01", os.urandom(3_000_001), memoryview(os.urandom(1_500_003))[7:], bytearray(b"tail"))
    want = b"".join(bytes(p) for p in pieces)
    a, b = _pair()
    got: list[bytes] = []
    with trio.fail_after(BUDGET_S):
        async with a, b, trio.open_nursery() as nursery:
            async def reader() -> None:
                got.append(await _read_all(b, len(want)))

            nursery.start_soon(reader)
            await write_parts(a, pieces)
    assert got == [want]


@trio_test
async def test_a_writer_that_finds_room_does_not_switch_tasks() -> None:
    a, b = _pair()
    switched = []
    with trio.fail_after(BUDGET_S):
        async with a, b, trio.open_nursery() as nursery:
            async def other() -> None:
                switched.append(True)

            nursery.start_soon(other)
            await write_parts(a, (b"head", b"body"))  # a few bytes: the socket takes them at once
            assert not switched
            await trio.testing.wait_all_tasks_blocked()
            assert switched
            assert await _read_all(b, 8) == b"headbody"


@trio_test
async def test_a_peer_gone_is_a_broken_stream_and_a_socket_closed_here_a_closed_one() -> None:
    a, b = _pair()
    with trio.fail_after(BUDGET_S):
        await b.aclose()
        with pytest.raises(trio.BrokenResourceError):
            await write_parts(a, (b"x" * 1000,))
        await a.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await write_parts(a, (b"x",))
        with pytest.raises(trio.ClosedResourceError):
            await read_into(a, memoryview(bytearray(10)))


@trio_test
async def test_a_writer_blocked_on_a_full_socket_fails_when_the_socket_is_closed_under_it() -> None:
    a, b = _pair()
    with trio.fail_after(BUDGET_S):
        async with b, trio.open_nursery() as nursery:
            errors: list[BaseException] = []

            async def writer() -> None:
                try:
                    await write_parts(a, (bytes(8 << 20),))  # nobody reads: it waits for room
                except trio.ClosedResourceError as exc:
                    errors.append(exc)

            nursery.start_soon(writer)
            await trio.sleep(0.2)
            await a.aclose()
        assert len(errors) == 1


@trio_test
async def test_read_into_the_buffer_and_zero_at_the_end() -> None:
    a, b = _pair()
    with trio.fail_after(BUDGET_S):
        async with b:
            await a.send_all(b"hello")
            await a.aclose()
            buf = memoryview(bytearray(16))
            assert await read_into(b, buf) == 5 and bytes(buf[:5]) == b"hello"
            assert await read_into(b, buf) == 0


@trio_test
async def test_a_message_sent_as_pieces_is_one_frame_to_wsproto() -> None:
    a, b = _pair()
    pieces = (b"\x00\x03", os.urandom(200_000), b"", b"end")
    with trio.fail_after(BUDGET_S):
        async with b:
            ws = WebSocket(a, max_message_bytes=1 << 20, keepalive_s=60, idle_timeout_s=60)
            async with trio.open_nursery() as nursery:
                raw: list[bytes] = []

                async def reader() -> None:
                    raw.append(await _read_all(b, 2 + 8 + sum(len(p) for p in pieces)))

                nursery.start_soon(reader)
                await ws.send_message(pieces)
            await ws.close()
    client = FrameProtocol(client=True, extensions=[])
    client.receive_bytes(raw[0])
    frames = list(client.received_frames())
    assert len(frames) == 1 and frames[0].message_finished
    assert frames[0].payload == b"".join(pieces)


@trio_test
async def test_a_send_cancelled_mid_frame_leaves_the_websocket_unusable_not_corrupt() -> None:
    from kvasir_rpc import WsClosed

    a, b = _pair()
    async with b:
        ws = WebSocket(a, max_message_bytes=64 << 20, keepalive_s=60, idle_timeout_s=60)
        with trio.move_on_after(0.3) as scope:  # nobody reads: part of the frame goes, then it waits
            await ws.send_message(bytes(16 << 20))
        assert scope.cancelled_caught
        with pytest.raises(WsClosed, match="mid-frame"), trio.fail_after(BUDGET_S):
            await ws.send_message(b"next")  # would be read as the rest of the cut frame
        await ws.close()


@trio_test
async def test_a_shielded_send_outlives_its_callers_cancellation_and_is_bounded() -> None:
    from kvasir_rpc import WsClosed

    a, b = _pair()
    async with b:
        ws = WebSocket(a, max_message_bytes=64 << 20, keepalive_s=60, idle_timeout_s=60)
        with trio.fail_after(BUDGET_S):
            with trio.CancelScope() as scope:
                scope.cancel()  # cancelled before it starts: the message still goes out whole
                sent = await ws.send_message(b"whole", shielded_for=5)
            assert sent and not scope.cancelled_caught  # the send itself never checkpoints here
            assert await _read_all(b, 2 + 5) == b"\x82\x05whole"
            # Nobody reads 16 MiB: past shielded_for it gives up, and the WebSocket is unusable.
            assert await ws.send_message(bytes(16 << 20), shielded_for=0.3) is False
            with pytest.raises(WsClosed, match="could not be sent within"):
                await ws.send_message(b"next")
        await ws.close()


@trio_test
async def test_a_read_buffer_grows_while_reads_fill_it_and_falls_back_after_small_ones() -> None:
    from kvasir_rpc import ReadBuffer

    a, b = _pair()
    reads = ReadBuffer(min_bytes=1024, max_bytes=8192)
    with trio.fail_after(BUDGET_S):
        async with a, b:
            sizes = []
            await a.send_all(os.urandom(64 << 10))  # in bulk: 1 KiB, 2, 4, then 8 KiB reads at most
            for _ in range(5):
                got = await reads.receive(b)
                assert got.readonly
                sizes.append(len(got))
            assert sizes[:4] == [1024, 2048, 4096, 8192] and sizes[4] == 8192
            while len(await reads.receive(b)) == 8192:
                pass  # the rest of the 64 KiB
            await a.send_all(b"x" * 10)  # a small read into the big buffer: back to 1 KiB after it
            assert bytes(await reads.receive(b)) == b"x" * 10
            await a.send_all(os.urandom(5000))
            assert len(await reads.receive(b)) == 1024
            await a.aclose()
            while len(await reads.receive(b)):
                pass  # the rest, then EOF: an empty view
