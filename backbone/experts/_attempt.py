"""One decode attempt: the forward passes of one decode thread (an engine lane, a
``decode`` group, an assisted decode), which worker sessions they used, the audits they
wait for, and what to recompute when a session they used turns out to have lied.

A decode runs as a sequence of *passes* (a prefill, a step, an assisted step), each a
forward of the model followed by :meth:`DecodeAttempt.settle`, which waits for that pass's
audits before the decode chooses a token from its logits. A session whose past answers can
no longer be trusted (``Dispatcher.untrusted``: one that failed an audit, or one answering
without row checks that was quarantined for anything) taints every pass of this attempt from
the first that used it: :meth:`check` and :meth:`settle` raise :class:`ReplayNeeded` naming
that pass, and the decode goes back to the state before it (the KV cache cut back to its
length then; where a decode cannot, from the prompt) and recomputes from there without the
session. An answer refused by its row checks is never used (the Dispatcher computes that
call here before the pass goes on), so a session caught that way taints nothing.

There is no cap after which a decode fails. Past ``LOCAL_AFTER`` replays of one pass, that
pass is computed with every expert here; past ``LOCAL_AFTER`` replays to an earlier pass,
the experts the tainting sessions served are computed here for the rest of the attempt. Each
replay then either finishes its pass or takes more experts off the swarm, so a swarm of
fresh liars slows a decode down and never stops it.

The attempt in force is per thread (:meth:`active`); the Dispatcher reads it with
:func:`current_attempt`. Forward passes run outside any attempt are not tracked: their
audits pay or quarantine on their own and nothing is replayed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

__all__ = ["LOCAL_AFTER", "DecodeAttempt", "ReplayNeeded", "Untrusted", "current_attempt"]

# Replays (of one pass, or back to earlier passes) before the experts concerned are computed
# here instead.
LOCAL_AFTER = 3

_current = threading.local()


class Dispatcher(Protocol):
    """What an attempt asks of the Dispatcher (``backbone.experts._dispatch``) that runs it."""

    def untrusted(self) -> Mapping[str, Untrusted]: ...

    def note_replay(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Untrusted:
    """A session whose past answers cannot all be trusted: all of them, or (``narrow_only``,
    a session whose row checks caught it) those whose rows passed their checks narrowly;
    ``slices``: what it served."""

    slices: Mapping[int, Sequence[int]]
    narrow_only: bool = False


class ReplayNeeded(RuntimeError):
    """A session this attempt used can no longer be trusted: every pass from ``from_pass``
    (0: the first of the attempt) must be recomputed without it."""

    def __init__(self, message: str, *, from_pass: int) -> None:
        super().__init__(message)
        self.from_pass = from_pass


def current_attempt() -> DecodeAttempt | None:
    """The attempt in force in this thread, if any."""
    attempt: DecodeAttempt | None = getattr(_current, "attempt", None)
    return attempt


class DecodeAttempt:
    """The passes of one decode thread since it (re)started. Not thread-safe: one thread
    uses it (audits finish on the Dispatcher's audit thread; only their futures cross)."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.restart()

    def restart(self) -> None:
        """A new decode from its prompts: nothing used, nothing pending, no experts kept here.
        Audits of earlier passes still finish on their own (they pay or quarantine)."""
        self.passes = 0  # passes settled
        self._used: dict[str, int] = {}  # session id -> the first pass that used it
        self._narrow: dict[str, int] = {}  # session id -> the first pass that used a narrow pass of it
        self._audits: list[concurrent.futures.Future[bool]] = []
        self.retries = 0  # replays of the current pass
        self.rewinds = 0  # replays back to an earlier pass
        self.local_pass = False  # the current pass computes every expert here
        self.local_experts: dict[int, set[int]] = {}  # layer -> experts computed here for this attempt

    @contextlib.contextmanager
    def active(self) -> Iterator[DecodeAttempt]:
        """Make this the attempt in force in this thread while the block runs."""
        previous = getattr(_current, "attempt", None)
        _current.attempt = self
        try:
            yield self
        finally:
            _current.attempt = previous

    # -- what the Dispatcher tells it, during a pass -----------------------------------------

    def used(self, session_id: str, *, narrow: bool = False) -> None:
        """The current pass used an answer of ``session_id``; ``narrow``: one whose rows
        passed their checks narrowly (``_row_checks.NARROW_Z``)."""
        self._used.setdefault(session_id, self.passes)
        if narrow:
            self._narrow.setdefault(session_id, self.passes)

    def audit_pending(self, fut: concurrent.futures.Future[bool]) -> None:
        """An audit of an answer the current pass used; its result says whether it passed."""
        self._audits.append(fut)

    def keeps_local(self, layer: int) -> set[int] | None:
        """The experts of ``layer`` this attempt computes here whatever the placement; None:
        every expert (a pass replayed too often)."""
        if self.local_pass:
            return None
        return self.local_experts.get(layer, set())

    # -- the decode's side ---------------------------------------------------------------------

    def check(self) -> None:
        """Raise ReplayNeeded if a session this attempt used can no longer be trusted."""
        untrusted = self.dispatcher.untrusted()
        if not untrusted:
            return
        hits = [(first, sid) for sid, first in self._used.items()
                if sid in untrusted and not untrusted[sid].narrow_only]
        hits += [(first, sid) for sid, first in self._narrow.items() if sid in untrusted and untrusted[sid].narrow_only]
        if hits:
            first, sid = min(hits)
            raise ReplayNeeded(f"session {sid}, used from pass {first} of this decode, is no longer trusted",
                               from_pass=first)

    def settle(self) -> None:
        """End the current pass: wait for its audits, then raise ReplayNeeded if a session
        it (or an earlier pass) used can no longer be trusted. Call it before choosing tokens
        from the pass's logits. An audit that could not run (the checkpoint became unreadable)
        raises here."""
        pending, self._audits = self._audits, []
        if pending:
            concurrent.futures.wait(pending)
            for fut in pending:
                fut.result()  # a failed audit has marked its session untrusted
        self.check()
        self.passes += 1
        self.retries = 0
        self.local_pass = False

    def replaying(self, exc: ReplayNeeded, *, from_pass: int | None = None) -> None:
        """The decode is about to recompute from ``from_pass`` (``exc.from_pass`` unless the
        decode can only go back further, say to 0): forget what the passes from there used,
        count the replay, and past ``LOCAL_AFTER`` keep the experts concerned here."""
        target = exc.from_pass if from_pass is None else from_pass
        if not 0 <= target <= exc.from_pass:
            raise ValueError(f"cannot replay from pass {target} for a taint from pass {exc.from_pass}")
        self.dispatcher.note_replay()
        self._audits = []  # the abandoned pass's audits finish on their own
        if exc.from_pass >= self.passes:  # the current pass again
            self.retries += 1
            self.local_pass = self.retries >= LOCAL_AFTER
        else:
            self.rewinds += 1
            self.retries = 0
            self.local_pass = False
        if self.rewinds >= LOCAL_AFTER:
            untrusted = self.dispatcher.untrusted()
            for sid, first in self._used.items():
                if first >= exc.from_pass and sid in untrusted:
                    for layer, experts in untrusted[sid].slices.items():
                        self.local_experts.setdefault(layer, set()).update(experts)
        self._used = {sid: first for sid, first in self._used.items() if first < target}
        self._narrow = {sid: first for sid, first in self._narrow.items() if first < target}
        self.passes = target
