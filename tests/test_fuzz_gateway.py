"""Fuzz tier: the public gateway's intake (``Gateway._handle``), in memory on a fake clock.

Two targets: (1) raw bytes and mutated valid upgrade requests get an HTTP answer or a close,
each counted once as a refusal, never an exception; (2) after a valid upgrade and a splice,
arbitrary WebSocket frames from the worker (any opcode, RSV bits, mask, length encoding,
fragmentation, close payload, truncation) are relayed or answered with a close code, and no
exception escapes. After each example the gateway's tables and buffers are back to empty: no
session, no waiting worker, no address counted, no buffered byte. A hang fails at the
fake-clock deadline. Budget: the ``fuzz`` profile (tests/conftest.py).
"""

from __future__ import annotations

import struct

import pytest
import trio
import trio.testing
from hypothesis import event as note_case
from hypothesis import given, settings
from hypothesis import strategies as st
from probes import GOOD
from structlog.testing import capture_logs
from wsmem import MemClient, open_client
from wsproto.events import CloseConnection

from kvasir_rpc.protocol import (
    GATEWAY_SUBPROTOCOL,
    HUB_CONTROL_PATH,
    HUB_DATA_PREFIX,
    TUNNEL_SUBPROTOCOL,
    WORKER_PATH,
    decode_pair,
)
from relay.gateway._gateway import Gateway, GatewayConfig

pytestmark = pytest.mark.fuzz
FUZZ = settings.get_profile("fuzz")

TOKEN = "s3cret-hub-token"
AUTH = [(b"authorization", f"Bearer {TOKEN}".encode())]
WORKER_ADDR = "203.0.113.7:50123"
HUB_ADDR = "10.0.0.2:40000"
BUDGET_S = 600.0  # fake seconds an example may take
MAX_MESSAGE = 4096
CONFIG = dict(hub_token=TOKEN, keepalive_s=1000.0, idle_timeout_s=200.0, handshake_timeout_s=30.0,
              max_message_bytes=MAX_MESSAGE, max_buffered_bytes=3000, message_deadline_s=50.0)
# What the gateway itself may close with (docs/PROTOCOL.md): going away, protocol error,
# invalid payload (wsproto's 1007), policy, too big, and its own refusals (no hub, the pairing
# time, buffers full, a message past its deadline, a pairing gone).
GATEWAY_CODES = {1000, 1001, 1002, 1007, 1008, 1009, 1011, 4206, 4207, 4208, 4209, 4210}
HTTP_STATUSES = {200, 400, 401, 404, 405, 414, 426, 429, 431, 501, 503}  # 501: h11 on an unsupported Transfer-Encoding


def run(fn):  # type: ignore[no-untyped-def]
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def assert_empty(gateway: Gateway) -> None:
    stats = gateway.statistics()
    assert (stats.sessions, stats.unpaired, stats.buffered_bytes, stats.sessions_by_address) == (0, 0, 0, {}), stats
    assert "internal_error" not in stats.refused
    assert gateway._admitting == 0 and not gateway._pending


# -- 1. the HTTP intake ------------------------------------------------------------------------


def _lines() -> list[bytes]:
    return GOOD.rstrip(b"\r\n").split(b"\r\n")


HEADER_POOL = [b"Host: gw.example", b"Host: ", b"Upgrade: websocket", b"Upgrade: h2c", b"Connection: Upgrade",
               b"Connection: keep-alive", b"Sec-WebSocket-Version: 13", b"Sec-WebSocket-Version: 99",
               b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", b"Sec-WebSocket-Key: x",
               b"Sec-WebSocket-Protocol: kvasir.tunnel.v1", b"Sec-WebSocket-Protocol: nope",
               f"Authorization: Bearer {TOKEN}".encode(), b"Authorization: Bearer wrong", b"Content-Length: 5",
               b"Transfer-Encoding: chunked", b"X: " + b"y" * 5000, b"bad header line", b": empty-name"]
REQUEST_LINES = st.builds(
    lambda m, p, v: m + b" " + p + b" " + v,
    st.sampled_from([b"GET", b"POST", b"HEAD", b"get", b"CONNECT", b""]),
    st.sampled_from([b"/v1/worker", b"/v1/hub/control", b"/v1/hub/data/abcdefgh12", b"/healthz", b"/", b"*",
                     b"/v1/worker?x=1", b"/" + b"a" * 20000, b"%%", b"http://gw.example/v1/worker"]),
    st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"HTTP/1.1x", b""]))


def _edit_lines(first: bytes, keep: list[bool], extra: list[bytes], tail: bytes) -> bytes:
    lines = [x for x, k in zip(_lines()[1:], keep) if k]
    return b"\r\n".join([first, *lines, *extra]) + b"\r\n\r\n" + tail


REQUESTS = st.one_of(
    st.binary(max_size=600),
    st.builds(lambda cut, junk: GOOD[:cut] + junk, st.integers(0, len(GOOD)), st.binary(max_size=60)),
    st.builds(_edit_lines, REQUEST_LINES, st.lists(st.booleans(), min_size=6, max_size=6),
              st.lists(st.sampled_from(HEADER_POOL), max_size=5), st.binary(max_size=30)),
)


async def exchange(gateway: Gateway, data: bytes, remote: str, eof: bool) -> bytes:
    client, server = trio.testing.memory_stream_pair()
    got = bytearray()
    with trio.fail_after(BUDGET_S):
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                try:
                    await gateway._handle(server, remote)  # type: ignore[arg-type]
                finally:
                    await server.aclose()

            nursery.start_soon(serve)
            try:
                await client.send_all(data)
                if eof:
                    await client.send_eof()
            except trio.BrokenResourceError:
                pass
            try:
                while chunk := await client.receive_some(1 << 16):
                    got += chunk
                    if b"HTTP/1.1 101 " in got[:13]:  # upgraded: leave, as a client that is gone
                        break
            except trio.BrokenResourceError:
                pass
            await client.aclose()
    return bytes(got)


@FUZZ
@given(REQUESTS, st.booleans(), st.sampled_from([WORKER_ADDR, HUB_ADDR, "[2001:db8::1]:5", "weird"]))
def test_any_request_gets_an_http_answer_or_a_close_and_is_counted_once(data: bytes, eof: bool, remote: str) -> None:
    async def main() -> None:
        gateway = Gateway(GatewayConfig(**CONFIG))  # type: ignore[arg-type]
        with capture_logs() as logs:
            answer = await exchange(gateway, data, remote, eof)
        for entry in logs:
            assert "exc_info" not in entry and entry["log_level"] not in ("error", "critical"), entry
        if answer:
            status_line = answer.split(b"\r\n", 1)[0]
            assert status_line.startswith(b"HTTP/1.1 "), answer[:200]
            status = int(status_line.split()[1])
            note_case(f"HTTP {status}")
            assert status in HTTP_STATUSES | {101}, answer[:300]
        refused = sum(gateway.statistics().refused.values())
        assert refused <= 1 and refused == sum(e["event"] == "connection refused" for e in logs)
        assert_empty(gateway)

    run(main)


# -- 2. WebSocket frames after the upgrade, through a splice --------------------------------------


def frame(fin: bool, rsv: int, opcode: int, masked: bool, mask: bytes, payload: bytes, length: str,
          lie: int) -> bytes:
    """One client frame, encoded by hand so that it can be wrong in every field."""
    n = len(payload) + lie if lie > 0 else len(payload)
    head = bytes([(0x80 if fin else 0) | (rsv << 4) | opcode])
    m = 0x80 if masked else 0
    if length == "7" and n < 126:
        head += bytes([m | n])
    elif length in ("7", "16") and n < 1 << 16:
        head += bytes([m | 126]) + struct.pack("!H", n)
    else:
        head += bytes([m | 127]) + struct.pack("!Q", n)
    if masked:
        head += mask
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return head + payload


def close_payload(code: int, reason: bytes) -> bytes:
    return struct.pack("!H", code) + reason


PAYLOADS = st.one_of(st.binary(max_size=200), st.builds(lambda n: b"x" * n, st.integers(0, 5000)),
                     st.builds(close_payload, st.sampled_from([1000, 1001, 1002, 1005, 1006, 1015, 999, 2000, 3000,
                                                               4999, 5000, 0, 65535]),
                               st.sampled_from([b"", b"bye", b"\xff\xfe", b"r" * 130])))
FRAMES = st.builds(frame,
                   fin=st.booleans() | st.just(True), rsv=st.sampled_from([0] * 12 + [1, 4, 7]),
                   opcode=st.sampled_from([0, 0, 1, 2, 2, 2, 8, 9, 10, 3, 7, 11, 15]),
                   masked=st.sampled_from([True] * 9 + [False]),
                   mask=st.binary(min_size=4, max_size=4), payload=PAYLOADS,
                   length=st.sampled_from(["7", "7", "16", "64"]), lie=st.sampled_from([0, 0, 0, 1, 1 << 20]))


def message(payload: bytes | str, cuts: list[int], mask: bytes) -> bytes:
    """A well-formed message (text when ``payload`` is a str) in fragments cut at ``cuts``."""
    data = payload.encode() if isinstance(payload, str) else payload
    edges = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    pieces = [data[a:b] for a, b in zip(edges, edges[1:])] or [b""]
    first = 1 if isinstance(payload, str) else 2
    return b"".join(frame(i == len(pieces) - 1, 0, first if i == 0 else 0, True, mask, piece, "7", 0)
                    for i, piece in enumerate(pieces))


MESSAGES = st.builds(message, st.one_of(st.binary(max_size=300), st.text(max_size=100),
                                        st.builds(lambda n: b"m" * n, st.integers(4000, 4200))),
                     st.lists(st.integers(0, 5000), max_size=3), st.binary(min_size=4, max_size=4))
SCRIPTS = st.tuples(
    st.lists(st.one_of(MESSAGES, MESSAGES, FRAMES), min_size=1, max_size=6),
    st.integers(0, 3),  # 0: whole, 1: one byte at a time, 2: cut short, 3: whole and trailing junk
    st.sampled_from(["eof", "hold", "close"]),  # then: EOF, silence (the gateway's timers end it), a close frame
)


async def paired(gateway: Gateway, nursery: trio.Nursery) -> tuple[MemClient, MemClient, MemClient]:
    async def dial(path: str, remote: str, subprotocols: list[str], headers: list[tuple[bytes, bytes]]) -> MemClient:
        client_stream, server_stream = trio.testing.memory_stream_pair()

        async def serve() -> None:
            try:
                await gateway._handle(server_stream, remote)  # type: ignore[arg-type]
            finally:
                await server_stream.aclose()

        nursery.start_soon(serve)
        return await open_client(client_stream, path, subprotocols=subprotocols, headers=headers)

    hub = await dial(HUB_CONTROL_PATH, HUB_ADDR, [GATEWAY_SUBPROTOCOL], AUTH)
    await trio.testing.wait_all_tasks_blocked()
    worker = await dial(WORKER_PATH, WORKER_ADDR, [TUNNEL_SUBPROTOCOL], [])
    announce = await hub.next_event()
    assert isinstance(announce, str)
    data = await dial(HUB_DATA_PREFIX + decode_pair(announce).pair_id, HUB_ADDR, [TUNNEL_SUBPROTOCOL], AUTH)
    assert (hub.status, worker.status, data.status) == (None, None, None)
    await trio.testing.wait_all_tasks_blocked()
    assert gateway.statistics().sessions == 1
    return hub, worker, data


@FUZZ
@given(SCRIPTS)
def test_any_frames_from_a_worker_are_relayed_or_closed_with_a_spec_code(script) -> None:  # type: ignore[no-untyped-def]
    frames, delivery, then = script
    wire = b"".join(frames)
    # After a close frame from the worker the gateway echoes its code, whatever it was.
    sent_codes = set(range(1000, 5000)) if any(f[0] & 0x0F == 8 for f in frames) or then == "close" else set()

    async def main() -> None:
        gateway = Gateway(GatewayConfig(**CONFIG))  # type: ignore[arg-type]
        with capture_logs() as logs, trio.fail_after(BUDGET_S):
            async with trio.open_nursery() as nursery:
                hub, worker, data = await paired(gateway, nursery)
                stream = worker.stream
                try:
                    if delivery == 1:
                        for i in range(len(wire)):
                            await stream.send_all(wire[i:i + 1])
                    elif delivery == 2:
                        await stream.send_all(wire[: len(wire) // 2])
                    else:
                        await stream.send_all(wire + (b"\x00\xff\x13" if delivery == 3 else b""))
                    if then == "eof":
                        await stream.send_eof()
                    elif then == "close":
                        await stream.send_all(frame(True, 0, 8, True, b"abcd", close_payload(1000, b""), "7", 0))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the gateway already closed it
                # The hub's side sees messages, then a close (or the end of its stream).
                relayed = 0
                for _ in range(len(frames) + 3):
                    event = await data.next_event()
                    if event is None or isinstance(event, CloseConnection):
                        break
                    assert len(event) <= MAX_MESSAGE
                    relayed += 1
                note_case(f"{min(relayed, 2)}+ messages relayed")
                # The worker's side sees a close with a code it may expect, or its stream ends.
                got = await worker.next_event()
                while got is not None and not isinstance(got, CloseConnection):
                    got = await worker.next_event()
                if isinstance(got, CloseConnection):
                    assert got.code in GATEWAY_CODES | sent_codes, got
                note_case(f"worker sees {got.code if isinstance(got, CloseConnection) else 'its stream end'}")
                for c in (worker, data, hub):
                    await c.aclose()
        for entry in logs:
            assert "exc_info" not in entry and entry["log_level"] not in ("error", "critical"), entry
        assert_empty(gateway)
        assert not gateway.statistics().hub_connected

    run(main)
