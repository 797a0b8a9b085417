"""A vectorised WebSocket masker for wsproto.

Every client-to-server WebSocket frame is XOR-masked (RFC 6455 section 5.3), and wsproto
does it in pure Python: about 16 ms per 4 MiB here, on both ends of every masked hop, which
was half the time of a batch-512 expert call through the gateway. ``install()`` swaps in a
numpy XOR over a uint32 view (well under a millisecond for 4 MiB) with the same behaviour,
key rotation across calls included. Call it from main(); importing this module changes
nothing.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NumpyXorMasker", "install"]


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
        words = n // 4
        if words:
            k32 = np.frombuffer(key, dtype=np.uint32)[0]
            np.bitwise_xor(
                np.frombuffer(data, dtype=np.uint32, count=words),
                k32,
                out=np.frombuffer(out, dtype=np.uint32, count=words),
            )
        for i in range(words * 4, n):
            out[i] = data[i] ^ key[i % 4]
        rotation = n % 4
        self._masking_key = key[rotation:] + key[:rotation]
        return out


def install() -> None:
    """Make wsproto use NumpyXorMasker for every connection made after this call."""
    from wsproto import frame_protocol

    frame_protocol.XorMaskerSimple = NumpyXorMasker  # type: ignore[misc,assignment]
