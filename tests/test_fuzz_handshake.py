"""Fuzz tier: the session handshake and the tunnel's control cores (kvasir_rpc._handshake,
kvasir_rpc.protocol), fed random and mutated-valid messages.

Whatever a peer sends, each side either advances (and then only for input that is valid and
signed) or raises RemoteProtocolError carrying a close code from docs/PROTOCOL.md's table;
nothing else escapes, and a failed side stays failed. Budget: the ``fuzz`` profile
(tests/conftest.py).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvasir_rpc._errors import CloseCode, LocalProtocolError, RemoteProtocolError
from kvasir_rpc._gen.kvasir.v1 import session_pb2
from kvasir_rpc._handshake import HELLO_SIGNATURE_DOMAIN, NONCE_BYTES, HubHandshake, WorkerHandshake
from kvasir_rpc._wallet import Wallet, verify_signature
from kvasir_rpc.protocol import (
    CONTROL_WORDS,
    HUB_TRANSITIONS,
    WORKER_TRANSITIONS,
    Close,
    Closed,
    Data,
    Discarded,
    Eof,
    HubTunnel,
    Open,
    TunnelState,
    WorkerTunnel,
)

pytestmark = pytest.mark.fuzz
FUZZ = settings.get_profile("fuzz")

HUB = Wallet.generate()
WORKER = Wallet.generate()
NOW = 1_700_000_000_000
NONCE = bytes(range(NONCE_BYTES))
# The codes a handshake may answer with (docs/PROTOCOL.md, "Close codes"): the hub's refusals of
# a hello (4100 breaks the rules, 4201 answers another challenge), the worker's of a challenge
# or an accept (1008; 4104 another hub key than the pinned one).
HANDSHAKE_CODES = {CloseCode.PROTOCOL_ERROR, CloseCode.POLICY_VIOLATION, CloseCode.MESSAGE_TOO_BIG,
                   CloseCode.HELLO_INVALID, CloseCode.HELLO_STALE, CloseCode.HUB_KEY_MISMATCH}


def worker(**kw: object) -> WorkerHandshake:
    return WorkerHandshake(WORKER, slices={0: (0, 1), 2: (3,)}, weights_digest=bytes(32), device="cpu",
                           model_type="qwen3_moe", worker_version="0.1.0", **kw)  # type: ignore[arg-type]


def hub() -> tuple[HubHandshake, bytes]:
    h = HubHandshake(HUB, clock_ms=lambda: NOW, nonce=NONCE)
    return h, h.challenge()


def valid_hello() -> bytes:
    return worker().receive_challenge(hub()[1])


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply (kind, position, value) edits: 0 flips a byte, 1 deletes one, 2 inserts one."""
    out = bytearray(data)
    for kind, pos, value in edits:
        if not out and kind != 2:
            continue
        i = pos % (len(out) + (kind == 2)) if out or kind == 2 else 0
        if kind == 0:
            out[i] ^= value or 1
        elif kind == 1:
            del out[i]
        else:
            out.insert(i, value)
    return bytes(out)


EDITS = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=6)


def resigned_bodies() -> st.SearchStrategy[bytes]:
    """Hellos whose body fields are random but correctly signed by the worker's wallet: the
    hub must check each field, not only the signature."""
    layer = st.builds(lambda lay, experts: session_pb2.ExpertSlice(layer=lay, experts=experts),
                      st.integers(0, 5000), st.lists(st.integers(0, 70000), max_size=5))

    def build(nonce: bytes, hub_key: str, wallet: Wallet, slices: list[session_pb2.ExpertSlice], digest: bytes,
              device: str) -> bytes:
        body = session_pb2.HelloBody(nonce=nonce, hub_key=hub_key, wallet=wallet.address, slices=slices,
                                     weights_digest=digest, device=device).SerializeToString()
        return session_pb2.SessionHello(body=body, signature=wallet.sign(HELLO_SIGNATURE_DOMAIN + body)).SerializeToString()

    return st.builds(build, st.sampled_from([NONCE, NONCE[:-1], bytes(32)]),
                     st.sampled_from([HUB.address, WORKER.address, "", HUB.address.upper()]),
                     st.just(WORKER), st.lists(layer, max_size=4), st.sampled_from([bytes(32), b"", bytes(31)]),
                     st.text(max_size=80))


HELLOS = st.one_of(
    st.binary(max_size=300),
    st.builds(mutate, st.just(valid_hello()), EDITS),
    st.builds(lambda cut: valid_hello()[:cut], st.integers(0, len(valid_hello()))),
    resigned_bodies(),
)


@FUZZ
@given(HELLOS)
def test_the_hub_accepts_only_a_valid_signed_hello_and_refuses_the_rest_with_a_spec_code(data: bytes) -> None:
    h, _ = hub()
    try:
        info = h.receive_hello(data)
    except RemoteProtocolError as exc:
        assert exc.close_code in HANDSHAKE_CODES, exc.close_code
        assert exc.reason
        with pytest.raises(LocalProtocolError):  # failed for good: no second try on this handshake
            h.receive_hello(valid_hello())
        return
    hello = session_pb2.SessionHello.FromString(data)
    body = session_pb2.HelloBody.FromString(hello.body)
    assert verify_signature(body.wallet, HELLO_SIGNATURE_DOMAIN + hello.body, hello.signature)
    assert (body.nonce, body.hub_key, info.wallet) == (NONCE, HUB.address, body.wallet)
    assert len(info.weights_digest) == 32


CHALLENGES = st.one_of(
    st.binary(max_size=200),
    st.builds(mutate, st.just(hub()[1]), EDITS),
    st.builds(lambda nonce, key, t: session_pb2.SessionChallenge(nonce=nonce, hub_key=key, issued_at_unix_ms=t)
              .SerializeToString(),
              st.binary(max_size=40), st.sampled_from([HUB.address, "", "x" * 64, HUB.address[:63]]),
              st.integers(-(1 << 63), (1 << 63) - 1)),
)


@FUZZ
@given(CHALLENGES, st.binary(max_size=200), st.booleans())
def test_the_worker_answers_any_challenge_and_accept_with_a_hello_or_a_spec_code(
        challenge: bytes, accept: bytes, pinned: bool) -> None:
    w = worker(expected_hub_key=HUB.address if pinned else None)
    try:
        hello = w.receive_challenge(challenge)
    except RemoteProtocolError as exc:
        assert exc.close_code in HANDSHAKE_CODES
        return
    ch = session_pb2.SessionChallenge.FromString(challenge)
    assert len(ch.nonce) == NONCE_BYTES and w.hub_key == ch.hub_key
    assert not pinned or ch.hub_key == HUB.address
    body = session_pb2.HelloBody.FromString(session_pb2.SessionHello.FromString(hello).body)
    assert body.nonce == ch.nonce and body.wallet == WORKER.address
    try:
        session_id = w.receive_accept(accept)
    except RemoteProtocolError as exc:
        assert exc.close_code in HANDSHAKE_CODES
        return
    assert session_id == session_pb2.SessionAccept.FromString(accept).session_id and 0 < len(session_id) <= 128


# -- the tunnel's control cores --------------------------------------------------------------

PEER_MESSAGES = st.one_of(st.sampled_from(sorted(CONTROL_WORDS)), st.binary(max_size=20), st.text(max_size=10))
HUB_OPS = st.lists(st.one_of(st.tuples(st.just("recv"), PEER_MESSAGES),
                             st.tuples(st.sampled_from(["open", "close", "send"]), st.just(b"h2"))), max_size=30)
WORKER_OPS = st.lists(st.one_of(st.tuples(st.just("recv"), PEER_MESSAGES),
                                st.tuples(st.sampled_from(["eof", "closed", "send"]), st.just(b"h2"))), max_size=30)
EXPECTED_EVENT = {  # (side, state before, what arrived) -> the event's type
    ("hub", TunnelState.OPEN, "data"): Data, ("hub", TunnelState.OPEN, "eof"): Eof,
    ("hub", TunnelState.CLOSING, "data"): Discarded, ("hub", TunnelState.CLOSING, "eof"): Discarded,
    ("hub", TunnelState.CLOSING, "closed"): Closed,
    ("worker", TunnelState.IDLE, "open"): Open, ("worker", TunnelState.OPEN, "close"): Close,
    ("worker", TunnelState.EOF, "close"): Close, ("worker", TunnelState.OPEN, "data"): Data,
    ("worker", TunnelState.EOF, "data"): Data,
}


def drive(side: HubTunnel | WorkerTunnel, ops: list[tuple[str, object]]) -> None:
    name = "hub" if isinstance(side, HubTunnel) else "worker"
    table = HUB_TRANSITIONS if name == "hub" else WORKER_TRANSITIONS
    for op, arg in ops:
        before = side.state
        if op != "recv":
            try:
                if op == "send":
                    side.send_data(arg)  # type: ignore[arg-type]
                else:
                    getattr(side, op)()
            except LocalProtocolError:
                assert side.state is before  # our own misuse changes nothing
            continue
        msg = arg
        what = "data" if isinstance(msg, bytes) else msg
        try:
            event = side.receive(msg)  # type: ignore[arg-type]
        except RemoteProtocolError as exc:
            assert exc.close_code == CloseCode.PROTOCOL_ERROR
            assert (before, f"recv {what}") not in table and side.state is before
            return  # the connection is closed with 1002: nothing more arrives
        assert side.state is table[(before, f"recv {what}")]
        assert type(event) is EXPECTED_EVENT[(name, before, what)], (name, before, what, event)
        if isinstance(event, Data):
            assert event.data == msg
        if isinstance(event, Discarded):
            assert event.nbytes == (len(msg) if isinstance(msg, bytes) else 0)


@FUZZ
@given(HUB_OPS)
def test_the_hub_tunnel_follows_its_table_or_raises_1002(ops: list[tuple[str, object]]) -> None:
    drive(HubTunnel(), ops)


@FUZZ
@given(WORKER_OPS)
def test_the_worker_tunnel_follows_its_table_or_raises_1002(ops: list[tuple[str, object]]) -> None:
    drive(WorkerTunnel(), ops)
