"""A vectorised WebSocket masker for wsproto.

Every client-to-server WebSocket frame is XOR-masked (RFC 6455 section 5.3), and wsproto
does it in pure Python: about 16 ms per 4 MiB here, on both ends of every masked hop, which
was half the time of a batch-512 expert call through the gateway. ``install_fast_masking()`` swaps in a
numpy XOR over a uint32 view (well under a millisecond for 4 MiB) with the same behaviour,
key rotation across calls included. Call it from main(); importing this module changes
nothing.

On receipt, frames are unmasked in place and their payload copied once
(``process_buffer``). It also swaps wsproto's frame serializer for one that builds each frame in one buffer:
wsproto's copies the payload five or six times (bytearray, mask, concatenations), which
was a fifth of the hub's CPU at batch 512. Frames are byte for byte wsproto's (same
header rules, a fresh random key per masked frame); with extensions negotiated, wsproto's
own serializer runs. wsproto's ``send`` then copied each frame once more (``b"" +
bytearray``, twice nested): the installed ``send`` hands the serializer's buffer on as it is.

And it keeps freed memory for reuse (glibc only): a relay moving 1 MiB messages allocates
and frees buffers of about that size many times a second, and with glibc's default,
adaptive thresholds the heap's top was given back to the system and faulted in again for
nearly every message, which was a third of the hub's CPU per byte at batch 512
(``keep_freed_memory``). The relays' ``Trimmer`` still gives free pages back after large
drops and periodically.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import sys
from collections.abc import Callable

import numpy as np

__all__ = ["NumpyXorMasker", "install_fast_masking", "keep_freed_memory", "serialize_frame", "xor_mask_into"]

_MAX_PAYLOAD_NORMAL = 125
_MAX_PAYLOAD_TWO_BYTE = 2**16 - 1


def xor_mask_into(data: bytes | bytearray | memoryview, key: bytes, out: memoryview) -> None:
    """out[i] = data[i] ^ key[i % 4], for len(data) bytes: WebSocket masking and unmasking
    (RFC 6455 5.3), numpy over uint32 words; ``out`` may be ``data`` itself (in place)."""
    n = len(data)
    words = n // 4
    if words:
        k32 = np.frombuffer(key, dtype=np.uint32)[0]
        np.bitwise_xor(np.frombuffer(data, dtype=np.uint32, count=words), k32,
                       out=np.frombuffer(out, dtype=np.uint32, count=words))
    for i in range(words * 4, n):
        out[i] = data[i] ^ key[i % 4]


class NumpyXorMasker:
    """Drop-in for ``wsproto.frame_protocol.XorMaskerSimple``: ``process(data) -> bytearray``."""

    def __init__(self, masking_key: bytes | bytearray) -> None:
        self._masking_key = bytes(masking_key)

    def process(self, data: bytes | bytearray) -> bytearray:
        n = len(data)
        out = bytearray(n)
        if not n:
            return out
        key = self._masking_key
        xor_mask_into(data, key, memoryview(out))
        self._rotate(n)
        return out

    def process_in_place(self, data: memoryview) -> None:
        """Unmask (or mask) ``data``, a writable byte view, where it lies."""
        n = len(data)
        if n:
            xor_mask_into(data, self._masking_key, data)
            self._rotate(n)

    def _rotate(self, n: int) -> None:
        rotation = n % 4
        key = self._masking_key
        self._masking_key = key[rotation:] + key[:rotation]


def serialize_frame(self, opcode, payload: bytes | bytearray | memoryview = b"", fin: bool = True) -> bytearray:  # type: ignore[no-untyped-def]
    """``FrameProtocol._serialize_frame`` in one buffer (see the module doc)."""
    if self.extensions:
        assert _wsproto_serialize_frame is not None
        return _wsproto_serialize_frame(self, opcode, bytes(payload), fin)
    n = len(payload)
    first = (int(fin) << 7) | int(opcode)
    mask_bit = 0x80 if self.client else 0
    if n <= _MAX_PAYLOAD_NORMAL:
        header = bytes((first, n | mask_bit))
    else:
        if opcode.iscontrol():
            raise ValueError("payload too long for control frame")
        if n <= _MAX_PAYLOAD_TWO_BYTE:
            header = struct.pack("!BBH", first, 126 | mask_bit, n)
        else:
            header = struct.pack("!BBQ", first, 127 | mask_bit, n)
    h = len(header)
    if not self.client:
        out = bytearray(header)
        out += payload  # one copy, no zero-filling first
        return out
    key = os.urandom(4)  # a fresh unpredictable key per frame (RFC 6455 section 5.3)
    out = bytearray(h + 4 + n)
    out[:h] = header
    out[h : h + 4] = key
    xor_mask_into(payload, key, memoryview(out)[h + 4 :])
    return out


def process_buffer(self):  # type: ignore[no-untyped-def]
    """``FrameDecoder.process_buffer`` with one copy of the payload instead of three or four.

    wsproto slices the payload out of its buffer (a copy), unmasks it into a new bytearray (a
    copy) and makes that bytes (a copy). Here the payload is unmasked in place in the buffer
    (what was consumed is not read again) and copied once into the frame's bytes. The frames,
    their boundaries and the errors are wsproto's; with extensions negotiated, or a masker
    other than ours, wsproto's own runs."""
    from wsproto.frame_protocol import Frame, Opcode, XorMaskerNull

    if self.extensions:
        assert _wsproto_process_buffer is not None
        return _wsproto_process_buffer(self)
    if not self.header and not self.parse_header():
        return None
    assert self.header is not None and self.effective_opcode is not None
    masker = self.masker
    if not isinstance(masker, (NumpyXorMasker, XorMaskerNull)):
        assert _wsproto_process_buffer is not None
        return _wsproto_process_buffer(self)
    buf = self.buffer
    if len(buf) < self.payload_required:
        return None
    start = buf.bytes_used
    k = min(self.header.payload_len - self.payload_consumed, len(buf.buffer) - start)
    if k <= 0 and self.header.payload_len > 0:
        return None
    with memoryview(buf.buffer) as whole, whole[start : start + k] as view:
        if isinstance(masker, NumpyXorMasker):
            masker.process_in_place(view)
        payload = bytes(view)
    buf.bytes_used += k
    buf.commit()
    self.payload_consumed += k
    finished = self.payload_consumed == self.header.payload_len
    frame = Frame(self.effective_opcode, payload, finished, self.header.fin)
    if finished:
        self.header = None
        self.effective_opcode = None
        self.masker = None
    else:
        self.effective_opcode = Opcode.CONTINUATION
    return frame


_wsproto_process_buffer: Callable[..., object] | None = None
_wsproto_serialize_frame: Callable[..., bytearray] | None = None
_wsproto_connection_send: Callable[..., bytes] | None = None
_wsproto_ws_send: Callable[..., bytes] | None = None
_Message: type = type(None)  # wsproto's Message and ConnectionState.OPEN, once installed
_OPEN: object = None


def _connection_send(self, event):  # type: ignore[no-untyped-def]
    """``wsproto.connection.Connection.send`` without its copy of each data frame
    (``data = b""; data += frame``): a message's frame is returned as the serializer built it."""
    if isinstance(event, _Message) and self.state is _OPEN:
        return self._proto.send_data(event.data, event.message_finished)
    assert _wsproto_connection_send is not None
    return _wsproto_connection_send(self, event)


def _ws_send(self, event):  # type: ignore[no-untyped-def]
    """``wsproto.WSConnection.send``, likewise without copying what the connection returns."""
    if self.connection is not None:
        return self.connection.send(event)
    assert _wsproto_ws_send is not None
    return _wsproto_ws_send(self, event)


# glibc's mallopt parameters and the values keep_freed_memory sets: buffers up to 32 MiB come
# from the heap (a tunnel message is at most MAX_MESSAGE_BYTES, 4 MiB), and up to 64 MiB
# free at the heap's top stays in the process instead of being unmapped at each free().
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 64 << 20


def keep_freed_memory() -> bool:
    """Have glibc keep freed heap memory (up to 64 MiB at the heap's top) and serve buffers
    up to 32 MiB from the heap, so large buffers freed and allocated again are reused rather
    than given back and faulted in anew. True if set (glibc on Linux); elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


def install_fast_masking() -> None:
    """Make wsproto use NumpyXorMasker, serialize_frame and the copy-free sends from now on,
    and keep freed memory for reuse (``keep_freed_memory``)."""
    global _wsproto_serialize_frame, _wsproto_connection_send, _wsproto_ws_send, _wsproto_process_buffer, _Message, _OPEN
    import wsproto
    from wsproto import connection, frame_protocol

    frame_protocol.XorMaskerSimple = NumpyXorMasker  # type: ignore[misc,assignment]
    if _wsproto_serialize_frame is None:
        _wsproto_serialize_frame = frame_protocol.FrameProtocol._serialize_frame  # type: ignore[assignment]
        frame_protocol.FrameProtocol._serialize_frame = serialize_frame  # type: ignore[method-assign]
    if _wsproto_process_buffer is None:
        _wsproto_process_buffer = frame_protocol.FrameDecoder.process_buffer
        frame_protocol.FrameDecoder.process_buffer = process_buffer  # type: ignore[method-assign]
    if _wsproto_connection_send is None:
        from wsproto.events import Message

        _Message, _OPEN = Message, connection.ConnectionState.OPEN
        _wsproto_connection_send = connection.Connection.send
        connection.Connection.send = _connection_send  # type: ignore[method-assign]
        _wsproto_ws_send = wsproto.WSConnection.send
        wsproto.WSConnection.send = _ws_send  # type: ignore[method-assign]
    keep_freed_memory()
