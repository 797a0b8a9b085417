"""relay._heap_trim.Trimmer on a fake clock: the heap is given back once the traffic pauses,
not while buffers are being freed and allocated again, and still now and then."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from relay import _heap_trim as _memory
from relay._heap_trim import Trimmer


@pytest.fixture
def trims(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The fake clock's time of every malloc_trim the Trimmer makes."""
    at: list[float] = []
    monkeypatch.setattr(_memory, "trim", lambda: at.append(trio.current_time()) or True)
    return at


def _run(fn) -> None:  # type: ignore[no-untyped-def]
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


async def _traffic(t: Trimmer, seconds: float, nbytes: int, every: float) -> float:
    """Free ``nbytes`` every ``every`` seconds for ``seconds``, as a relay under steady
    traffic; the fake clock's time it started."""
    start = trio.current_time()
    while trio.current_time() - start < seconds:
        t.dropped(nbytes)
        await trio.sleep(every)
    return start


def test_steady_traffic_is_not_trimmed_until_it_pauses(trims: list[float]) -> None:
    """Messages of 1 MiB freed five times a second for 30 s: no trim while they flow (they
    are the relay's working set); one within quiet_s + interval_s of the last."""
    t = Trimmer()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(t.run)
            await _traffic(t, 30, 1 << 20, 0.2)
            assert trims == []
            last = trio.current_time()
            await trio.sleep(2.5)
            assert len(trims) == 1 and trims[0] - last <= t.quiet_s + t.interval_s
            assert t.statistics().dropped_since == 0
            nursery.cancel_scope.cancel()

    _run(main)


def test_traffic_that_never_pauses_is_trimmed_every_busy_period(trims: list[float]) -> None:
    t = Trimmer()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(t.run)
            start = await _traffic(t, 130, 64 << 10, 0.1)
            nursery.cancel_scope.cancel()
        assert len(trims) == 2
        assert [round(x - start) for x in trims] == [60, 120]

    _run(main)


def test_a_quiet_relay_trims_every_period_and_soon_after_a_large_drop(trims: list[float]) -> None:
    """Nothing dropped: a trim every period_s (fragmentation). A peer's unfinished messages
    cut at once (8 MiB in one go): given back within quiet_s + interval_s, not at the period."""
    t = Trimmer()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(t.run)
            start = trio.current_time()
            await trio.sleep(25.5)
            assert [round(x - start) for x in trims] == [10, 20]
            cut = trio.current_time()
            t.dropped(8 << 20)
            await trio.sleep(2.5)
            assert len(trims) == 3 and trims[2] - cut <= t.quiet_s + t.interval_s
            # Less than min_bytes dropped: it waits for the period, counted from that trim.
            t.dropped(1000)
            await trio.sleep(5)
            assert len(trims) == 3
            nursery.cancel_scope.cancel()

    _run(main)
