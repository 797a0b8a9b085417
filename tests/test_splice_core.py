"""The hub's splice core (relay/hub/_splice.py), without I/O.

Its transition table walked for every phase and event (ENDING reached both ways: the worker's
"eof" and a broken backbone), the phase always matching its channel's tunnel state machine, the
close deadline on the caller's clock, claims on a multiplexed tunnel, and (fuzz tier) random
sequences of moves and worker messages checked against the invariants: a refused move changes
nothing. The trio side is tests/test_hub_splice.py.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvasir_rpc._errors import CloseCode, LocalProtocolError, RemoteProtocolError
from kvasir_rpc.protocol import TunnelState
from relay.hub._splice import (
    SPLICE_EVENTS,
    SPLICE_TRANSITIONS,
    Dropped,
    Ended,
    Forward,
    Released,
    SplicePhase,
    Splices,
)

P = SplicePhase
T = TunnelState
FUZZ = settings.get_profile("fuzz")
CLOSE_S = 10.0
# The tunnel states each phase may sit beside.
BESIDE = {P.FREE: {T.IDLE}, P.BRIDGING: {T.OPEN}, P.ENDING: {T.OPEN, T.EOF}, P.CLOSING: {T.CLOSING}}
# The ways into each phase: (phase, how); ENDING by the worker's "eof" or by a broken backbone.
REACHED = [(P.FREE, ""), (P.BRIDGING, ""), (P.ENDING, "eof"), (P.ENDING, "broke"), (P.CLOSING, "")]
WORKER_EVENTS = {"worker data", "worker eof", "worker closed"}


def _plain() -> Splices[str]:
    return Splices(0, CLOSE_S)


def _reach(s: Splices[str], phase: SplicePhase, how: str = "", channel: int = 0) -> None:
    """Move ``channel`` (free) into ``phase`` by the core's own moves."""
    if phase is P.FREE:
        return
    claimed = s.claim(f"link {channel}")
    assert claimed is not None and claimed[0] == channel
    if phase is P.ENDING:
        if how == "eof":
            assert s.from_worker(_word("eof", s, channel)) == Ended(channel, f"link {channel}")
        else:
            s.broke(channel, "backbone connection broke")
    elif phase is P.CLOSING:
        s.close(channel, now=0.0)


def _word(word: str, s: Splices[str], channel: int) -> str:
    return f"{word} {channel}" if s.multiplexed else word


def _data(payload: bytes, s: Splices[str], channel: int) -> bytes:
    return channel.to_bytes(2, "big") + payload if s.multiplexed else payload


def _apply(s: Splices[str], event: str, channel: int = 0, now: float = 0.0) -> object:
    """Call the method that carries ``event`` on ``channel``."""
    if event == "claim":
        return s.claim("a newcomer")
    if event == "to worker":
        return b"".join(s.to_worker(channel, b"backbone bytes"))
    if event == "worker data":
        return s.from_worker(_data(b"worker bytes", s, channel))
    if event == "worker eof":
        return s.from_worker(_word("eof", s, channel))
    if event == "broke":
        return s.broke(channel, "backbone connection broke")
    if event == "close":
        return s.close(channel, now=now)
    assert event == "worker closed"
    return s.from_worker(_word("closed", s, channel))


def _check(s: Splices[str]) -> None:
    for ch in range(len(s)):
        phase = s.phase(ch)
        assert s.tunnel_state(ch) in BESIDE[phase], (ch, phase, s.tunnel_state(ch))
        assert (s.link(ch) is None) == (phase is P.FREE)
    assert s.busy == all(s.phase(ch) is not P.FREE for ch in range(len(s)))


def _snapshot(s: Splices[str]) -> list[tuple[SplicePhase, TunnelState, str | None]]:
    return [(s.phase(ch), s.tunnel_state(ch), s.link(ch)) for ch in range(len(s))]


# -- the transition table ----------------------------------------------------------------------


def test_the_table_names_only_known_phases_and_events() -> None:
    assert {e for _, e in SPLICE_TRANSITIONS} == set(SPLICE_EVENTS)
    assert set(SPLICE_TRANSITIONS.values()) <= set(P)
    # The one way back to FREE is the worker's "closed"; the one way out of it a claim.
    assert [k for k, v in SPLICE_TRANSITIONS.items() if v is P.FREE] == [(P.CLOSING, "worker closed")]
    assert [k for k in SPLICE_TRANSITIONS if k[0] is P.FREE] == [(P.FREE, "claim")]


@pytest.mark.parametrize(("reached", "event"), list(itertools.product(REACHED, SPLICE_EVENTS)),
                         ids=lambda v: "-".join(x.value if isinstance(x, P) else x for x in v) if isinstance(v, tuple)
                         else v)
def test_every_phase_and_event_follows_the_table_or_raises(reached: tuple[SplicePhase, str], event: str) -> None:
    phase, how = reached
    s = _plain()
    _reach(s, phase, how)
    before = _snapshot(s)
    want = SPLICE_TRANSITIONS.get((phase, event))
    # The worker's own tunnel refuses data and a second "eof" after its "eof", though the
    # splice would take them after a broken backbone.
    tunnel_refuses = phase is P.ENDING and how == "eof" and event in ("worker data", "worker eof")
    if event == "claim" and phase is not P.FREE:
        assert _apply(s, event) is None  # busy: the connection is refused, nothing moves
        assert _snapshot(s) == before
    elif want is None or tunnel_refuses:
        error = RemoteProtocolError if event in WORKER_EVENTS else LocalProtocolError
        with pytest.raises(error) as exc:
            _apply(s, event)
        if isinstance(exc.value, RemoteProtocolError):
            assert exc.value.close_code == CloseCode.PROTOCOL_ERROR
            assert "the worker sent" in exc.value.reason
        assert _snapshot(s) == before  # a refused move changes nothing
    else:
        _apply(s, event)
        assert s.phase(0) is want
    _check(s)


# -- what each worker message asks for ---------------------------------------------------------


def test_a_plain_connection_from_claim_to_closed() -> None:
    s = _plain()
    assert len(s) == 1 and not s.multiplexed and s.free() == 0
    assert s.claim("conn") == (0, "open")
    assert s.busy and s.claim("another") is None
    assert s.to_worker(0, b"req") == (b"req",)
    (sent,) = s.to_worker(0, bytearray(b"copy"))
    assert sent == b"copy" and isinstance(sent, bytes)  # a writable buffer is copied
    assert s.from_worker(b"resp") == Forward(0, b"resp", "conn")
    closing = s.close(0, now=100.0, ended_by="backbone")
    assert (closing.message, closing.deadline, closing.ended_by) == ("close", 100.0 + CLOSE_S, "backbone")
    assert s.from_worker(b"late") == Dropped(0, 4)
    assert s.from_worker("eof") == Dropped(0, 0)
    assert s.link(0) == "conn"  # kept until "closed": the splice waits on it
    assert s.from_worker("closed") == Released(0, "conn")
    assert not s.busy and s.link(0) is None and s.opened == 1
    assert s.claim("next") == (0, "open")  # the channel carries the next one
    assert s.opened == 2
    _check(s)


def test_the_first_side_to_end_is_who_ended_it() -> None:
    s = _plain()
    s.claim("conn")
    assert s.from_worker("eof") == Ended(0, "conn")
    assert s.to_worker(0, b"in flight") == (b"in flight",)  # read before the splice saw the end
    assert s.close(0, now=0.0, ended_by="backbone").ended_by == "worker"
    s.from_worker("closed")
    s.claim("conn 2")
    s.broke(0, "backbone connection broke (EOF)")
    assert s.from_worker(b"nowhere to go") == Dropped(0, 13)  # the backbone's side is gone
    assert s.from_worker("eof") == Ended(0, "conn 2")  # its splice is stopped again: harmless
    assert s.close(0, now=0.0).ended_by == "backbone connection broke (EOF)"


@pytest.mark.parametrize(("message", "says"), [
    (b"data", "the worker sent 4 bytes of data while the tunnel is IDLE"),
    ("eof", "the worker sent 'eof' while the tunnel is IDLE"),
    ("closed", "the worker sent 'closed' while the tunnel is IDLE"),
    ("open", "the worker sent 'open' while the tunnel is IDLE"),
    ("hello", "unknown control message 'hello'"),
])
def test_a_worker_that_speaks_out_of_turn_ends_the_session_1002(message: bytes | str, says: str) -> None:
    s = _plain()
    with pytest.raises(RemoteProtocolError) as exc:
        s.from_worker(message)
    assert exc.value.close_code == CloseCode.PROTOCOL_ERROR and says in exc.value.reason
    _check(s)


def test_a_worker_that_says_closed_before_the_hub_closed_is_refused() -> None:
    s = _plain()
    s.claim("conn")
    with pytest.raises(RemoteProtocolError, match="'closed' while the tunnel is OPEN"):
        s.from_worker("closed")
    assert s.phase(0) is P.BRIDGING and s.link(0) == "conn"


# -- a multiplexed tunnel ----------------------------------------------------------------------


def test_a_multiplexed_tunnel_claims_the_lowest_free_channel() -> None:
    s: Splices[str] = Splices(3, CLOSE_S)
    assert len(s) == 3 and s.multiplexed
    assert [s.claim(n) for n in "abcd"] == [(0, "open 0"), (1, "open 1"), (2, "open 2"), None]
    assert s.to_worker(1, b"xy") == (b"\x00\x01", b"xy")
    assert s.from_worker(b"\x00\x02pq") == Forward(2, b"pq", "c")
    s.close(1, now=5.0)
    assert s.claim("e") is None  # closing: not free until the worker's "closed"
    assert s.from_worker("closed 1") == Released(1, "b")
    assert s.claim("e") == (1, "open 1")
    _check(s)


def test_a_refusal_on_a_multiplexed_tunnel_names_the_channel() -> None:
    s: Splices[str] = Splices(2, CLOSE_S)
    s.claim("a")
    with pytest.raises(RemoteProtocolError, match="channel 1: the worker sent 3 bytes of data while the tunnel is "
                                                  "IDLE"):
        s.from_worker(b"\x00\x01abc")
    with pytest.raises(RemoteProtocolError, match="named channel 7 of a tunnel of 2"):
        s.from_worker("eof 7")
    assert _snapshot(s) == [(P.BRIDGING, T.OPEN, "a"), (P.FREE, T.IDLE, None)]


def test_the_close_deadline_is_the_callers_clock() -> None:
    s: Splices[str] = Splices(2, 2.5)
    s.claim("a")
    s.claim("b")
    assert s.close(1, now=40.0).deadline == 42.5
    assert s.close(0, now=41.0).deadline == 43.5
    s.from_worker("closed 1")
    s.claim("c")
    assert s.close(1, now=50.0).deadline == 52.5


# -- random sequences (fuzz tier) --------------------------------------------------------------

MESSAGES = st.one_of(
    st.tuples(st.just("event"), st.sampled_from(SPLICE_EVENTS), st.integers(0, 3)),
    st.tuples(st.just("raw"), st.sampled_from(["open 0", "eof", "closed 9", "close 1", "eof 01", "", "closed 2"]),
              st.just(0)),
    st.tuples(st.just("raw"), st.binary(max_size=6), st.just(0)),
)


@pytest.mark.fuzz
@FUZZ
@given(channels=st.sampled_from([0, 2, 3]), ops=st.lists(MESSAGES, max_size=60))
def test_random_sequences_keep_each_phase_beside_its_tunnel_state(
        channels: int, ops: list[tuple[str, object, int]]) -> None:
    s = _plain() if channels == 0 else Splices(channels, CLOSE_S)
    now = 0.0
    for kind, what, pick in ops:
        now += 1.0
        channel = pick % len(s)
        before = _snapshot(s)
        try:
            if kind == "event":
                got = _apply(s, what, channel, now)  # type: ignore[arg-type]
            else:
                got = s.from_worker(what)  # type: ignore[arg-type]
        except LocalProtocolError:
            assert kind == "event" and what not in WORKER_EVENTS
            assert _snapshot(s) == before
        except RemoteProtocolError as exc:
            assert exc.close_code == CloseCode.PROTOCOL_ERROR
            assert _snapshot(s) == before
        else:
            if kind == "event" and what == "claim" and got is None:
                assert s.busy and _snapshot(s) == before
            if isinstance(got, (Forward, Ended)):
                assert s.link(got.channel) == got.link
            if isinstance(got, Released):
                assert s.phase(got.channel) is P.FREE
        _check(s)
        assert s.opened >= sum(s.phase(ch) is not P.FREE for ch in range(len(s)))
