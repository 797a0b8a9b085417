"""The sans-IO tunnel control and gateway pairing (kvasir_rpc.protocol), against the committed
vectors and exhaustively over every state and message."""

from __future__ import annotations

import json
import pathlib

import pytest

from kvasir_rpc import protocol as p

VECTORS = pathlib.Path(__file__).resolve().parent / "vectors"
CONTROL = json.loads((VECTORS / "tunnel_control.json").read_text())
PAIRING = json.loads((VECTORS / "gateway_pairing.json").read_text())


def _message(m: dict) -> bytes | str:
    return m["text"] if "text" in m else bytes.fromhex(m["binary_hex"])


def _send(side: p.HubTunnel | p.WorkerTunnel, msg: bytes | str) -> bytes | str:
    if isinstance(msg, bytes):
        return side.send_data(msg)
    if isinstance(side, p.HubTunnel):
        return {"open": side.open, "close": side.close}[msg]()
    return {"eof": side.eof, "closed": side.closed}[msg]()


@pytest.mark.parametrize("seq", CONTROL["sequences"], ids=[s["name"] for s in CONTROL["sequences"]])
def test_control_vectors(seq):
    side = p.HubTunnel() if seq["side"] == "hub" else p.WorkerTunnel()
    for step in seq["steps"]:
        if "send" in step:
            msg = _message(step["send"])
            if step.get("local_error"):
                with pytest.raises((p.LocalProtocolError, KeyError)):
                    _send(side, msg)
                continue
            assert _send(side, msg) == msg
        else:
            msg = _message(step["receive"])
            if "error" in step:
                with pytest.raises(p.RemoteProtocolError) as info:
                    side.receive(msg)
                assert info.value.close_code == step["error"]["close_code"]
                continue
            event = side.receive(msg)
            assert type(event).__name__ == step["event"]
            if isinstance(event, p.Data):
                assert event.data == msg
        assert side.state.value == step["state"], step


MESSAGES: list[bytes | str] = [b"\x00\x01", *sorted(p.CONTROL_WORDS), "OPEN", ""]


def _reach(side_cls, state: p.TunnelState):  # type: ignore[no-untyped-def]
    """A side brought to ``state`` by legal steps."""
    side = side_cls()
    hub = isinstance(side, p.HubTunnel)
    path = {
        p.TunnelState.IDLE: [],
        p.TunnelState.OPEN: [("open",)] if hub else [("recv", "open")],
        p.TunnelState.EOF: [("open",), ("recv", "eof")] if hub else [("recv", "open"), ("eof",)],
        p.TunnelState.CLOSING: [("open",), ("close",)] if hub else [("recv", "open"), ("recv", "close")],
    }[state]
    for step in path:
        if step[0] == "recv":
            side.receive(step[1])
        else:
            getattr(side, step[0])()
    assert side.state is state
    return side


@pytest.mark.parametrize("side_cls", [p.HubTunnel, p.WorkerTunnel])
@pytest.mark.parametrize("state", list(p.TunnelState))
@pytest.mark.parametrize("msg", MESSAGES, ids=repr)
def test_every_received_message_in_every_state(side_cls, state, msg):
    """What the table allows gives an event and its next state; everything else is a 1002 and
    leaves the state alone (the trio code then closes the tunnel)."""
    side = _reach(side_cls, state)
    table = p.HUB_TRANSITIONS if side_cls is p.HubTunnel else p.WORKER_TRANSITIONS
    what = "data" if isinstance(msg, bytes) else msg
    nxt = table.get((state, f"recv {what}"))
    if nxt is None:
        with pytest.raises(p.RemoteProtocolError) as info:
            side.receive(msg)
        assert info.value.close_code == p.CloseCode.PROTOCOL_ERROR
        assert side.state is state
    else:
        side.receive(msg)
        assert side.state is nxt


@pytest.mark.parametrize("side_cls", [p.HubTunnel, p.WorkerTunnel])
@pytest.mark.parametrize("state", list(p.TunnelState))
def test_every_send_in_every_state(side_cls, state):
    hub = side_cls is p.HubTunnel
    table = p.HUB_TRANSITIONS if hub else p.WORKER_TRANSITIONS
    sends = {"open": "open", "close": "close", "send_data": "data"} if hub else \
        {"eof": "eof", "closed": "closed", "send_data": "data"}
    for method, what in sends.items():
        side = _reach(side_cls, state)
        args = (b"x",) if method == "send_data" else ()
        nxt = table.get((state, f"send {what}"))
        if nxt is None:
            with pytest.raises(p.LocalProtocolError):
                getattr(side, method)(*args)
            assert side.state is state
        else:
            getattr(side, method)(*args)
            assert side.state is nxt


def test_data_messages_are_bounded():
    hub = p.HubTunnel()
    hub.open()
    with pytest.raises(p.LocalProtocolError):
        hub.send_data(b"\0" * (p.READ_BYTES + 1))
    assert hub.send_data(b"\0" * p.READ_BYTES)


def test_connections_are_counted():
    hub, worker = p.HubTunnel(), p.WorkerTunnel()
    for n in (1, 2):
        worker.receive(hub.open())
        worker.receive(hub.close())
        hub.receive(worker.closed())
        assert hub.connections == worker.connections == n


def test_hub_and_worker_in_lockstep_never_mix_connections():
    """Two sans-IO sides wired back to back: every byte a side sends while OPEN arrives as Data
    of the same connection, late bytes after "close" are Discarded, never delivered."""
    hub, worker = p.HubTunnel(), p.WorkerTunnel()
    delivered: list[tuple[int, bytes]] = []
    worker.receive(hub.open())
    assert isinstance(worker.receive(hub.send_data(b"req1")), p.Data)
    ev = hub.receive(worker.send_data(b"resp1"))
    assert isinstance(ev, p.Data)
    delivered.append((hub.connections, ev.data))
    close = hub.close()
    late = worker.send_data(b"late")  # in flight when "close" arrives
    assert isinstance(hub.receive(late), p.Discarded)
    worker.receive(close)
    assert isinstance(hub.receive(worker.closed()), p.Closed)
    worker.receive(hub.open())
    ev = hub.receive(worker.send_data(b"resp2"))
    assert isinstance(ev, p.Data)
    delivered.append((hub.connections, ev.data))
    assert delivered == [(1, b"resp1"), (2, b"resp2")]


def test_subprotocol_choice():
    assert p.choose_subprotocol(["x", p.TUNNEL_SUBPROTOCOL]) == p.TUNNEL_SUBPROTOCOL
    assert p.choose_subprotocol(["kvasir.tunnel.v0"]) is None
    assert p.choose_subprotocol(["kvasir.tunnel.v9", "kvasir.tunnel.v1"], ["kvasir.tunnel.v9", "kvasir.tunnel.v1"]) \
        == "kvasir.tunnel.v9"


@pytest.mark.parametrize("case", PAIRING["encode"])
def test_pairing_encode_vectors(case):
    assert p.encode_pair(p.PairRequest(case["pair"], case["remote"])) == case["text"]


@pytest.mark.parametrize("case", PAIRING["valid"])
def test_pairing_decode_vectors(case):
    assert p.decode_pair(case["text"]) == p.PairRequest(case["pair"], case["remote"])


@pytest.mark.parametrize("text", PAIRING["invalid"])
def test_pairing_malformed_vectors(text):
    with pytest.raises(p.RemoteProtocolError) as info:
        p.decode_pair(text)
    assert info.value.close_code == p.CloseCode.PROTOCOL_ERROR


def test_pairing_bounds():
    with pytest.raises(p.RemoteProtocolError):
        p.decode_pair(b'{"pair":"abcdefgh"}')  # type: ignore[arg-type]
    with pytest.raises(p.RemoteProtocolError):
        p.decode_pair('{"pair":"abcdefgh","pad":"' + "x" * 2000 + '"}')
    assert p.decode_pair(p.encode_pair(p.PairRequest("abcdefgh", "r" * 100))).remote == "r" * 64
    with pytest.raises(ValueError):
        p.PairRequest("bad id!")


def test_protocol_imports_no_protobuf_grpc_or_torch():
    import subprocess
    import sys

    code = ("import sys, kvasir_rpc.protocol; "
            "print(sorted(m for m in ('google.protobuf', 'grpc', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=pathlib.Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "[]", out.stderr


MUX = CONTROL["multiplexed"]["sequences"]


@pytest.mark.parametrize("seq", MUX, ids=[s["name"] for s in MUX])
def test_multiplexed_control_vectors(seq):
    side = p.MuxHubTunnel(seq["channels"]) if seq["side"] == "hub" else p.MuxWorkerTunnel(seq["channels"])
    for step in seq["steps"]:
        if "send" in step:
            msg, channel = _message(step["send"]), step["channel"]
            if isinstance(msg, bytes):
                assert int.from_bytes(msg[:2], "big") == channel
                sent = side.send_data(channel, msg[2:])
            else:
                word, number = msg.split(" ")
                assert int(number) == channel
                sent = getattr(side, word)(channel)
            assert sent == msg
        else:
            msg = _message(step["receive"])
            if "error" in step:
                with pytest.raises(p.RemoteProtocolError) as info:
                    side.receive(msg)
                assert info.value.close_code == step["error"]["close_code"]
                continue
            channel, event = side.receive(msg)
            assert channel == step["channel"] and type(event).__name__ == step["event"]
            if isinstance(event, p.Data):
                assert bytes(event.data) == msg[2:]
        assert side.state(step["channel"]).value == step["state"], step
