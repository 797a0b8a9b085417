"""The multiplexed tunnel (docs/PROTOCOL.md 5.5), sans I/O: negotiated in the handshake and
signed by the hub; per-channel state machines; framing errors closing with 1002; and the
worker's turns, which give each backbone's stream a call for every call of another."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvasir_rpc import CloseCode, HubHandshake, LocalProtocolError, RemoteProtocolError, Wallet, WorkerHandshake
from kvasir_rpc._gen.kvasir.v1 import session_pb2
from kvasir_rpc.protocol import (
    MAX_TUNNEL_CHANNELS,
    Close,
    Closed,
    Data,
    Discarded,
    Eof,
    MuxHubTunnel,
    MuxWorkerTunnel,
    Open,
    TunnelState,
)
from worker._service import Turns

HUB = Wallet.generate()
WORKER = Wallet.generate()


def _handshake(offer: int, hub_max: int, *, tamper=None):  # type: ignore[no-untyped-def]
    hub = HubHandshake(HUB, tunnel_channels=hub_max)
    worker = WorkerHandshake(WORKER, slices={0: (0, 1)}, weights_digest=bytes(32), device="cpu",
                             tunnel_channels=offer)
    info = hub.receive_hello(worker.receive_challenge(hub.challenge()))
    accept = hub.accept("s1")
    if tamper is not None:
        msg = session_pb2.SessionAccept()
        msg.ParseFromString(accept)
        tamper(msg)
        accept = msg.SerializeToString()
    worker.receive_accept(accept)
    return hub, worker, info


@pytest.mark.parametrize("offer,hub_max,chosen", [(8, 8, 8), (8, 4, 4), (4, 16, 4), (0, 8, 0), (8, 0, 0),
                                                   (8, 1, 0), (1, 8, 0), (2, 2, 2), (64, 64, 64)])
def test_the_channels_are_the_smaller_offer_and_both_sides_agree(offer, hub_max, chosen):
    hub, worker, info = _handshake(offer, hub_max)
    assert hub.channels == worker.channels == info.tunnel_channels == chosen


@pytest.mark.parametrize("forged", [2, 4, 7, 0])
def test_a_relay_that_changes_the_channels_breaks_the_hubs_signature(forged):
    def change(msg):  # type: ignore[no-untyped-def]
        msg.tunnel_channels = forged

    with pytest.raises(RemoteProtocolError) as caught:
        _handshake(8, 8, tamper=change)
    assert caught.value.close_code == CloseCode.POLICY_VIOLATION and "bad signature" in caught.value.reason


@pytest.mark.parametrize("forged", [1, 9, 16, 65])
def test_channels_the_worker_did_not_offer_are_refused_before_the_signature(forged):
    def change(msg):  # type: ignore[no-untyped-def]
        msg.tunnel_channels = forged

    with pytest.raises(RemoteProtocolError) as caught:
        _handshake(8, 8, tamper=change)
    assert caught.value.close_code == CloseCode.POLICY_VIOLATION
    assert f"a tunnel of {forged} channels; this worker offered 8" in caught.value.reason


def test_a_hello_offering_more_than_64_channels_is_refused():
    hub = HubHandshake(HUB, tunnel_channels=8)
    worker = WorkerHandshake(WORKER, slices={0: (0,)}, weights_digest=bytes(32), device="cpu")
    hello = session_pb2.SessionHello()
    hello.ParseFromString(worker.receive_challenge(hub.challenge()))
    body = session_pb2.HelloBody()
    body.ParseFromString(hello.body)
    body.tunnel_channels = MAX_TUNNEL_CHANNELS + 1
    raw = body.SerializeToString()
    from kvasir_rpc.protocol import HELLO_SIGNATURE_DOMAIN

    forged = session_pb2.SessionHello(body=raw, signature=WORKER.sign(HELLO_SIGNATURE_DOMAIN + raw))
    with pytest.raises(RemoteProtocolError) as caught:
        hub.receive_hello(forged.SerializeToString())
    assert caught.value.close_code == CloseCode.HELLO_INVALID and "at most 64" in caught.value.reason


def test_a_worker_cannot_offer_more_than_64():
    with pytest.raises(ValueError, match="0 to 64"):
        WorkerHandshake(WORKER, slices={0: (0,)}, weights_digest=bytes(32), device="cpu", tunnel_channels=65)


def test_two_connections_interleave_each_with_its_own_state():
    hub, worker = MuxHubTunnel(4), MuxWorkerTunnel(4)
    a = hub.free()
    assert worker.receive(hub.open(a)) == (a, Open())
    b = hub.free()
    assert b != a and worker.receive(hub.open(b)) == (b, Open())
    assert worker.receive(hub.send_data(b, b"to b")) == (b, Data(b"to b"))
    assert hub.receive(worker.send_data(a, b"from a")) == (a, Data(b"from a"))
    # b's server ends it while a goes on.
    assert hub.receive(worker.eof(b)) == (b, Eof())
    assert worker.receive(hub.send_data(a, b"more")) == (a, Data(b"more"))
    assert worker.receive(hub.close(b)) == (b, Close())
    assert hub.state(b) is TunnelState.CLOSING and hub.state(a) is TunnelState.OPEN
    # Late bytes of b, in flight when the worker saw close: discarded, not a's.
    assert hub.receive(worker.send_data(b, b"late")) == (b, Discarded(4))
    assert hub.receive(worker.closed(b)) == (b, Closed())
    assert hub.free() == b  # reusable at once
    assert worker.receive(hub.open(b)) == (b, Open())


def test_every_channel_busy_means_no_free_one():
    hub = MuxHubTunnel(2)
    hub.open(0)
    hub.open(1)
    assert hub.free() is None
    with pytest.raises(LocalProtocolError):
        hub.open(0)


@pytest.mark.parametrize("msg,says", [
    ("open", "a word and a channel"),
    ("open  1", "decimal"),
    ("open 01", "decimal"),
    ("open 4", "channel 4 of a tunnel of 4"),
    ("open -1", "decimal"),
    ("open 1 ", "decimal"),
    ("nope 1", "unknown control"),
    (b"\x00", "at least one byte"),
    (b"\x00\x00", "at least one byte"),
    (b"\x00\x09data", "channel 9 of a tunnel of 4"),
    ("closed 0", "while the tunnel is IDLE"),  # a channel's own machine: nothing was opened
    (b"\x00\x01data", "while the tunnel is IDLE"),
])
def test_framing_and_order_errors_close_with_1002(msg, says):
    hub = MuxHubTunnel(4)
    worker = MuxWorkerTunnel(4)
    side = hub if not (isinstance(msg, str) and msg.startswith(("open", "nope"))) else worker
    with pytest.raises(RemoteProtocolError) as caught:
        side.receive(msg)
    assert caught.value.close_code == CloseCode.PROTOCOL_ERROR and says in caught.value.reason


@pytest.mark.parametrize("n", [0, 1, 65])
def test_a_tunnel_of_fewer_than_2_or_more_than_64_channels_is_a_bug(n):
    with pytest.raises(ValueError):
        MuxHubTunnel(n)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=12), st.text(max_size=12)))
def test_any_message_is_an_event_or_a_1002(msg):
    hub = MuxHubTunnel(3)
    hub.open(1)
    try:
        channel, event = hub.receive(msg)
    except RemoteProtocolError as exc:
        assert exc.close_code == CloseCode.PROTOCOL_ERROR
    else:
        assert channel == 1 and isinstance(event, (Data, Eof))


def test_turns_rotate_between_streams_whatever_one_sends():
    turns = Turns()
    order: list[str] = []
    gate = threading.Event()

    def stream(name: str, calls: int) -> None:
        me = object()
        for _ in range(calls):
            turns.take(me)
            order.append(name)
            gate.wait(5)
            time.sleep(0.002)
            turns.give_back()

    first = object()
    turns.take(first)  # a call computing: the two streams queue behind it
    threads = [threading.Thread(target=stream, args=(name, 6)) for name in ("a", "b")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while len(turns._waiting) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    gate.set()
    turns.give_back()
    for t in threads:
        t.join(10)
    assert sorted(order) == ["a"] * 6 + ["b"] * 6
    # Strictly alternating once both wait: neither gets two turns while the other waits.
    assert all(x != y for x, y in zip(order, order[1:]))
    assert turns.waited >= 10


def test_one_stream_alone_never_waits():
    turns = Turns()
    me = object()
    for _ in range(100):
        turns.take(me)
        turns.give_back()
    assert turns.waited == 0 and turns.turns == 100
