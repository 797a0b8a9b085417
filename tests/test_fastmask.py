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
