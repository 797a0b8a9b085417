"""Make the relays' memory follow what they hold, on glibc.

What a peer makes a relay hold (an unfinished message, a hello) is dropped again, and the
relay's RSS should fall with it. glibc keeps freed heap blocks in the process, and pages
of them between live blocks stay resident: ``Trimmer`` gives the heap's free pages back
(``malloc_trim``, which releases free pages anywhere in the heap, not only at its top) once
a relay has dropped many bytes and the traffic has paused, and otherwise now and then
(see the class). The periodic trim is for fragmentation: the relays read their sockets up to
1 MiB at a time into a fresh buffer that is then shrunk to what came; once glibc has raised
its mmap threshold those buffers come from the heap, and small objects allocated meanwhile
pin the space they leave. A 300 s soak saw the gateway's RSS creep ~7.8 MiB (~25 KiB/s) with
no Python object growing and malloc's bytes in use flat while its free lists grew; a trim
(well under 1 ms on a relay's heap) gives those free pages back. Elsewhere than glibc it does
nothing. (Fixing glibc's mmap threshold low instead, so each large buffer had a mapping of
its own, cost every 1 MiB read a fresh mapping and its page faults: 505 MiB/s against
36,000 MiB/s for allocate, copy and free on this machine, too much for the relays' bulk path.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import sys

import trio

__all__ = ["Trimmer", "TrimStats", "trim"]


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


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
    """Calls ``trim`` once ``dropped`` has been told of at least ``min_bytes`` since the last
    trim and then nothing more for ``quiet_s``; when quiet, also every ``period_s``
    (fragmentation from ordinary traffic); and every ``busy_period_s`` whatever the traffic.
    Checked every ``interval_s``.

    Why wait for quiet: under steady traffic the bytes dropped are the relay's working set,
    freed and allocated again within milliseconds. Trimming them every second, as this did,
    made the next buffers fault their pages in again, zeroed: 17,000 page faults in 6 s and
    8% of the hub's CPU per byte at batch 512 on this VM (each fault costs the guest about
    12 us there). What a peer makes a relay hold stays bounded by the message budget while it
    is held; once the traffic pauses it is given back within ``quiet_s`` + ``interval_s``, and
    under traffic that never pauses within ``busy_period_s``."""

    def __init__(self, *, interval_s: float = 1.0, min_bytes: int = 1 << 20, quiet_s: float = 1.0,
                 period_s: float = 10.0, busy_period_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self.min_bytes = min_bytes
        self.quiet_s = quiet_s
        self.period_s = period_s
        self.busy_period_s = busy_period_s
        self._dropped = 0
        self._last_drop = float("-inf")
        self._trims = 0

    def dropped(self, n: int) -> None:
        """``n`` bytes a peer made us hold were just freed (call from the trio thread)."""
        self._dropped += n
        self._last_drop = trio.current_time()

    def statistics(self) -> TrimStats:
        return TrimStats(trims=self._trims, dropped_since=self._dropped)

    def due(self, now: float, last_trim: float) -> bool:
        """Whether to trim at ``now``, the last trim having been at ``last_trim``."""
        if now - last_trim >= self.busy_period_s:
            return True
        if now - self._last_drop < self.quiet_s:
            return False
        return self._dropped >= self.min_bytes or now - last_trim >= self.period_s

    async def run(self) -> None:
        """Trim when due, until cancelled."""
        last = trio.current_time()
        while True:
            await trio.sleep(self.interval_s)
            now = trio.current_time()
            if self.due(now, last):
                self._dropped = 0
                self._trims += 1
                last = now
                trim()
