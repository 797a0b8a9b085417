"""The vectorised masker is byte-for-byte wsproto's, across calls (key rotation), and so
are the frames of the one-buffer serializer."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto.frame_protocol import XorMaskerSimple

from kvasir_rpc._fastmask import NumpyXorMasker


@settings(max_examples=300, deadline=None)
@given(key=st.binary(min_size=4, max_size=4), chunks=st.lists(st.binary(max_size=70), max_size=8))
def test_same_bytes_as_wsproto(key, chunks):
    ours, theirs = NumpyXorMasker(key), XorMaskerSimple(key)
    for chunk in chunks:
        assert ours.process(chunk) == theirs.process(bytearray(chunk))


def test_large_and_unaligned():
    key = b"\x01\x80\xff\x10"
    data = bytes(range(256)) * 4097 + b"abc"
    ours, theirs = NumpyXorMasker(key), XorMaskerSimple(key)
    assert ours.process(memoryview(data)[1:]) == theirs.process(bytearray(data[1:]))
    assert ours.process(data) == theirs.process(bytearray(data))


@settings(max_examples=300, deadline=None)
@given(payload=st.one_of(st.binary(max_size=300), st.sampled_from([b"x" * 65535, b"y" * 65536, b"z" * 70001])),
       client=st.booleans(), fin=st.booleans(), text=st.booleans(), key=st.binary(min_size=4, max_size=4))
def test_serializer_writes_wsproto_frames_byte_for_byte(payload, client, fin, text, key):
    import pytest
    from wsproto import frame_protocol

    from kvasir_rpc import _fastmask

    proto = frame_protocol.FrameProtocol(client=client, extensions=[])
    opcode = frame_protocol.Opcode.TEXT if text else frame_protocol.Opcode.BINARY
    original = _fastmask._wsproto_serialize_frame or frame_protocol.FrameProtocol._serialize_frame
    with pytest.MonkeyPatch.context() as mp:  # the same masking key on both sides
        mp.setattr(frame_protocol.os, "urandom", lambda n: key)
        mp.setattr(_fastmask.os, "urandom", lambda n: key)
        assert _fastmask.serialize_frame(proto, opcode, payload, fin) == original(proto, opcode, payload, fin)


def test_serializer_refuses_long_control_frames_like_wsproto():
    import pytest
    from wsproto import frame_protocol

    from kvasir_rpc._fastmask import serialize_frame

    proto = frame_protocol.FrameProtocol(client=True, extensions=[])
    with pytest.raises(ValueError, match="control frame"):
        serialize_frame(proto, frame_protocol.Opcode.PING, b"p" * 126)
    assert serialize_frame(proto, frame_protocol.Opcode.PING, b"p" * 125)[1] == 0x80 | 125


def _decode_all(process, decoder, chunks):
    frames = []
    for chunk in chunks:
        decoder.receive_bytes(chunk)
        while (frame := process(decoder)) is not None:
            frames.append(frame)
    return frames


@settings(max_examples=200, deadline=None)
@given(payloads=st.lists(st.one_of(st.binary(max_size=200), st.sampled_from([b"x" * 65536, bytes(range(256)) * 300])),
                         min_size=1, max_size=4),
       client=st.booleans(), cuts=st.lists(st.integers(min_value=1, max_value=70000), max_size=12),
       key=st.binary(min_size=4, max_size=4))
def test_decoder_gives_wsproto_frames_from_any_chunking(payloads, client, cuts, key):
    """The in-place decoder yields wsproto's frames (same payloads, boundaries, flags) for
    masked (server side) and unmasked (client side) frames cut anywhere."""
    import pytest
    from wsproto import frame_protocol

    from kvasir_rpc import _fastmask

    sender = frame_protocol.FrameProtocol(client=not client, extensions=[])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_fastmask.os, "urandom", lambda n: key)
        wire = b"".join(_fastmask.serialize_frame(sender, frame_protocol.Opcode.BINARY, p) for p in payloads)
    chunks, at = [], 0
    for cut in cuts:
        chunks.append(wire[at : at + cut])
        at += cut
    chunks.append(wire[at:])
    original = _fastmask._wsproto_process_buffer or frame_protocol.FrameDecoder.process_buffer
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(frame_protocol, "XorMaskerSimple", _fastmask.NumpyXorMasker)
        ours = _decode_all(_fastmask.process_buffer, frame_protocol.FrameDecoder(client=client, extensions=[]), chunks)
        theirs = _decode_all(original, frame_protocol.FrameDecoder(client=client, extensions=[]), chunks)
    assert ours == theirs
    assert all(type(f.payload) is bytes for f in ours)
    assert b"".join(f.payload for f in ours) == b"".join(payloads)


def test_installed_sends_are_wsproto_bytes():
    """With everything installed, a WebSocket message still goes out as the same frame."""
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, BytesMessage, Request

    from kvasir_rpc._fastmask import install_fast_masking

    install_fast_masking()
    client, server = WSConnection(ConnectionType.CLIENT), WSConnection(ConnectionType.SERVER)
    server.receive_data(client.send(Request(host="h", target="/")))
    list(server.events())
    client.receive_data(server.send(AcceptConnection()))
    list(client.events())
    for sender, receiver in ((client, server), (server, client)):
        payload = bytes(range(256)) * 5000 + b"tail"
        receiver.receive_data(bytes(sender.send(BytesMessage(data=payload))))
        got = b"".join(e.data for e in receiver.events())
        assert got == payload
