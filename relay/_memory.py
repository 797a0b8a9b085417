"""Make the relays' memory follow what they hold, on glibc.

What a peer makes a relay hold (an unfinished message, a hello) is dropped again, and the
relay's RSS should fall with it. glibc does not do that by default: blocks under its mmap
threshold come from the heap, and freed ones between live ones stay in the process; worse,
the threshold rises (up to 32 MiB) each time a large mapped block is freed, so the next
4 MiB buffers land in the heap too. Measured in the gateway with 20 unfinished 4 MiB
messages, RSS kept +42 MiB after every connection had closed.

``tune_allocator`` fixes the threshold (fixing it also stops it rising), so every buffer of
``MMAP_THRESHOLD`` or more lives in a mapping of its own and goes back to the system when
freed; ``Trimmer`` gives back the heap's free pages (``malloc_trim``) after a relay has
dropped many bytes, at most once per interval (what is left there: fragments under the
threshold, reads, wsproto's buffers). Both do nothing where the C library is not
glibc. Called from each relay's ``main`` (imports have no side effects).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import sys

import trio

__all__ = ["MMAP_THRESHOLD", "Trimmer", "TrimStats", "trim", "tune_allocator"]

MMAP_THRESHOLD = 128 << 10  # glibc's default start; below it a message fragment, above it a buffer
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def tune_allocator(mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve every allocation of ``mmap_threshold`` bytes or more from its own mapping, for
    good. True if the C library took it (glibc), False elsewhere (nothing changes)."""
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold)))


def trim() -> bool:
    """Give the heap's free pages back to the system; True if any were. False without glibc."""
    if _LIBC is None:
        return False
    return bool(_LIBC.malloc_trim(ctypes.c_size_t(0)))


@dataclasses.dataclass(frozen=True)
class TrimStats:
    """``trims``: malloc_trim calls made; ``dropped_since``: bytes dropped since the last."""

    trims: int
    dropped_since: int


class Trimmer:
    """Calls ``trim`` at most every ``interval_s``, and only once ``dropped`` has been told of
    at least ``min_bytes`` since the last trim: a relay that drops nothing never walks its heap."""

    def __init__(self, *, interval_s: float = 1.0, min_bytes: int = 1 << 20) -> None:
        self.interval_s = interval_s
        self.min_bytes = min_bytes
        self._dropped = 0
        self._trims = 0

    def dropped(self, n: int) -> None:
        """``n`` bytes a peer made us hold were just freed."""
        self._dropped += n

    def statistics(self) -> TrimStats:
        return TrimStats(trims=self._trims, dropped_since=self._dropped)

    async def run(self) -> None:
        """Trim when due, until cancelled."""
        while True:
            await trio.sleep(self.interval_s)
            if self._dropped >= self.min_bytes:
                self._dropped = 0
                self._trims += 1
                trim()
