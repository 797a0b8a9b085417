"""Checking a stranger's partials: which rows to audit, and whether an audited row is right.

A worker's answer to a call is first checked whole (shape, dtype, every value finite); then
rows are drawn for the audit with probability ``rate`` each, from a generator seeded from the
operating system after the answer arrived, so the worker cannot tell which rows are checked.
An audited row is recomputed here from the checkpoint's weights and the rows this backbone sent.

A segment (the rows of one expert in the call) of at most ``SEGMENT_ROWS`` rows is drawn
whole, with probability ``rate``; a larger one row by row. A matmul rounds a row differently
with the shape of the batch it is in; recomputed as the worker computed it, the whole
segment in one pass, an honest worker's rows come out equal bit for bit, and every row of
the segment is checked for that one forward. Either way each row is audited with
probability ``rate`` and the audits recompute a ``rate`` share of the remote work on
average, as ``--audit-rate`` says. (Drawing rows and bringing in the segment of each drawn
row, as this did before, audited ``1 - (1 - rate)^n`` of the segments of ``n`` rows: 28% of
the remote work at 16-row segments, fourteen times the rate asked for.)

Whether an audited row is right is the library's (``kvasir_rpc._tolerance``: the tolerance
and ``audit_rows``), so that ``kvasir conformance`` judges a worker as the backbone does.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from collections.abc import Sequence

import torch

__all__ = ["DEFAULT_AUDIT_RATE", "SEGMENT_ROWS", "AuditRates", "RowSampler"]

# One row (or small segment) in fifty: audits recompute 2% of the remote work of a session
# whose rows are each checked (_row_checks.py) once its wallet has earned it; each session's
# first call in a run is audited too (see RowSampler).
DEFAULT_AUDIT_RATE = 0.02
# A session answering without row checks (an older worker) is audited at least this much:
# the audits are all that stand between its answers and the output.
DEFAULT_UNCHECKED_RATE = 0.10
# A wallet's first rows are audited at this rate, halving every NEW_WALLET_HALF_LIFE_ROWS rows
# of accepted work until the session's own rate: a fresh identity (they are free) starts
# under close watch and earns its way down.
DEFAULT_NEW_WALLET_RATE = 0.25
NEW_WALLET_HALF_LIFE_ROWS = 2000
# A segment of at most this many rows is drawn and audited whole (see RowSampler). At
# Qwen3-30B-A3B's widths on one core: a forward over 32 rows takes 6.4 ms, over 3 rows
# 3.2 ms, and the error bound that an inexact row needs 7-10 ms.
SEGMENT_ROWS = 48


@dataclasses.dataclass(frozen=True)
class AuditRates:
    """How much of a session's work the audits recompute: ``base`` for a session whose rows are
    checked, at least ``unchecked`` for one without row checks, and ``new`` for a wallet's first
    rows, halving every ``half_life_rows`` rows of its accepted work. ``base`` 0 turns the
    audits off (benchmarks)."""

    base: float = DEFAULT_AUDIT_RATE
    unchecked: float = DEFAULT_UNCHECKED_RATE
    new: float = DEFAULT_NEW_WALLET_RATE
    half_life_rows: int = NEW_WALLET_HALF_LIFE_ROWS

    def __post_init__(self) -> None:
        for name in ("base", "unchecked", "new"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"the audit rate {name} is a fraction from 0 to 1, got {getattr(self, name)}")
        if self.half_life_rows < 1:
            raise ValueError("half_life_rows must be at least 1")

    def rate(self, earned_rows: int, row_checked: bool) -> float:
        """The rate for a session of a wallet with ``earned_rows`` rows of accepted work."""
        if self.base == 0.0:
            return 0.0
        floor = self.base if row_checked else max(self.base, self.unchecked)
        return min(1.0, max(floor, self.new * 0.5 ** (earned_rows / self.half_life_rows)))


class RowSampler:
    """Chooses audited rows: whole small segments or single rows, each with probability
    ``rate`` (the sampler's, or the one a call is given), from a generator seeded from the OS
    (never from anything a worker sees), plus one row of each session's first call (with its
    segment when that is small)."""

    def __init__(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"the audit rate is a fraction from 0 to 1, got {rate}")
        self.rate = rate
        self._gen = torch.Generator().manual_seed(secrets.randbits(63))
        self._seen: set[str] = set()
        self._lock = threading.Lock()  # decode groups answer calls from several threads

    def choose(self, session_id: str, sizes: Sequence[int], rate: float | None = None) -> torch.Tensor:
        """Indices (ascending, int64) of the rows of one answered call to audit; the call's
        segments hold ``sizes`` rows, in order."""
        rate = self.rate if rate is None else rate
        rows = sum(sizes)
        if rows == 0 or rate == 0.0:
            return torch.empty(0, dtype=torch.long)
        with self._lock:
            draws = torch.rand(rows, generator=self._gen) < rate
            first = session_id not in self._seen
            if first:
                self._seen.add(session_id)
                extra = int(torch.randint(rows, (1,), generator=self._gen))
        picked = torch.zeros(rows, dtype=torch.bool)
        start = 0
        for n in sizes:
            end = start + n
            if n <= SEGMENT_ROWS:
                # One draw for the whole segment (its first row's), so a segment is as likely
                # to be audited as a row is.
                whole = bool(draws[start]) if n else False
                if first and start <= extra < end:
                    whole = True
                if whole:
                    picked[start:end] = True
            else:
                picked[start:end] = draws[start:end]
                if first and start <= extra < end:
                    picked[extra] = True
            start = end
        return picked.nonzero()[:, 0]
