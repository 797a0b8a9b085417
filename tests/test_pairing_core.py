"""The gateway's pairing core (relay/gateway/_pairing.py), without I/O.

Its transition table walked exhaustively, the capacity rules at their edges, the pairing ids,
the close codes of its refusals, and (fuzz tier, the ``fuzz`` profile of tests/conftest.py)
random sequences of events checked against its invariants. The trio side is
tests/test_gateway_pairing.py and tests/test_fuzz_gateway.py.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvasir_rpc._errors import CloseCode, LocalProtocolError, RemoteProtocolError
from relay.gateway._pairing import EVENTS, PAIRING_TRANSITIONS, Pairings, PairingState

S = PairingState
FUZZ = settings.get_profile("fuzz")
TIMEOUT = 10.0


def _table(max_unpaired: int = 64, max_sessions: int = 1024) -> Pairings[str]:
    return Pairings(max_unpaired, max_sessions, TIMEOUT)


def _in_state(p: Pairings[str], state: PairingState, now: float = 0.0) -> str:
    """A new pairing in ``state`` (not DONE), reached by the table's own moves."""
    pid = p.admit()
    if state is S.ADMITTING:
        return pid
    p.upgraded(pid, "198.51.100.1:1", f"link {pid}", now=now)
    if state is S.PAIRED:
        p.take(pid)
    elif state is S.REFUSED:
        p.refuse(pid, "no hub")
    return pid


def _apply(p: Pairings[str], pid: str, event: str, now: float) -> object:
    """Call the method that carries ``event``."""
    if event == "upgraded":
        return p.upgraded(pid, "198.51.100.1:1", f"link {pid}", now=now)
    if event == "upgrade failed":
        p.upgrade_failed(pid)
        return None
    if event in ("no hub", "hub gone"):
        return p.refuse(pid, event)
    if event == "timeout":
        return p.settle(pid, now=now)
    if event == "hub took":
        return p.take(pid)
    assert event == "left"
    return p.leave(pid)


def _check_counts(p: Pairings[str]) -> None:
    held = {pid: p.get(pid) for pid in p.live()}
    states = [q.state for q in p._table.values()]
    for state in S:
        assert p.count(state) == states.count(state)
    assert p.count(S.DONE) == 0 and S.DONE not in states  # a DONE pairing is out of the table
    assert len(p) == len(states) == p.admitting + len(held)
    assert p.unpaired == states.count(S.WAITING) + states.count(S.REFUSED)


# -- the transition table ----------------------------------------------------------------------


def test_the_table_names_only_known_states_and_events() -> None:
    assert {e for _, e in PAIRING_TRANSITIONS} <= set(EVENTS)
    assert not any(s is S.DONE for s, _ in PAIRING_TRANSITIONS)  # DONE is final
    assert {nxt for nxt in PAIRING_TRANSITIONS.values()} <= set(S)


@pytest.mark.parametrize(("state", "event"), list(itertools.product([s for s in S if s is not S.DONE], EVENTS)))
def test_every_state_and_event_follows_the_table_or_raises(state: PairingState, event: str) -> None:
    p = _table()
    pid = _in_state(p, state)
    # "timeout" is due only once the deadline has passed; before it, settle() refuses to guess.
    now = TIMEOUT + 1 if event == "timeout" else 0.0
    want = PAIRING_TRANSITIONS.get((state, event))
    if (state, event) == (S.PAIRED, "timeout"):  # the wait ended as the hub took it: splice
        assert _apply(p, pid, event, now) is None
        assert p.get(pid).state is S.PAIRED  # type: ignore[union-attr]
    elif want is None:
        remote = event == "hub took"  # a hub data connection for a pairing it may not take
        with pytest.raises(RemoteProtocolError if remote else LocalProtocolError) as exc:
            _apply(p, pid, event, now)
        if remote:
            assert isinstance(exc.value, RemoteProtocolError)
            assert exc.value.close_code == CloseCode.PAIRING_GONE
        got = p.get(pid)
        assert got is not None and got.state is state  # a refused move changes nothing
    else:
        _apply(p, pid, event, now)
        got = p.get(pid)
        assert (got.state if got is not None else S.DONE) is want
    _check_counts(p)


def test_every_move_on_a_pairing_not_held_raises_except_leave() -> None:
    p = _table()
    for event in EVENTS:
        if event == "left":
            assert p.leave("nope") is False
        elif event == "hub took":
            with pytest.raises(RemoteProtocolError) as exc:
                p.take("nope")
            assert exc.value.close_code == CloseCode.PAIRING_GONE and exc.value.reason == "pairing gone"
        else:
            with pytest.raises(LocalProtocolError):
                _apply(p, "nope", event, TIMEOUT + 1)
    assert len(p) == 0


def test_a_second_hub_data_connection_for_the_same_pairing_is_refused_4210() -> None:
    p = _table()
    pid = _in_state(p, S.WAITING)
    assert p.can_take(pid)
    assert p.take(pid) == f"link {pid}"
    assert not p.can_take(pid)
    with pytest.raises(RemoteProtocolError) as exc:
        p.take(pid)
    assert exc.value.close_code == CloseCode.PAIRING_GONE
    assert p.get(pid) is not None and p.get(pid).state is S.PAIRED  # type: ignore[union-attr]


def test_the_refusals_keep_their_close_codes() -> None:
    p = _table()
    v = p.refuse(_in_state(p, S.WAITING), "no hub")
    assert (v.close_code, v.reason, v.refusal) == (CloseCode.NO_HUB, "no hub connected", None)
    v = p.refuse(_in_state(p, S.WAITING), "hub gone")
    assert (v.close_code, v.reason, v.refusal) == (CloseCode.NO_HUB, "hub went away", None)
    with pytest.raises(LocalProtocolError):
        p.refuse(_in_state(p, S.WAITING), "timeout")  # not through refuse(): settle() decides it


def test_the_pairing_time_is_the_callers_clock() -> None:
    p = _table()
    pid = p.admit()
    assert p.upgraded(pid, "198.51.100.1:1", "link", now=100.0) == 100.0 + TIMEOUT
    with pytest.raises(LocalProtocolError):
        p.settle(pid, now=100.0 + TIMEOUT - 0.001)  # neither taken nor due
    v = p.settle(pid, now=100.0 + TIMEOUT)
    assert v is not None and (v.close_code, v.reason, v.refusal) == (
        CloseCode.PAIRING_TIMEOUT, "no hub took the session in time", "pairing_timeout")
    assert p.get(pid) is not None and p.get(pid).state is S.REFUSED  # type: ignore[union-attr]
    assert p.unpaired == 1  # still held while the worker is closed
    assert p.leave(pid) and len(p) == 0


def test_a_taken_pairing_settles_to_a_splice_even_past_its_deadline() -> None:
    p = _table()
    pid = _in_state(p, S.WAITING, now=0.0)
    p.take(pid)
    assert p.settle(pid, now=TIMEOUT * 5) is None


# -- capacity ------------------------------------------------------------------------------------


def test_max_unpaired_counts_the_workers_still_upgrading() -> None:
    p = _table(max_unpaired=3)
    a = _in_state(p, S.ADMITTING)
    _in_state(p, S.WAITING)
    _in_state(p, S.REFUSED)  # being closed: still holds its place
    assert not p.has_room()
    with pytest.raises(LocalProtocolError):
        p.admit()
    p.upgrade_failed(a)
    assert p.has_room()
    _in_state(p, S.PAIRED)  # a spliced worker is not unpaired
    assert p.has_room()


def test_max_sessions_counts_every_held_worker() -> None:
    p = _table(max_unpaired=100, max_sessions=4)
    held = [_in_state(p, s) for s in (S.ADMITTING, S.WAITING, S.PAIRED)]
    assert p.has_room()
    last = _in_state(p, S.REFUSED)
    assert not p.has_room()
    assert p.leave(last)
    assert p.has_room()
    for pid in held:
        assert p.leave(pid)
    assert len(p) == 0 and all(p.count(s) == 0 for s in S)


def test_zero_capacity_admits_nobody() -> None:
    assert not _table(max_unpaired=0).has_room()
    assert not _table(max_sessions=0).has_room()


# -- pairing ids ---------------------------------------------------------------------------------


def test_pairing_ids_are_unique_and_url_safe() -> None:
    p = _table(max_unpaired=10_000, max_sessions=10_000)
    ids = [p.admit() for _ in range(2000)]
    assert len(set(ids)) == len(ids) == p.issued
    assert all(len(i) == 24 and i.replace("-", "").replace("_", "").isalnum() for i in ids)


def test_a_repeated_id_is_never_handed_out_twice() -> None:
    ids = iter(["a", "a", "a", "b"])
    p: Pairings[str] = Pairings(10, 10, TIMEOUT, new_id=lambda: next(ids))
    assert [p.admit(), p.admit()] == ["a", "b"]


# -- random sequences (fuzz tier) --------------------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(("admit",) + EVENTS), st.integers(0, 7), st.floats(0, 3)),
               max_size=80)


@pytest.mark.fuzz
@FUZZ
@given(ops=OPS, max_unpaired=st.integers(0, 5), max_sessions=st.integers(0, 7))
def test_random_event_sequences_keep_the_counts_and_leak_nothing(
        ops: list[tuple[str, int, float]], max_unpaired: int, max_sessions: int) -> None:
    p = _table(max_unpaired, max_sessions)
    now = 0.0
    seen: list[str] = []  # every id ever admitted
    for op, pick, dt in ops:
        now += dt
        if op == "admit":
            room = p.has_room()
            if room:
                seen.append(p.admit())
            else:
                with pytest.raises(LocalProtocolError):
                    p.admit()
        elif seen:
            pid = seen[pick % len(seen)]
            held = p.get(pid)
            before = held.state if held is not None else S.DONE
            due = held is not None and before is S.WAITING and now >= held.deadline
            legal = PAIRING_TRANSITIONS.get((before, event := op))
            try:
                _apply(p, pid, event, now)
            except (LocalProtocolError, RemoteProtocolError):
                after = p.get(pid)
                assert (after.state if after is not None else S.DONE) is before  # nothing moved
                if event == "timeout" and legal is not None:
                    assert not due  # refused only because the deadline had not come
                else:
                    assert legal is None or before is S.DONE
            else:
                after = p.get(pid)
                now_state = after.state if after is not None else S.DONE
                if before is S.DONE:
                    assert event == "left"  # leaving twice is a no-op
                elif event == "timeout" and before is S.PAIRED:
                    assert now_state is S.PAIRED  # settle() of a taken pairing: splice
                else:
                    assert now_state is legal
        _check_counts(p)
        assert p.unpaired + p.admitting <= max_unpaired
        assert len(p) <= max_sessions
    assert len(set(seen)) == len(seen) == p.issued
    for pid in seen:
        p.leave(pid)
    assert len(p) == 0 and all(p.count(s) == 0 for s in S) and p.live() == {}
