"""kvasir_rpc/_ws_frames.py, sans I/O: client frames from wsproto's own client fed whole, one byte at a
time and in pieces; a message gathered whole is handed out with its frame (room for a header);
any bytes parse or raise FrameError with a close code, never anything else."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wsproto.events import CloseConnection, Ping, Pong
from wsproto.frame_protocol import FrameProtocol

from kvasir_rpc._ws_frames import Data, FrameError, FrameReader, Progress, frame_header


def client_frames(*messages: tuple[bytes | str, bool]) -> bytes:
    """wsproto's masked client frames for (payload, message_finished) pairs."""
    proto = FrameProtocol(client=True, extensions=[])
    return b"".join(bytes(proto.send_data(data, fin)) for data, fin in messages)


def parse(wire: bytes, step: int | None, **kw: int) -> list[object]:
    """Feed ``wire`` in pieces of ``step`` bytes (None: whole); the events, data copied out
    (a Data's view is valid only until the next feed)."""
    reader = FrameReader(**kw)
    out: list[object] = []
    step = step or len(wire) or 1
    for i in range(0, len(wire), step):
        reader.feed(wire[i:i + step])
        while (event := reader.next_event()) is not None:
            if isinstance(event, Data):
                out.append(("data", bytes(event.payload), event.text, event.finished, event.frame is not None))
            else:
                out.append(event)
    return out


def joined(events: list[object]) -> list[tuple[bytes, bool]]:
    """The messages in ``events``: (payload, text)."""
    msgs: list[tuple[bytes, bool]] = []
    part = b""
    for e in events:
        if isinstance(e, tuple):
            part += e[1]
            if e[3]:
                msgs.append((part, e[2]))
                part = b""
    return msgs


@pytest.mark.parametrize("step", [None, 1, 7, 4096])
def test_messages_parse_whole_byte_by_byte_and_in_pieces(step: int | None) -> None:
    big = bytes(range(256)) * 400  # 102,400 bytes: a 64-bit length, gathered
    wire = client_frames((b"hello", True), ("héllo", True), (b"ab", False), (b"cd", True), (big, True), (b"", True))
    events = parse(wire, step)
    assert joined(events) == [(b"hello", False), ("héllo".encode(), True), (b"abcd", False), (big, False),
                              (b"", False)]
    assert all(isinstance(e, (tuple, Progress)) for e in events)


def test_a_single_frame_message_comes_whole_with_room_for_a_header_and_progress_before() -> None:
    payload = b"x" * 70000
    wire = client_frames((payload, True))
    reader = FrameReader(min_bytes=1024)
    reader.feed(wire[:30000])
    progress = []
    while isinstance(event := reader.next_event(), Progress):
        progress.append(event.n)
    assert event is None and sum(progress) == 30000 - 14  # 14: the header (2 + 8 + mask)
    reader.feed(wire[30000:])
    event = reader.next_event()
    assert isinstance(event, Data) and event.finished and event.frame is not None
    assert bytes(event.payload) == payload and event.fresh == len(payload) - sum(progress)
    room = len(event.frame) - len(event.payload)
    header = frame_header(2, len(payload))
    assert room == 14 >= len(header)
    event.frame[room - len(header):room] = header  # what send_held does
    assert bytes(event.frame[room - len(header):]) == header + payload


def test_a_fragmented_message_and_one_over_the_gather_size_come_in_pieces() -> None:
    events = parse(client_frames((b"a" * 5000, True)), 1000, gather_bytes=100)
    assert [e[4] for e in events if isinstance(e, tuple)] == [False] * len(events)
    assert joined(events) == [(b"a" * 5000, False)]


def test_control_frames_interleave_and_come_whole() -> None:
    proto = FrameProtocol(client=True, extensions=[])
    wire = (bytes(proto.send_data(b"ab", False)) + bytes(proto.ping(b"p")) + bytes(proto.pong(b"q"))
            + bytes(proto.send_data(b"cd", True)) + bytes(proto.close(1001, "bye")))
    for step in (None, 1):
        events = parse(wire, step)
        controls = [e for e in events if not isinstance(e, tuple)]
        assert [type(e) for e in controls] == [Ping, Pong, CloseConnection]
        assert controls[0].payload == b"p" and controls[1].payload == b"q"  # type: ignore[attr-defined]
        assert (controls[2].code, controls[2].reason) == (1001, "bye")  # type: ignore[attr-defined]
        assert joined(events) == [(b"abcd", False)]


@pytest.mark.parametrize("wire, code, words", [
    (b"\x82\x02hi", 1002, "unmasked"),
    (b"\xc2\x80abcd", 1002, "Reserved bit"),
    (b"\x83\x80abcd", 1002, "opcode"),
    (b"\x09\x80abcd", 1002, "fragment control"),
    (b"\x89\xfe\x00\x80abcd", 1002, "Control frame"),
    (b"\x82\xfe\x00\x05abcd", 1002, "2 bytes when 1"),
    (b"\x80\x80abcd", 1002, "CONTINUATION"),
    (b"\x88\x81abcd" + bytes([0x03 ^ 0x61]), 1002, "1 byte"),
    (b"\x88\x82\x00\x00\x00\x00\x03\xed", 1002, "local-only"),  # 1005
    (b"\x88\x82\x00\x00\x00\x00\x03\xe7", 1002, "invalid code"),  # 999
    (b"\x88\x84\x00\x00\x00\x00\x03\xe8\xff\xfe", 1007, "CLOSE reason"),
    (b"\x81\x82\x00\x00\x00\x00\xff\xfe", 1007, "UTF-8"),
])
def test_protocol_errors_carry_wsprotos_close_codes(wire: bytes, code: int, words: str) -> None:
    for step in (None, 1):
        with pytest.raises(FrameError) as info:
            parse(wire, step)
        assert info.value.code == code and words in str(info.value)


@given(st.binary(max_size=300), st.integers(1, 40))
def test_any_bytes_give_events_or_a_frame_error(data: bytes, step: int) -> None:
    try:
        parse(data, step)
    except FrameError as exc:
        assert exc.code in (1002, 1007)


def test_the_buffer_shrinks_back_after_bulk() -> None:
    reader = FrameReader(min_bytes=1024, max_bytes=1 << 16, gather_bytes=0)
    wire = client_frames((b"z" * 50000, True))
    at = 0
    while at < len(wire):
        room = reader.space()
        n = min(len(room), len(wire) - at)
        room[:n] = wire[at:at + n]
        reader.filled(n)
        at += n
        while reader.next_event() is not None:
            pass
    assert len(reader.space()) > 1024  # grew while reads filled it
    small = client_frames((b"s", True))
    reader.space()[:len(small)] = small
    reader.filled(len(small))
    assert len(reader.space()) + len(small) == 1024  # a small read into the empty buffer: back to the minimum
