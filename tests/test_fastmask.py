"""The vectorised masker is byte-for-byte wsproto's, across calls (key rotation)."""

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
