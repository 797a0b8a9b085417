"""Refused connections: counted always, logged one line each, but at most so many lines per
reason and interval, so that a flood of bad requests cannot flood the log.

A fixed window per reason: the first ``lines_per_interval`` refusals of a window are logged
one line each; the rest are only counted, and one summary line ("... and K more refused for
REASON in the last T s") reports them when the window is over (at the next refusal of that
reason, or at ``flush``, which ``run`` calls every interval). So a reason writes at most
``lines_per_interval + 1`` lines an interval, whatever the load. Reasons are the callers'
fixed words (never text from the peer), so the table stays small. Lines are at info level,
or at warning for a refusal the operator should act on (``warn=True``: a hub presenting the
wrong token), its summary too.

Sans-IO apart from ``run``: the clock is injectable, and nothing here awaits but ``run``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import trio
from structlog.typing import FilteringBoundLogger

__all__ = ["RefusalLog"]

LINES_PER_INTERVAL = 10
INTERVAL_S = 10.0


@dataclasses.dataclass
class _Window:
    start: float
    logged: int = 0
    suppressed: int = 0
    warn: bool = False


class RefusalLog:
    """Counts refusals by reason and logs them through ``logger``, rate-limited per reason.

    ``refused(reason, **fields)`` never raises and never awaits; ``counts()`` is a copy of
    the totals (every refusal, logged or not)."""

    def __init__(self, logger: FilteringBoundLogger, *, lines_per_interval: int = LINES_PER_INTERVAL,
                 interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if lines_per_interval < 1 or interval_s <= 0:
            raise ValueError("a refusal log needs at least one line per interval and an interval > 0")
        self._log = logger
        self._lines = lines_per_interval
        self._interval = interval_s
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._counts: dict[str, int] = {}

    @property
    def interval_s(self) -> float:
        return self._interval

    def counts(self) -> dict[str, int]:
        """Refusals so far by reason, logged or not."""
        return dict(self._counts)

    def refused(self, reason: str, *, warn: bool = False, **fields: Any) -> None:
        """Count one refusal under ``reason``; log it with ``fields`` (at warning level with
        ``warn``) unless this reason has used its lines for the current interval."""
        self._counts[reason] = self._counts.get(reason, 0) + 1
        now = self._clock()
        window = self._windows.get(reason)
        if window is None or now - window.start >= self._interval:
            if window is not None:
                self._summarize(reason, window, now)
            window = self._windows[reason] = _Window(start=now)
        window.warn = window.warn or warn
        if window.logged < self._lines:
            window.logged += 1
            (self._log.warning if warn else self._log.info)("connection refused", reason=reason, **fields)
        else:
            window.suppressed += 1

    def flush(self) -> None:
        """Summarize and forget every window that is over."""
        now = self._clock()
        for reason, window in list(self._windows.items()):
            if now - window.start >= self._interval:
                self._summarize(reason, window, now)
                del self._windows[reason]

    def _summarize(self, reason: str, window: _Window, now: float) -> None:
        if window.suppressed:
            span = now - window.start
            (self._log.warning if window.warn else self._log.info)(f"... and {window.suppressed} more refused for {reason} in the last {span:.0f} s",
                           reason=reason, suppressed=window.suppressed, window_s=round(span, 3))

    async def run(self) -> None:
        """Flush every interval until cancelled, so that a flood's summary line appears
        even when the flood stops."""
        while True:
            await trio.sleep(self._interval)
            self.flush()
