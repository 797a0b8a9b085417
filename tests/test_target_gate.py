"""The target gate (relay.hub._target_gate), sans I/O: fed whole, a byte at a time and with
trailing data; any input gives a verdict, asks for more or raises RemoteProtocolError; and
a real grpcio client through a gated splice to a real gRPC server."""

from __future__ import annotations

import threading

import grpc
import hpack
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvasir_rpc._access import TARGET_KEY_METADATA, target_key
from kvasir_rpc._errors import LocalProtocolError, RemoteProtocolError
from relay.hub._target_gate import PREFACE, Admitted, Refused, TargetGate

TOKEN = "t" * 32
SID = "s1-abcdef"
KEY = target_key(TOKEN, SID)


def frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([ftype, flags]) + stream.to_bytes(4, "big") + payload


SETTINGS = frame(4, 0, 0, bytes.fromhex("000300000000" "000400400000"))
WINDOW_UPDATE = frame(8, 0, 0, (1 << 20).to_bytes(4, "big"))
ACK = frame(4, 1, 0)


def block(key: str | None = KEY, extra: list[tuple[str, str]] = ()) -> bytes:  # type: ignore[assignment]
    headers = [(":method", "POST"), (":scheme", "http"), (":path", "/kvasir.v1.ExpertService/Dispatch"),
               (":authority", "127.0.0.1:1"), ("content-type", "application/grpc"), ("te", "trailers"), *extra]
    if key is not None:
        headers.append((TARGET_KEY_METADATA, key))
    return hpack.Encoder().encode(headers)


def headers(key: str | None = KEY, *, stream: int = 1, flags: int = 0x4) -> bytes:
    return frame(1, flags, stream, block(key))


def client_bytes(key: str | None = KEY) -> tuple[bytes, bytes]:
    """What a grpcio client sends, and what the worker must get (the ACK taken out)."""
    head = PREFACE + SETTINGS + WINDOW_UPDATE
    h = headers(key)
    return head + ACK + h, head + h


def feed(gate: TargetGate, data: bytes, how: str):  # type: ignore[no-untyped-def]
    """Feed ``data`` whole, a byte at a time, or in two uneven pieces; the first verdict."""
    if how == "whole":
        pieces = [data]
    elif how == "bytes":
        pieces = [data[i:i + 1] for i in range(len(data))]
    else:
        pieces = [data[:len(data) // 3], data[len(data) // 3:]]
    verdict = None
    for i, piece in enumerate(pieces):
        verdict = gate.receive_data(piece)
        if verdict is not None:
            assert i == len(pieces) - 1, "a verdict before the last byte of the first request"
    return verdict


HOW = ["whole", "bytes", "split"]


def test_server_preface_is_an_empty_settings_frame():
    assert TargetGate(TOKEN, SID).server_preface() == bytes.fromhex("000000040000000000")


@pytest.mark.parametrize("how", HOW)
def test_the_right_key_is_admitted_without_the_ack(how):
    sent, forward = client_bytes()
    verdict = feed(TargetGate(TOKEN, SID), sent, how)
    assert verdict == Admitted(forward)


@pytest.mark.parametrize("how", HOW)
def test_trailing_bytes_are_kept_for_the_worker(how):
    sent, forward = client_bytes()
    # DATA of the first call, then half a frame: forwarded as they are, never parsed.
    trailing = frame(0, 0, 1, b"\x00\x00\x00\x00\x03abc") + b"\x00\x00\x10\x00"
    gate = TargetGate(TOKEN, SID)
    if how == "bytes":
        assert feed(gate, sent, how) == Admitted(forward)
        return
    verdict = gate.receive_data(sent + trailing)
    assert verdict == Admitted(forward + trailing)
    with pytest.raises(LocalProtocolError):
        gate.receive_data(b"more")


@pytest.mark.parametrize("how", HOW)
def test_an_ack_after_the_headers_is_awaited_and_dropped(how):
    # A client that does not wait for our SETTINGS: the verdict waits for its ACK, which
    # must not reach the worker either.
    head = PREFACE + SETTINGS
    h = headers()
    ping = frame(6, 0, 0, bytes(8))
    verdict = feed(TargetGate(TOKEN, SID), head + h + ping + ACK, how)
    assert verdict == Admitted(head + h + ping)


def test_only_the_first_ack_is_dropped():
    sent, forward = client_bytes()
    later_ack = ACK
    gate = TargetGate(TOKEN, SID)
    assert gate.receive_data(PREFACE + SETTINGS + ACK + later_ack + headers()) == Admitted(
        PREFACE + SETTINGS + later_ack + headers())


@pytest.mark.parametrize("how", HOW)
def test_continuation_padding_and_priority(how):
    b = block()
    cut = len(b) // 2
    pad = 5
    first = frame(1, 0x8 | 0x20, 3, bytes([pad]) + (1).to_bytes(4, "big") + b"\x10" + b[:cut] + bytes(pad))
    cont = frame(9, 0x4, 3, b[cut:])
    sent = PREFACE + SETTINGS + ACK + first + cont
    assert feed(TargetGate(TOKEN, SID), sent, how) == Admitted(PREFACE + SETTINGS + first + cont)


@pytest.mark.parametrize(
    ("key", "why"),
    [(None, "no kvasir-target-key"), ("0" * 64, "wrong kvasir-target-key"),
     (target_key(TOKEN, "s2-other"), "wrong kvasir-target-key"), (target_key("u" * 32, SID), "wrong")],
    ids=["missing", "zeros", "other-session", "other-token"],
)
@pytest.mark.parametrize("how", HOW)
def test_a_missing_or_wrong_key_is_refused_with_a_reason(key, why, how):
    sent, _ = client_bytes(key)
    verdict = feed(TargetGate(TOKEN, SID), sent, how)
    assert isinstance(verdict, Refused) and why in verdict.reason
    # The reply: HEADERS (END_STREAM | END_HEADERS) on stream 1 with grpc-status 7, alone.
    reply = verdict.reply
    n = int.from_bytes(reply[:3], "big")
    assert reply[3:5] == b"\x01\x05" and int.from_bytes(reply[5:9], "big") == 1
    answer = dict(hpack.Decoder().decode(reply[9:9 + n]))
    assert answer["grpc-status"] == "7" and why in answer["grpc-message"]
    assert len(reply) == 9 + n


def test_two_keys_are_refused():
    b = block(extra=[(TARGET_KEY_METADATA, KEY)])
    verdict = TargetGate(TOKEN, SID).receive_data(PREFACE + SETTINGS + ACK + frame(1, 4, 1, b))
    assert isinstance(verdict, Refused) and "2 kvasir-target-key" in verdict.reason


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", "client preface"),
        (PREFACE + WINDOW_UPDATE, "other frame"),
        (PREFACE + ACK, "SETTINGS ACK"),
        (PREFACE + frame(4, 0, 0, b"\x00"), "multiple of 6"),
        (PREFACE + frame(4, 0, 1), "stream other than 0"),
        (PREFACE + frame(4, 1, 0, bytes(6)), "ACK with a payload"),
        (PREFACE + SETTINGS + frame(0, 0, 1, bytes(17_000)), "exceeds the default maximum"),
        (PREFACE + SETTINGS + frame(1, 4, 2, block()), "odd streams"),
        (PREFACE + SETTINGS + frame(1, 4, 0, block()), "odd streams"),
        (PREFACE + SETTINGS + frame(5, 4, 1, bytes(4)), "PUSH_PROMISE"),
        (PREFACE + SETTINGS + frame(9, 4, 1, block()), "CONTINUATION"),
        (PREFACE + SETTINGS + frame(1, 0, 1, block()) + frame(6, 0, 0, bytes(8)), "in state 'header block'"),
        (PREFACE + SETTINGS + frame(1, 0, 1, block()) + frame(9, 4, 3, b""), "CONTINUATION on stream 3"),
        (PREFACE + SETTINGS + frame(1, 0x8, 1, b""), "without a pad length"),
        (PREFACE + SETTINGS + frame(1, 0x8 | 0x4, 1, b"\x09abc"), "longer than the frame"),
        (PREFACE + SETTINGS + frame(1, 0x20 | 0x4, 1, b"abc"), "longer than the frame"),
        (PREFACE + SETTINGS + frame(1, 0x4, 1, b"\xff\xff\xff\xff\xff"), "do not decode"),
        (PREFACE + SETTINGS + frame(1, 0x4, 1, b"\x3f\xe1\xff\x03"), "do not decode"),  # table size > 4096
    ],
)
@pytest.mark.parametrize("how", HOW)
def test_malformed_input_raises_the_protocol_error(data, match, how):
    with pytest.raises(RemoteProtocolError, match=match):
        feed(TargetGate(TOKEN, SID), data, how)


def test_more_than_the_bound_before_the_first_request_is_refused():
    gate = TargetGate(TOKEN, SID, max_bytes=1000)
    gate.receive_data(PREFACE + SETTINGS + ACK)
    ping = frame(6, 0, 0, bytes(8))
    with pytest.raises(RemoteProtocolError, match="more than 1000 bytes"):
        for _ in range(100):
            gate.receive_data(ping)
    # Also when the bytes stop halfway through a frame that would cross the bound.
    gate = TargetGate(TOKEN, SID, max_bytes=1000)
    with pytest.raises(RemoteProtocolError, match="more than 1000 bytes"):
        gate.receive_data(PREFACE + SETTINGS + frame(0, 0, 1, bytes(2000))[:1500])


def _check_any(data: bytes, pieces: int) -> None:
    gate = TargetGate(TOKEN, SID, max_bytes=4096)
    step = max(1, len(data) // pieces)
    try:
        for i in range(0, max(len(data), 1), step):
            verdict = gate.receive_data(data[i:i + step])
            if verdict is not None:
                assert isinstance(verdict, (Admitted, Refused))
                return
    except RemoteProtocolError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600), st.booleans(), st.integers(1, 7))
def test_any_bytes_give_a_verdict_more_or_the_protocol_error(data, with_preface, pieces):
    _check_any((PREFACE if with_preface else b"") + data, pieces)


_frames = st.builds(
    frame,
    st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0x0A, 0xFF]),
    st.integers(0, 255),
    st.sampled_from([0, 1, 2, 3, 0x7FFF_FFFF, 0xFFFF_FFFF]),
    st.one_of(st.binary(max_size=40), st.builds(block, st.sampled_from([KEY, None, "x"])),
              st.builds(lambda b, p: bytes([p]) + b, st.builds(block), st.integers(0, 255))),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_frames, max_size=8), st.integers(1, 5))
def test_any_frames_give_a_verdict_more_or_the_protocol_error(frames, pieces):
    _check_any(PREFACE + SETTINGS + b"".join(frames), pieces)


# --- a real grpcio client through a gated splice --------------------------------------------

_METHOD = "/test.Echo/Echo"


def _echo_server() -> tuple[grpc.Server, int]:
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req + b"!")})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


async def _gated_proxy(backend_port: int, verdicts: list[object], *, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
    """What the hub does, minus the tunnel: gate each connection, then splice it to a real
    gRPC server (the worker's part)."""

    async def handle(client: trio.SocketStream) -> None:
        gate = TargetGate(TOKEN, SID)
        with trio.fail_after(10):
            await client.send_all(gate.server_preface())
            verdict = None
            while verdict is None:
                data = await client.receive_some(65536)
                if not data:
                    return
                verdict = gate.receive_data(data)
        verdicts.append(verdict)
        if isinstance(verdict, Refused):
            await client.send_all(verdict.reply)
            await client.send_eof()
            with trio.move_on_after(5):
                while await client.receive_some(65536):
                    pass
            return
        backend = await trio.open_tcp_stream("127.0.0.1", backend_port)
        await backend.send_all(verdict.forward)

        async def pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
            try:
                while data := await src.receive_some(65536):
                    await dst.send_all(data)
            except trio.BrokenResourceError:
                pass
            nursery.cancel_scope.cancel()

        async with backend, trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, backend)
            nursery.start_soon(pump, backend, client)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


@pytest.mark.integration
def test_a_real_grpc_client_through_the_gate():
    server, backend_port = _echo_server()
    verdicts: list[object] = []
    results: dict[str, object] = {}

    def client(port: int) -> None:
        for name, metadata in [("right", ((TARGET_KEY_METADATA, KEY),)), ("none", ()),
                               ("wrong", ((TARGET_KEY_METADATA, "0" * 64),))]:
            # Its own connection each: by default grpcio shares one between channels to the
            # same address, and the gate admits connections, not calls.
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
                echo = ch.unary_unary(_METHOD)
                try:
                    # Two calls on one connection: the splice carries on after the first.
                    results[name] = [echo(b"hi", metadata=metadata, timeout=10),
                                     echo(b"again", metadata=metadata, timeout=10)]
                except grpc.RpcError as exc:
                    results[name] = (exc.code(), exc.details())

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_gated_proxy, backend_port, verdicts)
            with trio.fail_after(60):
                await trio.to_thread.run_sync(client, port)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        server.stop(None)
    assert results["right"] == [b"hi!", b"again!"]
    for name in ("none", "wrong"):
        code, details = results[name]  # type: ignore[misc]
        assert code == grpc.StatusCode.PERMISSION_DENIED, (name, results[name])
        assert "kvasir-target-key" in details
    admitted = verdicts[0]
    assert isinstance(admitted, Admitted) and admitted.forward.startswith(PREFACE)
    assert [type(v) for v in verdicts[1:]] == [Refused, Refused]
