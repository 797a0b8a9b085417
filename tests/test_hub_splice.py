"""The hub's session splice (relay/hub/_sessions.py ``_Session``), in memory and on a fake clock.

The backbone's connections are ``memory_stream_pair``s gated by the real ``TargetGate`` (a
keyed first request, as grpcio sends it); the worker's WebSocket is two memory channels of
whole messages (what the session reads with ``receive_message`` and writes with ``send_message``).
The session's reader and its splices run as the hub runs them; the splice core is
tests/test_splice_core.py, the real WebSocket and real processes tests/test_tunnel_mux.py,
tests/test_many_backbones.py and tests/test_conformance.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

import hpack
import pytest
import trio
import trio.testing

from kvasir_rpc import CloseCode, ExpertSet, HelloInfo, RemoteProtocolError, Wallet
from kvasir_rpc._access import TARGET_KEY_METADATA, target_key
from kvasir_rpc.protocol import TunnelState
from relay.hub._registry import SessionRegistry
from relay.hub._sessions import HubConfig, _Session
from relay.hub._splice import SplicePhase
from relay.hub._target_gate import PREFACE

TOKEN = "t" * 32
SID = "s1-splice"
BUDGET_S = 60.0  # fake seconds a test may take; a hang jumps the clock here and fails
CLOSE_S = 7.0


def run(fn: Callable[[], Awaitable[None]]) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def _frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([ftype, flags]) + stream.to_bytes(4, "big") + payload


_HEADERS = _frame(1, 0x4, 1, hpack.Encoder().encode([
    (":method", "POST"), (":scheme", "http"), (":path", "/kvasir.v1.ExpertService/Dispatch"),
    (":authority", "127.0.0.1:1"), ("content-type", "application/grpc"), ("te", "trailers"),
    (TARGET_KEY_METADATA, target_key(TOKEN, SID))]))
_ACK = _frame(4, 1, 0)  # of the hub's SETTINGS: the gate answers it itself


def first_request() -> bytes:
    """A grpcio client's first bytes: preface, SETTINGS, the ACK, and a keyed HEADERS frame."""
    return PREFACE + _frame(4, 0, 0) + _ACK + _HEADERS


def forwarded() -> bytes:
    """What the worker gets of the first request: all of it but the ACK."""
    return PREFACE + _frame(4, 0, 0) + _HEADERS


class MemoryWebSocket:
    """The worker's WebSocket as the session sees it: whole messages each way."""

    def __init__(self) -> None:
        self._to_hub_send, self._to_hub = trio.open_memory_channel[bytes | str](64)
        self._to_worker, self._to_worker_recv = trio.open_memory_channel[bytes | str](64)
        self.on_rtt = None  # the session sets it (a clear session's keepalive is the WebSocket's)

    async def receive_message(self) -> bytes | str:
        return await self._to_hub.receive()

    async def receive_view(self) -> memoryview | str:
        message = await self._to_hub.receive()
        return message if isinstance(message, str) else memoryview(message).toreadonly()

    async def send_message(self, message: bytes | str | tuple[bytes, ...], *,
                           shielded_for: float | None = None) -> bool:
        await self._to_worker.send(b"".join(message) if isinstance(message, tuple) else message)
        return True

    # -- the worker's end --

    async def worker_sends(self, message: bytes | str) -> None:
        await self._to_hub_send.send(message)

    async def worker_gets(self) -> bytes | str:
        with trio.fail_after(BUDGET_S):
            return await self._to_worker_recv.receive()

    def nothing_for_worker(self) -> bool:
        return self._to_worker_recv.statistics().current_buffer_used == 0


@dataclasses.dataclass
class FakeHubParts:
    """What a session reads of its hub: the configuration and the (real) registry."""

    config: HubConfig
    registry: SessionRegistry


@dataclasses.dataclass
class Harness:
    session: _Session
    ws: MemoryWebSocket
    registry: SessionRegistry
    nursery: trio.Nursery

    async def connect(self) -> trio.StapledStream:
        """A backbone connection, admitted by the gate: its first request is sent, the
        hub's preface read."""
        client, server = trio.testing.memory_stream_pair()
        gate_scope = trio.CancelScope(deadline=trio.current_time() + BUDGET_S)
        self.nursery.start_soon(self.session._admit, server, gate_scope)
        await client.send_all(first_request())
        assert await read_exactly(client, 9) == bytes.fromhex("000000040000000000")  # the hub's SETTINGS
        return client

    def stats(self):  # type: ignore[no-untyped-def]
        stats = self.registry.get(SID)
        assert stats is not None
        return stats


async def read_exactly(stream: trio.abc.ReceiveStream, n: int) -> bytes:
    got = bytearray()
    with trio.fail_after(BUDGET_S):
        while len(got) < n:
            piece = await stream.receive_some(n - len(got))
            assert piece, f"the stream ended after {len(got)} of {n} bytes"
            got += piece
    return bytes(got)


async def ends(stream: trio.abc.ReceiveStream) -> None:
    with trio.fail_after(BUDGET_S):
        assert await stream.receive_some(1024) == b""


def new_session(ws: MemoryWebSocket, registry: SessionRegistry | None = None, *, channels: int = 0) -> _Session:
    """A session on ``ws`` whose hub has the real configuration (closes due in CLOSE_S) and
    ``registry`` (a fresh one if None)."""
    config = HubConfig(backbone_token=TOKEN, close_timeout_s=CLOSE_S)
    parts = FakeHubParts(config, registry if registry is not None else SessionRegistry())
    return _Session(parts, ws, SID, channels=channels)  # type: ignore[arg-type]


def harness(fn: Callable[[Harness], Awaitable[None]], *, channels: int = 0) -> Callable[[], Awaitable[None]]:
    async def main() -> None:
        registry = SessionRegistry()
        registry.add(SID, HelloInfo(wallet=Wallet.generate().address, slices={0: ExpertSet.of([0, 1])},
                                    weights_digest=b"d" * 32, device="cpu", model_type="qwen3_moe",
                                    worker_version="test"), target="127.0.0.1:1", remote="127.0.0.1:2")
        ws = MemoryWebSocket()
        session = new_session(ws, registry, channels=channels)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session._read)
            await fn(Harness(session, ws, registry, nursery))
            nursery.cancel_scope.cancel()

    return main


# -- the plain tunnel --------------------------------------------------------------------------


def test_one_connection_from_open_to_closed_and_the_next_on_the_same_tunnel() -> None:
    async def body(h: Harness) -> None:
        backbone = await h.connect()
        assert await h.ws.worker_gets() == "open"
        assert await h.ws.worker_gets() == forwarded()
        await h.ws.worker_sends(b"the answer")
        assert await read_exactly(backbone, 10) == b"the answer"
        await backbone.send_all(b"more")
        assert await h.ws.worker_gets() == b"more"
        assert h.stats().backbone_connections == 1
        await backbone.aclose()  # the backbone hangs up
        assert await h.ws.worker_gets() == "close"
        await h.ws.worker_sends(b"late bytes")  # sent before the worker saw "close": dropped
        await h.ws.worker_sends("eof")
        assert h.session.splices.phase(0) is SplicePhase.CLOSING
        await h.ws.worker_sends("closed")
        await trio.testing.wait_all_tasks_blocked()
        assert h.session.splices.phase(0) is SplicePhase.FREE
        stats = h.stats()
        assert (stats.bytes_to_worker, stats.bytes_from_worker) == (len(forwarded()) + 4, 10)
        assert stats.backbone_connections == 0
        # The tunnel carries the next connection.
        second = await h.connect()
        assert await h.ws.worker_gets() == "open"
        assert await h.ws.worker_gets() == forwarded()
        await h.ws.worker_sends(b"again")
        assert await read_exactly(second, 5) == b"again"

    run(harness(body))


def test_a_second_connection_while_one_is_spliced_is_told_it_is_busy() -> None:
    async def body(h: Harness) -> None:
        await h.connect()
        assert await h.ws.worker_gets() == "open"
        await h.ws.worker_gets()
        second = await h.connect()
        answer = await read_exactly(second, 9)
        length = int.from_bytes(answer[:3], "big")
        assert answer[3] == 1  # HEADERS, trailers-only
        headers = dict(hpack.Decoder().decode(await read_exactly(second, length)))
        assert headers["grpc-status"] == "8"  # RESOURCE_EXHAUSTED
        assert "carries 1 backbone connection already" in headers["grpc-message"]
        await second.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert h.ws.nothing_for_worker()  # the worker never heard of it
        assert h.stats().connections_refused_busy == 1 and h.stats().backbone_connections == 1

    run(harness(body))


def test_the_workers_eof_ends_the_backbones_connection() -> None:
    async def body(h: Harness) -> None:
        backbone = await h.connect()
        assert await h.ws.worker_gets() == "open"
        await h.ws.worker_gets()
        await h.ws.worker_sends(b"last words")
        await h.ws.worker_sends("eof")
        assert await read_exactly(backbone, 10) == b"last words"
        await ends(backbone)  # the hub closed it
        assert await h.ws.worker_gets() == "close"
        await h.ws.worker_sends("closed")
        await trio.testing.wait_all_tasks_blocked()
        assert h.session.splices.phase(0) is SplicePhase.FREE

    run(harness(body))


def test_a_backbone_that_stops_reading_ends_its_splice_not_the_session() -> None:
    async def body(h: Harness) -> None:
        backbone = await h.connect()
        assert await h.ws.worker_gets() == "open"
        await h.ws.worker_gets()
        await backbone.receive_stream.aclose()  # its receiving side is gone, its sending side open
        await h.ws.worker_sends(b"for nobody")
        assert await h.ws.worker_gets() == "close"  # the hub ended the splice
        await h.ws.worker_sends(b"more for nobody")  # late: dropped, not a protocol error
        await h.ws.worker_sends("closed")
        await trio.testing.wait_all_tasks_blocked()
        assert h.session.splices.phase(0) is SplicePhase.FREE
        await h.connect()  # the session lives on
        assert await h.ws.worker_gets() == "open"

    run(harness(body))


def test_a_worker_that_never_says_closed_ends_the_session_at_the_deadline() -> None:
    async def main() -> None:
        ws = MemoryWebSocket()
        session = new_session(ws)
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session._read)

            async def backbone() -> None:
                await client.send_all(first_request())
                await read_exactly(client, 9)
                assert await ws.worker_gets() == "open"
                await ws.worker_gets()
                await client.aclose()
                assert await ws.worker_gets() == "close"
                closed_at.append(trio.current_time())
                await ws.worker_sends(b"late")  # but never "closed"

            closed_at: list[float] = []
            nursery.start_soon(backbone)
            with pytest.raises(trio.TooSlowError):
                await session._admit(server, trio.CancelScope())
            assert trio.current_time() == pytest.approx(closed_at[0] + CLOSE_S)
            assert session.splices.tunnel_state(0) is TunnelState.CLOSING
            nursery.cancel_scope.cancel()

    run(main)


@pytest.mark.parametrize(("message", "says"), [
    (b"unasked", "the worker sent 7 bytes of data while the tunnel is IDLE"),
    ("eof", "the worker sent 'eof' while the tunnel is IDLE"),
    ("closed", "the worker sent 'closed' while the tunnel is IDLE"),
])
def test_a_worker_that_speaks_while_no_connection_is_open_ends_the_session_1002(message: bytes | str,
                                                                                says: str) -> None:
    async def main() -> None:
        ws = MemoryWebSocket()
        session = new_session(ws)
        await ws.worker_sends(message)
        with pytest.raises(RemoteProtocolError) as exc:
            await session._read()
        assert exc.value.close_code == CloseCode.PROTOCOL_ERROR and says in exc.value.reason

    run(main)


# -- a multiplexed tunnel ----------------------------------------------------------------------


def test_two_backbones_share_a_multiplexed_tunnel_and_a_third_is_busy() -> None:
    async def body(h: Harness) -> None:
        first = await h.connect()
        assert await h.ws.worker_gets() == "open 0"
        assert await h.ws.worker_gets() == b"\x00\x00" + forwarded()
        second = await h.connect()
        assert await h.ws.worker_gets() == "open 1"
        assert await h.ws.worker_gets() == b"\x00\x01" + forwarded()
        await h.ws.worker_sends(b"\x00\x01to the second")
        await h.ws.worker_sends(b"\x00\x00to the first")
        assert await read_exactly(second, 13) == b"to the second"
        assert await read_exactly(first, 12) == b"to the first"
        third = await h.connect()
        answer = await read_exactly(third, 9)
        headers = dict(hpack.Decoder().decode(await read_exactly(third, int.from_bytes(answer[:3], "big"))))
        assert headers["grpc-status"] == "8" and "carries 2 backbone connections" in headers["grpc-message"]
        await third.aclose()
        # The second ends; the first goes on; a new one takes channel 1.
        await h.ws.worker_sends("eof 1")
        await ends(second)
        assert await h.ws.worker_gets() == "close 1"
        await first.send_all(b"still here")
        assert await h.ws.worker_gets() == b"\x00\x00still here"
        await h.ws.worker_sends("closed 1")
        await h.connect()
        assert await h.ws.worker_gets() == "open 1"
        assert h.stats().backbone_connections == 2 and h.stats().connections_refused_busy == 1

    run(harness(body, channels=2))


def test_a_multiplexed_worker_writing_to_a_channel_not_open_ends_the_session_naming_it() -> None:
    async def main() -> None:
        ws = MemoryWebSocket()
        session = new_session(ws, channels=3)
        await ws.worker_sends(b"\x00\x02stray")
        with pytest.raises(RemoteProtocolError, match="channel 2: the worker sent 5 bytes of data while the tunnel "
                                                      "is IDLE") as exc:
            await session._read()
        assert exc.value.close_code == CloseCode.PROTOCOL_ERROR

    run(main)
