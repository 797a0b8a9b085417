"""When an accepted call is paid, now that audits run after the answers are used: a
session's calls wait behind any audit of that session submitted before them, whatever
order the audits end in; a failed audit pays nothing that waited, nor anything after."""

from __future__ import annotations

import threading

from backbone.experts._hub_reports import AuditGate


def _gate() -> tuple[AuditGate, list[tuple[str, int, int]]]:
    paid: list[tuple[str, int, int]] = []
    return AuditGate(lambda sid, nbytes, rows: paid.append((sid, nbytes, rows))), paid


def test_unaudited_calls_of_a_session_with_no_pending_audit_are_paid_at_once() -> None:
    gate, paid = _gate()
    assert gate.accepted("a", 100, 1, audited=False) == 0
    assert paid == [("a", 100, 1)] and gate.waiting() == 0


def test_calls_wait_behind_their_sessions_audit_and_are_paid_when_it_passes() -> None:
    gate, paid = _gate()
    first = gate.accepted("a", 100, 1, audited=True)
    gate.accepted("a", 200, 2, audited=False)  # after the audited call: waits for its verdict
    gate.accepted("b", 50, 1, audited=False)  # another session: paid at once
    assert paid == [("b", 50, 1)] and gate.waiting() == 2
    gate.passed("a", first)
    assert paid == [("b", 50, 1), ("a", 100, 1), ("a", 200, 2)] and gate.waiting() == 0
    gate.accepted("a", 300, 3, audited=False)  # nothing pending now
    assert paid[-1] == ("a", 300, 3)


def test_a_failed_audit_pays_nothing_that_waited_nor_anything_later() -> None:
    gate, paid = _gate()
    gate.accepted("liar", 10, 1, audited=False)  # before any audit: paid, as its answer was used unchecked
    n = gate.accepted("liar", 20, 1, audited=True)
    gate.accepted("liar", 30, 1, audited=False)
    gate.failed("liar")
    gate.passed("liar", n)  # a verdict that arrives after the failure changes nothing
    assert gate.accepted("liar", 40, 1, audited=False) == 0
    assert paid == [("liar", 10, 1)] and gate.waiting() == 0


def test_audits_ending_out_of_order_release_only_what_every_earlier_audit_passed() -> None:
    gate, paid = _gate()
    one = gate.accepted("a", 1, 1, audited=True)
    two = gate.accepted("a", 2, 1, audited=True)
    gate.accepted("a", 3, 1, audited=False)
    gate.passed("a", two)  # audit 1 still pending: nothing is due
    assert paid == []
    gate.passed("a", one)
    assert [p[1] for p in paid] == [1, 2, 3]
    # Audit 1 fails after audit 2 passed: what waited for audit 1 is dropped, 2's call too.
    gate2, paid2 = _gate()
    one = gate2.accepted("a", 1, 1, audited=True)
    two = gate2.accepted("a", 2, 1, audited=True)
    gate2.passed("a", two)
    gate2.failed("a")
    assert paid2 == [] and gate2.waiting() == 0


def test_concurrent_accepts_and_verdicts_pay_every_byte_exactly_once() -> None:
    gate, paid = _gate()
    numbers: list[int] = []
    lock = threading.Lock()

    def decode_thread(k: int) -> None:
        for i in range(500):
            n = gate.accepted("a", 1, 1, audited=i % 7 == 0)
            if n and i % 7 == 0:
                with lock:
                    numbers.append(n)

    threads = [threading.Thread(target=decode_thread, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for n in reversed(sorted(numbers)):  # the verdicts, latest first
        gate.passed("a", n)
    assert sum(p[1] for p in paid) == 4 * 500 and gate.waiting() == 0
